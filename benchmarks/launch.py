"""Small work on a GPU: eager, torch.compile (default, reduce-overhead) and autopar side by side.

Workloads (WORKLOADS.md, issue "small work on the GPU"):
- tiny chain: ``x = x * 1.0001 + 0.001`` ``--ops`` times on ``--numel`` floats. Goal: autopar
  no slower than torch.compile default.
- W1 bounds inside: ``B[:] = A[r0:r1, c0:c1]`` with the bounds made inside the function as 0-dim
  tensors on the device. Goal: autopar no slower than the same copy with Python-int bounds run
  eagerly ("eager python ints").
- W1 bounds passed in: the bounds are 0-dim device tensors the caller passes (shown, no goal).
- W2 a1 inside: ``a1 * A + a1 ** 2`` with ``a1 = torch.tensor(10.0, device=...)`` made inside.
  Goal: autopar no slower than the better of eager with a Python scalar and torch.compile default.
- W2 a1 passed in: ``a1`` a 0-dim device tensor the caller passes (shown, no goal).
- one op: ``x @ y`` at 5x10x5, the per-call cost of a call itself. Goal: autopar with
  ``guards="arguments"`` at most 1 us more than calling the op ("op itself").
- W3 host data (GPU only): ``(x.to("cuda") @ y.to("cuda")).cpu()`` at 5x10x5 with ``x``, ``y``
  on the host. Goal: autopar at most 1.3x ``x @ y`` on the host.
- ResNet-18 batch 1 (GPU only, with torchvision): the model's inference (parameters without
  grad). Goal: autopar no slower than ``torch.compile(mode="reduce-overhead")``.

Besides eager, ``torch.compile`` default and ``reduce-overhead``, each workload shows "dynamo
only" (``torch.compile(backend="eager")``): the graph captured and run as eager ops, which is
the per-call floor of anything built on ``torch.compile``, autopar included; "reduce-overhead
skip guards": reduce-overhead's calls inside ``torch.compiler.set_stance("default",
skip_guard_eval_unsafe=True)`` (after warm-up calls without it); "autopar arguments":
``autopar.compile(fn, guards="arguments")`` (its measured choice as ever); "autopar way" and
"autopar arguments, autopar way": the two with only autopar's way a candidate (through
dynamo, and the direct call into the learned graph: :mod:`autopar.capture.direct`).

Every variant's result is checked against eager before timing (``identical``: bit for bit;
otherwise the largest difference). Timings are medians of interleaved rounds
(:func:`autopar.bench.harness.measure_side_by_side`), every GPU synchronized after each sample;
autopar's timed trials (plain call or compiled) are over before timing starts.

    python benchmarks/launch.py [--device cuda:0] [--repeat 20] [--json PATH]

On a host without CUDA the GPU rows are skipped and the workloads run on the host (as
``--device cpu`` asks): the per-call cost of each way on this CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

import autopar
from autopar.api import dispatcher_of
from autopar.bench.harness import settle
from autopar.bench.measure import Stats, in_process_compiles, measure_side_by_side
from autopar.bench.workloads import w1_bounds_inside, w1_slice, w3_via_gpu
from autopar.capture.dynamo import with_own_code

US = 1e6


# -- workloads ---------------------------------------------------------------------------------
def tiny_chain(n_ops: int) -> Callable:
    def chain(x):
        for _ in range(n_ops):
            x = x * 1.0001 + 0.001
        return x
    return chain


def w2_a1_inside(A):
    a1 = torch.tensor(10.0, device=A.device)
    return a1 * A + a1**2


def w2_scalar(a1, A):
    return a1 * A + a1**2


def one_op(x, y):
    return x @ y


def skipping_guards(fn: Callable, warmup: int = 3) -> Callable:
    """``fn`` (a torch.compile result) called inside ``set_stance(skip_guard_eval_unsafe=True)``
    from its ``warmup + 1``-th call (a recompile under that stance is an error)."""
    calls = [0]

    def call(*args: Any) -> Any:
        if calls[0] < warmup:
            calls[0] += 1
            return fn(*args)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return fn(*args)
    return call


# -- variants ----------------------------------------------------------------------------------
def compiled_variants(fn: Callable, args: tuple, devices: str | None) -> dict[str, tuple]:
    """eager, dynamo only, torch.compile default and reduce-overhead, autopar: (callable, args).

    Each compiled variant compiles its own copy of ``fn``'s code (``with_own_code``): dynamo
    caches per code object, and five backends on one would count as recompiles."""
    options = {"devices": devices} if devices else {}
    return {
        "eager": (fn, args),
        "dynamo only": (torch.compile(with_own_code(fn), backend="eager"), args),
        "torch.compile": (torch.compile(with_own_code(fn)), args),
        "reduce-overhead": (torch.compile(with_own_code(fn), mode="reduce-overhead"), args),
        "reduce-overhead skip guards": (
            skipping_guards(torch.compile(with_own_code(fn), mode="reduce-overhead")), args),
        "autopar": (autopar.compile(with_own_code(fn), **options), args),
        "autopar way": (autopar.compile(with_own_code(fn), candidates="autopar", **options), args),
        "autopar arguments": (autopar.compile(with_own_code(fn), guards="arguments", **options),
                              args),
        "autopar arguments, autopar way": (
            autopar.compile(with_own_code(fn), guards="arguments", candidates="autopar", **options),
            args),
    }


AUTOPAR = ("autopar", "autopar arguments")  # the variants a goal is checked for


def workloads(device: str, n_ops: int, numel: int) -> dict[str, dict[str, Any]]:
    """name -> {"variants": {name: (fn, args)}, "goal": (variant names it must not exceed)}."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen) + 0.01).to(device)

    def scalar(v: float | int) -> torch.Tensor:
        return torch.tensor(v, device=device)

    devices = None if device.startswith("cuda") else "cpu:0"
    A, B, A2 = rand(600, 600), rand(256, 256), rand(600, 600)
    out: dict[str, dict[str, Any]] = {}
    out["tiny chain"] = {"variants": compiled_variants(tiny_chain(n_ops), (rand(numel),),
                                                       devices),
                         "goal": ("torch.compile",)}
    w1 = compiled_variants(w1_bounds_inside, (A, B.clone()), devices)
    w1["eager python ints"] = (w1_slice, (A, B.clone(), 100, 356, 100, 356))
    out["W1 bounds inside"] = {"variants": w1, "goal": ("eager python ints",)}
    bounds = tuple(scalar(b) for b in (100, 356, 100, 356))
    out["W1 bounds passed in"] = {
        "variants": compiled_variants(w1_slice, (A, B.clone(), *bounds), devices), "goal": ()}
    w2 = compiled_variants(w2_a1_inside, (A2,), devices)
    w2["eager python scalar"] = (w2_scalar, (10.0, A2))
    out["W2 a1 inside"] = {"variants": w2, "goal": ("eager python scalar", "torch.compile")}
    out["W2 a1 passed in"] = {
        "variants": compiled_variants(w2_scalar, (scalar(10.0), A2), devices), "goal": ()}
    x, y = rand(5, 10), rand(10, 5)
    op = compiled_variants(one_op, (x, y), devices)
    op["op itself"] = (torch.matmul, (x, y))
    out["one op"] = {"variants": op, "goal": ("op itself",), "slack_s": 1e-6,
                     "for": ("autopar arguments",)}
    if device.startswith("cuda"):
        xh, yh = x.cpu(), y.cpu()
        w3 = compiled_variants(w3_via_gpu, (xh, yh), None)
        w3["x @ y on the host"] = (torch.matmul, (xh, yh))
        out["W3 host data"] = {"variants": w3, "goal": ("x @ y on the host",), "factor": 1.3}
        resnet = resnet18_variants(device)
        if resnet is not None:
            out["ResNet-18 batch 1"] = {"variants": resnet, "goal": ("reduce-overhead",)}
    return out


def resnet18_variants(device: str) -> dict[str, tuple] | None:
    """torchvision's ResNet-18 at batch 1 (random weights, eval, no grad on its parameters):
    each variant its own copy; None without torchvision."""
    try:
        import torchvision
    except ImportError:
        return None
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(device).requires_grad_(False)
    image = torch.rand(1, 3, 224, 224, device=device)

    return {
        "eager": (model, (image,)),
        "torch.compile": (torch.compile(copy.deepcopy(model)), (image,)),
        "reduce-overhead": (torch.compile(copy.deepcopy(model), mode="reduce-overhead"),
                            (image,)),
        "autopar": (autopar.compile(copy.deepcopy(model)), (image,)),
        "autopar arguments": (autopar.compile(copy.deepcopy(model), guards="arguments"),
                              (image,)),
    }


# -- checking and timing -----------------------------------------------------------------------
def check(variants: dict[str, tuple]) -> dict[str, str]:
    """Each variant's result against eager's: "identical", a max difference, or the error."""
    fn, args = variants["eager"]
    expected = fn(*args)
    expected = expected.clone() if isinstance(expected, torch.Tensor) else expected
    verdicts = {}
    for name, (f, a) in variants.items():
        try:
            got = f(*a)
        except Exception as e:  # a variant that fails is reported, not fatal
            verdicts[name] = f"error: {type(e).__name__}: {e}"
            continue
        if torch.equal(got, expected) and got.device == expected.device:
            verdicts[name] = "identical"
        else:
            diff = (got.double().to(expected.device) - expected.double()).abs().max().item()
            verdicts[name] = f"max |diff| {diff:.3g}"
    return verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a check of the script")
    ap.add_argument("--ops", type=int, default=100, help="ops in the tiny chain")
    ap.add_argument("--numel", type=int, default=64, help="floats in the tiny chain")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    in_process_compiles()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: the GPU rows are skipped; the workloads run on the host")
        args.device = "cpu"
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    rows: dict[str, dict[str, Any]] = {}
    for name, w in workloads(args.device, args.ops, args.numel).items():
        verdicts = check(w["variants"])
        for variant, (fn, fn_args) in w["variants"].items():
            if variant.startswith("autopar"):
                settle(fn, fn_args, 1)  # its trials over before timing, as in the suite
        stats = measure_side_by_side(w["variants"], warmup=3, repeat=args.repeat,
                                     budget_s=5.0)
        times = {v: s.median for v, s in stats.items() if isinstance(s, Stats)}
        goal = [g for g in w["goal"] if g in times]
        target = min((times[g] for g in goal), default=None)
        if target is not None:
            target = target * w.get("factor", 1.0) + w.get("slack_s", 0.0)
        met = {v: None if target is None or v not in times else times[v] <= target
               for v in w.get("for", AUTOPAR)}
        dispatchers = {v: d for v, (fn, _) in w["variants"].items()
                       if (d := dispatcher_of(fn)) is not None}
        rows[name] = {
            "median_s": times,
            "errors": {v: f"{type(s).__name__}: {s}" for v, s in stats.items()
                       if not isinstance(s, Stats)},
            "check": verdicts, "goal": goal, "slack_s": w.get("slack_s", 0.0),
            "factor": w.get("factor", 1.0),
            "goal_met": met,
            # what each autopar variant kept, and its trials' medians (a choice that missed
            # the fastest way shows here)
            "explain": {v: d.explain() for v, d in dispatchers.items()},
            # ...and the last trial's counted calls, way -> host and GPU seconds in call order
            "trials": {v: {"host": d.last_trial.host, "gpu": d.last_trial.gpu}
                       for v, d in dispatchers.items() if d.last_trial is not None}}

    print(f"{'workload':<20} {'variant':<30} {'median us':>10} {'vs eager':>9}  result")
    for name, row in rows.items():
        eager = row["median_s"].get("eager")
        for variant, t in row["median_s"].items():
            ratio = f"{eager / t:>8.2f}x" if eager else f"{'-':>9}"
            print(f"{name:<20} {variant:<30} {t * US:>10.2f} {ratio}  {row['check'][variant]}")
        for variant, err in row["errors"].items():
            print(f"{name:<20} {variant:<30} {'failed':>10}            {err}")
        if row["goal"]:
            slack = f" + {row['slack_s'] * US:g} us" if row["slack_s"] else ""
            for variant, met in row["goal_met"].items():
                verdict = {True: "met", False: "NOT met", None: "not measured"}[met]
                scale = f"{row['factor']:g} x " if row["factor"] != 1.0 else ""
                print(f"{'':<20} goal: {variant} <= {scale}{' and '.join(row['goal'])}{slack}: "
                      f"{verdict}")
        for variant in AUTOPAR:
            if variant in row["explain"]:
                print(f"{'':<20} {variant}: {row['explain'][variant]}")
    result = {"benchmark": "launch", "date": date.today().isoformat(), "host": platform.node(),
              "torch": torch.__version__, "device": args.device,
              "gpu": torch.cuda.get_device_name(torch.device(args.device))
              if args.device.startswith("cuda") else None,
              "ops": args.ops, "numel": args.numel, "repeat": args.repeat, "rows": rows}
    out = args.json or Path(__file__).parent / "results" / f"launch-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

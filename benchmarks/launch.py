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

Besides eager, ``torch.compile`` default and ``reduce-overhead``, each workload shows "dynamo
only" (``torch.compile(backend="eager")``): the graph captured and run as eager ops, which is
the per-call floor of anything built on ``torch.compile``, autopar included.

Every variant's result is checked against eager before timing (``identical``: bit for bit;
otherwise the largest difference). Timings are medians of interleaved rounds
(:func:`autopar.bench.harness.measure_side_by_side`), every GPU synchronized after each sample;
autopar's timed trials (plain call or compiled) are over before timing starts.

    python benchmarks/launch.py [--device cuda:0] [--repeat 20] [--json PATH]

On a host without CUDA it exits with a message, unless ``--device cpu`` asks for the CPU run
(the same variants on the host: a check of the script, not the measurement it is for).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

import autopar
from autopar.bench.harness import settle
from autopar.bench.measure import Stats, in_process_compiles, measure_side_by_side

US = 1e6


# -- workloads ---------------------------------------------------------------------------------
def tiny_chain(n_ops: int) -> Callable:
    def chain(x):
        for _ in range(n_ops):
            x = x * 1.0001 + 0.001
        return x
    return chain


def w1_bounds_inside(A, B):
    d = A.device
    r0, r1 = torch.tensor(100, device=d), torch.tensor(356, device=d)
    c0, c1 = torch.tensor(100, device=d), torch.tensor(356, device=d)
    B[:] = A[r0:r1, c0:c1]
    return B


def w1_slice(A, B, r0, r1, c0, c1):
    B[:] = A[r0:r1, c0:c1]
    return B


def w2_a1_inside(A):
    a1 = torch.tensor(10.0, device=A.device)
    return a1 * A + a1**2


def w2_scalar(a1, A):
    return a1 * A + a1**2


# -- variants ----------------------------------------------------------------------------------
def compiled_variants(fn: Callable, args: tuple, devices: str | None) -> dict[str, tuple]:
    """eager, dynamo only, torch.compile default and reduce-overhead, autopar: (callable, args).

    Each compiled variant compiles its own copy of ``fn``'s code: dynamo caches per code
    object, and five backends on one would count as recompiles."""
    def copy_of(f: Callable) -> Callable:
        g = type(f)(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                    f.__closure__)
        return g

    options = {"devices": devices} if devices else {}
    return {
        "eager": (fn, args),
        "dynamo only": (torch.compile(copy_of(fn), backend="eager"), args),
        "torch.compile": (torch.compile(copy_of(fn)), args),
        "reduce-overhead": (torch.compile(copy_of(fn), mode="reduce-overhead"), args),
        "autopar": (autopar.compile(copy_of(fn), **options), args),
    }


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
    return out


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
        raise SystemExit("launch.py measures small work on a GPU and this host has no CUDA "
                         "device; run it with --device cpu to check the script on the host")
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    rows: dict[str, dict[str, Any]] = {}
    for name, w in workloads(args.device, args.ops, args.numel).items():
        verdicts = check(w["variants"])
        fn, fn_args = w["variants"]["autopar"]
        settle(fn, fn_args, 1)  # its trials over before timing, as in the suite
        stats = measure_side_by_side(w["variants"], warmup=3, repeat=args.repeat,
                                     budget_s=5.0)
        times = {v: s.median for v, s in stats.items() if isinstance(s, Stats)}
        goal = [g for g in w["goal"] if g in times]
        target = min((times[g] for g in goal), default=None)
        met = None if target is None or "autopar" not in times else times["autopar"] <= target
        rows[name] = {
            "median_s": times,
            "errors": {v: f"{type(s).__name__}: {s}" for v, s in stats.items()
                       if not isinstance(s, Stats)},
            "check": verdicts, "goal": goal, "goal_met": met}

    print(f"{'workload':<22} {'variant':<22} {'median us':>10} {'vs eager':>9}  result")
    for name, row in rows.items():
        eager = row["median_s"].get("eager")
        for variant, t in row["median_s"].items():
            ratio = f"{eager / t:>8.2f}x" if eager else f"{'-':>9}"
            print(f"{name:<22} {variant:<22} {t * US:>10.1f} {ratio}  {row['check'][variant]}")
        for variant, err in row["errors"].items():
            print(f"{name:<22} {variant:<22} {'failed':>10}            {err}")
        if row["goal"]:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[row["goal_met"]]
            print(f"{'':<22} goal: autopar <= {' and '.join(row['goal'])}: {verdict}")
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

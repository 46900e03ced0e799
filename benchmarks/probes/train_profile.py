"""Probe: where a training step's time goes under ``torch.compile`` and under
``autopar.compile`` (benchmarks/NOTES.md, 2026-12-02 (c): BERT's AdamW step 0.94× of the
better, unexplained). Per variant: wall time per step (median of 20), GPU kernel time per step,
kernels launched per step, dynamo's graphs, graph breaks (the first reasons) and the graphs
cudagraph trees skipped (``counters``; ``TORCH_LOGS=perf_hints`` says why), the kernels
whose time differs most between the two variants of ``--pair``, and any parameter or
optimizer-state tensor whose shape, strides, dtype or device differs between those two
variants' models.

    PYTHONPATH=src python benchmarks/probes/train_profile.py [MODEL ...] [--json out.json]
        [--variants compile,autopar] [--pair compile,autopar]

Variants: ``eager``, ``compile``, ``compile-ro`` (``mode="reduce-overhead"``), ``autopar``,
``autopar-eager`` (``candidates="eager"``: autopar's eager way after its capture, as a trial
that keeps eager leaves it) and ``autopar-eager-asis`` (the same without the optimizers' eager form,
:mod:`autopar.capture.optim`).

The step is benchmarks/models.py's ``train`` mode: AdamW, zero_grad, loss, backward, step,
compiled whole, fp32 with TF32 off, batch 8, length 128.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import autopar
import autopar.api as api
from autopar.api import dispatcher_of
from autopar.bench.models import MODELS, fixed_step, inputs_for, without_dropout

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run, no kernels


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _kernels(fn, steps: int) -> tuple[Counter, Counter]:
    """Per kernel name: total device µs and launches over ``steps`` calls."""
    if DEV == "cpu":
        return Counter(), Counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    us, n = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") \
                else e.cuda_time_total
            n[e.name[:90]] += 1
    return us, n


def _build(v: str, step):
    if v == "eager":
        return step
    if v == "compile":
        return torch.compile(step)
    if v == "compile-ro":
        return torch.compile(step, mode="reduce-overhead")
    if v == "autopar":
        return autopar.compile(step)
    fn = autopar.compile(step, candidates="eager")
    if v == "autopar-eager-asis":  # its first call finds no optimizer to keep as built
        real = api.dynamo_changes_optimizers
        api.dynamo_changes_optimizers = lambda: False
        try:
            fn()
        finally:
            api.dynamo_changes_optimizers = real
    return fn


def _desc(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, str(t.device))


def _state_differs(a, b) -> list[str]:
    """The parameters and optimizer-state tensors that differ in layout between two
    (model, optimizer) pairs built alike."""
    (ma, oa), (mb, ob) = a, b
    out = []
    for (n, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
        if _desc(p) != _desc(q):
            out.append(f"{n}: {_desc(p)} vs {_desc(q)}")
        for k, x in oa.state.get(p, {}).items():
            y = ob.state.get(q, {}).get(k)
            if isinstance(x, torch.Tensor) and (not isinstance(y, torch.Tensor)
                                                or _desc(x) != _desc(y)):
                out.append(f"{n} {k}: {_desc(x)} vs {_desc(y) if y is not None else None}")
    for ga, gb in zip(oa.param_groups, ob.param_groups, strict=True):
        out += [f"group {k}: {ga[k]!r} vs {gb.get(k)!r}" for k in ga
                if k != "params" and ga[k] != gb.get(k)]
    return out


def probe(name: str, variants: list[str], pair: list[str], cprofiled: str | None = None,
          steps: int = 10) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = MODELS[name]
    args, kwargs = inputs_for(m, "small", batch=8, length=128, device=DEV)
    base = without_dropout(m.make("small").to(DEV).train())
    fns, owned, made = {}, {}, {}
    for v in variants:
        counters.clear()
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        owned[v] = (model, opt)
        fns[v] = _build(v, fixed_step(model, opt, args, kwargs))
        for _ in range(30):  # compiled and past autopar's trials
            fns[v]()
        _sync()
        made[v] = {"graphs": counters["stats"]["unique_graphs"],
                   "graph breaks": sum(counters["graph_break"].values()),
                   "cudagraph skips": counters["inductor"]["cudagraph_skips"],
                   "break reasons": [k[:160] for k in counters["graph_break"]][:5]}
    row: dict = {"model": name, "made": made}
    d = dispatcher_of(fns["autopar"]) if "autopar" in fns else None
    row["kept"] = sorted(set(d.kept.values())) if d is not None else []
    row["explain"] = d.explain() if d is not None else ""
    row["state_differs"] = _state_differs(owned[pair[0]], owned[pair[1]])
    wall = {v: [] for v in fns}
    for _ in range(20):  # interleaved
        for v, fn in fns.items():
            _sync()
            t = time.perf_counter()
            fn()
            _sync()
            wall[v].append(time.perf_counter() - t)
    prof = {v: _kernels(fn, steps) for v, fn in fns.items()}
    for v in fns:
        us, n = prof[v]
        row[v] = {"wall_ms": statistics.median(wall[v]) * 1e3,
                  "gpu_ms": sum(us.values()) / steps / 1e3,
                  "kernels": sum(n.values()) / steps}
    if cprofiled:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            fns[cprofiled]()
        _sync()
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(20)
        row["cprofile"] = text.getvalue()
    (cu, cn), (au, an) = prof[pair[0]], prof[pair[1]]
    diff = sorted(set(cu) | set(au), key=lambda k: -abs(au[k] - cu[k]))[:15]
    row["differ"] = [{"kernel": k, "a_us": cu[k] / steps, "b_us": au[k] / steps,
                      "a_n": cn[k] / steps, "b_n": an[k] / steps} for k in diff]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["bert"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--variants", default="compile,autopar")
    ap.add_argument("--cprofile", default=None,
                    help="a variant whose host time is profiled (cProfile, 10 steps)")
    ap.add_argument("--pair", default=None, help="two variants to compare (default: the first two)")
    a = ap.parse_args()
    variants = a.variants.split(",")
    pair = a.pair.split(",") if a.pair else variants[:2]
    rows = []
    for name in a.models:
        try:
            r = probe(name, variants, pair, a.cprofile)
        except Exception as e:  # one model's failure is its row's
            r = {"model": name, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(r)
        if "error" in r:
            print(f"{name}: {r['error']}")
            continue
        print(f"== {name} kept {r['kept']}")
        for v in variants:
            x = r[v]
            print(f"  {v:20s} wall {x['wall_ms']:.2f} ms  gpu {x['gpu_ms']:.2f} ms  "
                  f"kernels {x['kernels']:.0f}")
        for v, m in r["made"].items():
            print(f"  {v:20s} made {m}")
        print(f"  kernels that differ most, {pair[0]} vs {pair[1]} (µs per step, launches):")
        for k in r["differ"]:
            print(f"    {k['a_us']:8.1f} {k['b_us']:8.1f}  "
                  f"{k['a_n']:4.0f} {k['b_n']:4.0f}  {k['kernel']}")
        print(f"  parameters and state laid out differently: {len(r['state_differs'])}")
        for line in r["state_differs"][:12]:
            print("    " + line)
        print(r["explain"])
        print(r.get("cprofile", ""))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()

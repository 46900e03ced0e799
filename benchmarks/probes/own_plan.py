"""Probe: why autopar's own plan of a real model runs slower than eager's sequence on one GPU
(benchmarks/NOTES.md, 2026-12-05 (f): GPT-2 inference on an H100, trial medians eager 6.7 ms,
autopar's way 27.5 ms, host-bound; the simulator had predicted it faster, else it would run as
eager's sequence). Per model: eager's median call, autopar's way forced
(``candidates=("autopar",)``) and its prediction, what the plan holds (ops per device, copies,
fused regions, CUDA-graph segments, host reads), and where the host's time goes over 20 calls
(cProfile's functions by own time, autopar's and torch's Python).

    PYTHONPATH=src python benchmarks/probes/own_plan.py [MODEL ...] [--mode infer|bf16]
        [--size small] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import Counter

import torch

import autopar
from autopar.api import Options, Runner, dispatcher_of
from autopar.bench.models import MODELS, inputs_for
from autopar.capture.dynamo import make_backend
from autopar.ir.graph import op_name
from autopar.schedule.steps import Run, Send

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run


def _median(call, n: int = 30) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        if DEV == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(name: str, mode: str, size: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    m = MODELS[name]
    model = m.make(size).to(DEV)
    args, kwargs = inputs_for(m, size, batch=8 if size == "small" else 3, length=128
                              if size == "small" else 11, device=DEV)
    kwargs.pop("labels", None)
    ctx = (lambda: torch.autocast(DEV, torch.bfloat16)) if mode == "bf16" \
        else contextlib.nullcontext

    def runner(fn):
        def call():
            with torch.no_grad(), ctx():
                return fn(*args, **kwargs)
        return call

    row: dict = {"model": name, "mode": mode, "eager_s": _median(runner(model))}
    compiled = autopar.compile(model, candidates=("autopar",))
    call = runner(compiled)
    call()
    row["autopar_s"] = _median(call)
    interval = sys.getswitchinterval()  # a GIL convoy between the caller and a host worker
    sys.setswitchinterval(interval / 10)  # shows as a ~10x shorter call
    row["autopar_s_switch_tenth"] = _median(call)
    sys.setswitchinterval(interval)
    runner_ = dispatcher_of(compiled).runner
    plans = [e.plan for e in runner_.executors]
    row["runs_as"] = [e.runs_as for e in runner_.executors]
    row["threads"] = [{"inline": e.inline, "threaded": list(e.threaded)}
                      for e in runner_.executors]
    row["graphs"], row["planned"] = runner_.graphs, runner_.planned
    row["predicted_s"] = sum(p.placement.predicted_s for p in plans)
    row["ops_per_device"] = dict(Counter(p.placement.device[n] for p in plans
                                         for n in p.graph.ops))
    steps = [s for p in plans for prog in p.programs.values() for s in prog]
    row["sends"] = sum(isinstance(s, Send) for s in steps)
    row["runs"] = sum(isinstance(s, Run) for s in steps)
    row["fused_regions"] = sum(len(getattr(e, "fused", ()) or ()) for e in runner_.executors)
    row["segments"] = sum(len(getattr(e, "segments", ()) or ()) for e in runner_.executors)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    if DEV == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    row["host_profile"] = out.getvalue().splitlines()[-32:]
    row["host_threads"] = torch.get_num_threads()
    row["again"] = _again(model, runner)
    traced = Runner(Options.parse({"trace": True}))
    row["ops"] = _per_op(traced, runner(torch.compile(model, backend=make_backend(traced))))
    return row


def _again(model, runner) -> dict:
    """The same model compiled anew, after the first compiled object's calls 2-6 learned its
    host ops' times (autopar.runtime.learn, saved beside the profile): its plan and time."""
    compiled = autopar.compile(model, candidates=("autopar",))
    call = runner(compiled)
    call()
    executors = dispatcher_of(compiled).runner.executors
    return {"autopar_s": _median(call),
            "predicted_s": sum(e.plan.placement.predicted_s for e in executors),
            "ops_per_device": dict(Counter(e.plan.placement.device[n] for e in executors
                                           for n in e.plan.graph.ops))}


def _meta(node) -> str:
    m = node.meta
    if hasattr(m, "shape"):
        return f"{str(m.dtype).removeprefix('torch.')}{list(m.shape)}"
    return type(m).__name__


def _per_op(traced, call) -> list[dict]:
    """A traced call (``trace=True``: every op timed on its lane, copies on side streams) after
    three untraced ones: each op's measured time beside its planned time, the ops furthest over
    plan first (where a 4-5x miss comes from)."""
    for _ in range(4):
        call()
    if DEV == "cuda":
        torch.cuda.synchronize()
    rows = []
    for e in traced.executors:
        if e.last_timeline is None:
            continue
        nodes = e.plan.graph.nodes
        slots = e.plan.placement.slots
        for span in e.last_timeline.spans:
            if span.kind != "op" or span.node is None:
                continue
            node = nodes[span.node]
            slot = slots.get(node)
            planned = slot.end - slot.start if slot is not None else float("nan")
            rows.append({"lane": span.lane, "op": op_name(node.op), "node": node.id,
                         "out": _meta(node), "ins": [_meta(i) for i in node.inputs][:3],
                         "measured_us": span.duration * 1e6, "planned_us": planned * 1e6})
    rows.sort(key=lambda r: r["measured_us"] - (0.0 if r["planned_us"] != r["planned_us"]
                                                else r["planned_us"]), reverse=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["gpt2", "bert"])
    ap.add_argument("--mode", default="infer", choices=("infer", "bf16"))
    ap.add_argument("--size", default="small" if DEV == "cuda" else "tiny")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for name in a.models:
        row = probe(name, a.mode, a.size)
        rows.append(row)
        print(f"{name} {a.mode}: eager {row['eager_s'] * 1e3:.2f} ms, autopar's way "
              f"{row['autopar_s'] * 1e3:.2f} ms (predicted {row['predicted_s'] * 1e3:.2f}), "
              f"runs as {row['runs_as']}, ops {row['ops_per_device']}, sends {row['sends']}, "
              f"fused regions {row['fused_regions']}, segments {row['segments']}, programs "
              f"{row['threads']}; GIL switch interval / 10: "
              f"{row['autopar_s_switch_tenth'] * 1e3:.2f} ms")
        print("\n".join(row["host_profile"]))
        again = row["again"]
        print(f"compiled again, after learning: {again['autopar_s'] * 1e3:.2f} ms (predicted "
              f"{again['predicted_s'] * 1e3:.2f}), ops {again['ops_per_device']}")
        total = {}
        for r in row["ops"]:
            lane = total.setdefault(r["lane"], [0.0, 0.0])
            lane[0] += r["measured_us"]
            lane[1] += r["planned_us"] if r["planned_us"] == r["planned_us"] else 0.0
        print(f"host threads {row['host_threads']}; per lane, measured / planned us: "
              + ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}" for k, v in total.items()))
        for r in row["ops"][:15]:
            print(f"  {r['lane']:16} {r['op']:40} {r['measured_us']:9.1f} us "
                  f"(planned {r['planned_us']:7.1f})  {r['out']} <- {r['ins']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

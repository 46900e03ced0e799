"""W6 (a 2-layer MLP training step) with its batch split across GPUs by ``autopar.data_parallel``.

Predicted on a preset always (eager, autopar unsplit, autopar split: the Gantt chart of the
chosen plan and the placed-graph picture); measured too where two GPUs are at hand: eager on one
GPU, the hand-written data-parallel step, and autopar, each checked against eager after 20
steps, with autopar's measured timeline beside its prediction.

    python benchmarks/data_parallel.py [--simulate h200x2] [--size full] [--repeat 10]
                                       [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    import autopar
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import autopar

from autopar.bench.measure import in_process_compiles, measure
from autopar.bench.workloads import WORKLOADS, w6_data_parallel, w6_train_step
from autopar.dataparallel import predict_step
from autopar.ir.units import fmt_seconds
from autopar.report.graphviz import render
from autopar.report.trace import save_chrome_trace, save_gantt


def predicted(machine: str, out: Path | None) -> dict:
    w = WORKLOADS["W6"]
    got = predict_step(w.eager, w.make_inputs(("cpu",), "full"), machine)
    choice = got.choice
    print(f"predicted on {machine}: eager {fmt_seconds(got.eager_s)}; " + ", ".join(
        f"{k} {fmt_seconds(v)}" for k, v in choice.predicted.items()))
    if out is not None:
        save_gantt(got.timeline, out / "timeline-W6-data-parallel.png",
                   title=f"W6 data parallel on {machine} (simulated)")
        print(f"wrote {render(choice.placement, out / 'placed-W6-data-parallel.svg')}")
    return {"machine": machine, "eager_s": got.eager_s, "candidates_s": choice.predicted,
            "chosen": "unsplit" if choice.sharded is None else list(choice.sharded.devices)}


def autopar_devices(devices: tuple[str, str]) -> str:
    """Every GPU and the host when the workload runs on GPUs, else two CPU workers."""
    return "auto" if devices[0].startswith("cuda") else "cpu:0,cpu:1"


def measured(size: str, repeat: int, out: Path | None, sim: dict,
             devices: tuple[str, str] = ("cuda:0", "cuda:1")) -> dict:
    w = WORKLOADS["W6"]
    base = w.make_inputs(devices, size)

    def fresh() -> tuple:
        return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in base)

    ref, mine = fresh(), fresh()
    step = autopar.data_parallel(w6_train_step, devices=autopar_devices(devices))
    for _ in range(20):  # correctness first: 20 steps against eager
        w.check(step(*mine), w6_train_step(*ref))
    w.check(list(mine[:4]), list(ref[:4]))
    hand_args = w.prepare_hand(fresh(), devices)
    times = {
        "eager": measure(w6_train_step, *fresh(), repeat=repeat, inner=1).median,
        "hand": measure(w6_data_parallel, *hand_args, repeat=repeat, inner=1).median,
        "autopar": measure(step, *mine, repeat=repeat, inner=1).median,
    }
    chosen = step.last.sharded
    print("measured: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in times.items())
          + f"; autopar ran {'unsplit' if chosen is None else ','.join(chosen.devices)}, "
          f"{times['eager'] / times['autopar']:.2f}x eager")
    if out is not None:  # the timeline from a traced run of its own (events cost time)
        traced = autopar.data_parallel(w6_train_step, devices=autopar_devices(devices),
                                       trace=True)
        args = fresh()
        for _ in range(3):
            traced(*args)
        timeline = traced.last.run.last_timeline
        sim_tl = predict_step(w.eager, w.make_inputs(("cpu",), size), sim["machine"]).timeline
        save_gantt(timeline, out / "timeline-W6-data-parallel-measured.png", predicted=sim_tl,
                   title="W6 data parallel, 2xH200")
        save_chrome_trace(timeline, out / "trace-W6-data-parallel.json",
                          traced.last.choice.placement.graph)
    return {"size": size, "median_s": times, "predicted_here_s": step.last.choice.predicted,
            "chosen": None if chosen is None else list(chosen.devices)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--simulate", default="h200x2", help="the preset to predict on")
    p.add_argument("--size", default="full", choices=("full", "small"))
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", type=Path, help="write the pictures and a JSON result here")
    p.add_argument("--json", type=Path, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    in_process_compiles()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    result = {"predicted": predicted(args.simulate, args.out)}
    if torch.cuda.device_count() >= 2:
        result["measured"] = measured(args.size, args.repeat, args.out, result["predicted"])
    else:
        print("measured: skipped (needs 2 GPUs)")
    if args.out is not None:
        path = args.out / "data_parallel-W6.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

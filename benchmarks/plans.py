"""Where autopar puts each workload on this machine, and what a traced call of it shows.

    python benchmarks/plans.py W2 W3/256x256x256/host rnn_cell [--size full] [--json PATH]

For every graph of each workload: ops per device, copies per link, the simulator's makespan,
and the measured makespan of a traced call (CUDA events and the host clock, see
``autopar.runtime``), with the wall time of untraced calls beside it. The numbers say whether a
slow workload loses time in its plan (measured makespan far from predicted) or around it (wall
time far above the measured makespan: the ``torch.compile`` frontend and the executor's
per-call work).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:
    import autopar  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from autopar.api import Options, Runner
from autopar.bench.harness import resolve_size
from autopar.bench.measure import in_process_compiles, sync_all
from autopar.bench.workloads import home_of, select
from autopar.capture.dynamo import make_backend
from autopar.schedule.simulate import simulate


def describe(name: str, fn: Any, inputs: tuple, devices: list[str], calls: int) -> dict[str, Any]:
    runner = Runner(Options.parse({"trace": True, "devices": devices}))
    cost = runner.cost_model()
    traced = torch.compile(fn, backend=make_backend(runner), dynamic=False)
    plain_runner = Runner(Options.parse({"devices": devices}))
    plain = torch.compile(fn, backend=make_backend(plain_runner), dynamic=False)
    for _ in range(2):
        traced(*inputs)
        plain(*inputs)
    sync_all()
    walls = []
    for _ in range(calls):
        t = time.perf_counter()
        plain(*inputs)
        sync_all()
        walls.append(time.perf_counter() - t)
    graphs = []
    for ex in runner.executors:
        placement = ex.plan.placement
        per_device = collections.Counter(placement.device[n] for n in ex.plan.graph.ops)
        links = collections.Counter(f"{c.src}->{c.dst}" for c in ex.plan.copies())
        measured = ex.last_timeline
        graphs.append({
            "graph": ex.plan.graph.name, "ops": len(ex.plan.graph.ops),
            "ops per device": dict(per_device), "copies": dict(links),
            "predicted s": simulate(ex.plan, cost).makespan,
            "measured s": measured.makespan if measured is not None else None,
            "policy": placement.policy,
        })
    walls.sort()
    return {"workload": name, "wall median s": walls[len(walls) // 2], "graphs": graphs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="*", help="names (default: all)")
    p.add_argument("--size", default="auto", choices=("auto", "full", "small"))
    p.add_argument("--devices", default="auto")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    in_process_compiles()
    n_gpus = torch.cuda.device_count()
    size = resolve_size(args.size, n_gpus)
    devices = list(Options.parse({"devices": args.devices}).devices)
    rows = []
    for w in select(args.workloads or None, size=size, n_gpus=n_gpus):
        torch._dynamo.reset()
        inputs = w.make_inputs(devices, size)
        try:
            row = describe(w.name, w.eager, inputs, devices, args.calls)
        except Exception as e:  # a diagnosis goes on past one workload
            row = {"workload": w.name, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print(f"{w.name} (on {home_of(devices)}): wall {row['wall median s'] * 1e6:.1f} µs"
              if "error" not in row else f"{w.name}: {row['error']}")
        for g in row.get("graphs", []):
            meas = g["measured s"]
            print(f"  {g['graph']}: {g['ops']} ops {g['ops per device']} copies {g['copies']} "
                  f"predicted {g['predicted s'] * 1e6:.1f} µs measured "
                  f"{meas * 1e6 if meas is not None else float('nan'):.1f} µs ({g['policy']})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

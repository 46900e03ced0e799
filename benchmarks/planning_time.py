"""How long placement, planning and simulation take on big graphs.

    PYTHONPATH=src python benchmarks/planning_time.py               # 1k, 10k, 100k nodes
    PYTHONPATH=src python benchmarks/planning_time.py --sizes 1000,10000 --json

The graph: a random DAG (fixed seed) shaped like a model's op stream: each op reads one or two
of the 16 values before it; 30 % are 1024^3 matmuls, 50 % adds, 20 % relus, every eighth value
seen through a view; four 1024^2 float32 inputs on cuda:0, the last four values returned. The
machine: a preset (default ``h200x2`` with two CPU workers: four devices).

What is timed (CPU time of this process, best of ``--repeat`` runs): ``place`` (HEFT, which
also runs ``single`` for its guard), ``make_plan`` and ``simulate``. The cost model's answers
for every (op, device) are computed once before timing, into a table the scheduler reads
(``cost table``, timed on its own): the planner is measured, not the cost model, whose speed is
its own module's concern. Goal: ``place`` <= 1 s at 10k nodes on four devices.

Results: a table on stdout (``--json``: the JSON document instead) and the JSON in
benchmarks/results/planning_time-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import socket
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from autopar.cost.model import CostModel, History
from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.machine.model import Machine
from autopar.machine.presets import preset
from autopar.schedule.place import place
from autopar.schedule.plan import make_plan
from autopar.schedule.simulate import simulate

aten = torch.ops.aten
RESULTS = Path(__file__).resolve().parent / "results"
GOAL_NODES, GOAL_S = 10_000, 1.0


def model_like_graph(n_ops: int, seed: int = 0, side: int = 1024) -> Graph:
    """The benchmark DAG described in the module docstring."""
    rng = random.Random(seed)
    g = Graph(f"dag{n_ops}")
    meta = TensorMeta.make((side, side), device="cuda:0")
    values: list[Node] = [g.input(meta, name=f"in{i}") for i in range(4)]
    mm_flops = 2 * side**3
    for i in range(n_ops):
        a, b = rng.choice(values[-16:]), rng.choice(values[-16:])
        r = rng.random()
        if i % 8 == 7:
            node = g.call(aten.alias.default, (a,), meta=meta)
        elif r < 0.3:
            node = g.call(aten.mm.default, (a, b), meta=meta, flops=mm_flops)
        elif r < 0.8:
            node = g.call(aten.add.Tensor, (a, b), meta=meta)
        else:
            node = g.call(aten.relu.default, (a,), meta=meta)
        values.append(node)
    g.set_outputs(values[-4:])
    return g


class TableCost:
    """A cost model's answers for every (op, device) of one graph, asked once up front."""

    def __init__(self, cost: CostModel, graph: Graph) -> None:
        self.machine: Machine = cost.machine
        self.cost = cost
        names = [d.name for d in cost.machine.devices]
        self.times = {(n, d): cost.node_time(n, d) for n in graph.ops for d in names}
        self.runs = {(n, d): cost.can_run(n, d) for n in graph.ops for d in names}

    def node_time(self, node: Node, device: str) -> float:
        return self.times[(node, device)] if not node.is_input else 0.0

    def can_run(self, node: Node, device: str) -> bool:
        return self.runs[(node, device)]

    def transfer_time(self, nbytes: int, src: str, dst: str, pinned: bool = True) -> float:
        return self.cost.transfer_time(nbytes, src, dst, pinned)


def cpu_seconds(fn: Any, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        out = fn()
        best = min(best, time.process_time() - start)
    return best, out


def measure(n_ops: int, machine: Machine, repeat: int) -> dict[str, Any]:
    graph = model_like_graph(n_ops)
    start = time.process_time()
    cost = TableCost(CostModel(machine, History(), allow_tf32=False), graph)
    table_s = time.process_time() - start
    place_s, placement = cpu_seconds(lambda: place(graph, cost), repeat)
    plan_s, plan = cpu_seconds(lambda: make_plan(placement), repeat)
    sim_s, timeline = cpu_seconds(lambda: simulate(plan, cost), repeat)
    eager = place(graph, cost, "single")
    return {
        "nodes": n_ops, "devices": len(machine.devices), "cost_table_s": table_s,
        "place_s": place_s, "plan_s": plan_s, "simulate_s": sim_s,
        "predicted_heft_s": placement.predicted_s, "predicted_eager_s": eager.predicted_s,
        "simulated_s": timeline.makespan,
        "ops_per_device": {d: len(ops) for d, ops in sorted(placement.order.items())},
        "copies": len(plan.copies()),
    }


def to_markdown(rows: list[dict[str, Any]], machine: str) -> str:
    lines = [f"Planning time on {machine} (CPU seconds, best run; cost model excluded):", "",
             "| nodes | devices | place | make_plan | simulate | cost table | predicted: heft "
             "/ eager | ops per device |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{d} {k}" for d, k in r["ops_per_device"].items())
        lines.append(
            f"| {r['nodes']:,} | {r['devices']} | {r['place_s']:.3f} s | {r['plan_s']:.3f} s | "
            f"{r['simulate_s']:.3f} s | {r['cost_table_s']:.2f} s | "
            f"{r['predicted_heft_s'] * 1e3:.1f} / {r['predicted_eager_s'] * 1e3:.1f} ms | {per} |")
    goal = [r for r in rows if r["nodes"] == GOAL_NODES]
    if goal:
        ok = goal[0]["place_s"] <= GOAL_S
        lines += ["", f"Goal place <= {GOAL_S:g} s at {GOAL_NODES:,} nodes: "
                      f"{'met' if ok else 'MISSED'} ({goal[0]['place_s']:.3f} s)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000", help="op counts, comma-separated")
    p.add_argument("--machine", default="h200x2", help="preset name")
    p.add_argument("--cpu-workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="runs per size up to 10k (1 above)")
    p.add_argument("--json", action="store_true", help="print the JSON document only")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    machine = preset(args.machine, cpu_workers=args.cpu_workers)
    rows = []
    for n in (int(s) for s in args.sizes.split(",") if s.strip()):
        rows.append(measure(n, machine, args.repeat if n <= GOAL_NODES else 1))
        if not args.json:
            print(f"{n:>7} ops: place {rows[-1]['place_s']:.3f} s", file=sys.stderr)
    doc = {
        "benchmark": "planning_time", "date": date.today().isoformat(),
        "host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": str(machine), "command": " ".join(["planning_time.py", *(argv or sys.argv[1:])]),
        "rows": rows, "markdown": to_markdown(rows, str(machine)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"planning_time-{doc['host']}-{doc['date']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(doc["markdown"])
        print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Executor overhead per op, against eager dispatch of the same ops.

A chain of N tiny ops (``x = x * 1.0001 + 0.001`` on 64 floats: 2 ops a step) runs three ways,
side by side in one process: eager PyTorch, autopar's sequential runner, and autopar's executor
(one program on one device, the straight-line code the planner produces). The per-op overhead
is (executor - eager) / ops. Goal (issue 5): <= 3 us per op above eager dispatch.

    python benchmarks/overhead.py [--device cpu|cuda:0] [--steps 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

from autopar.bench.measure import measure
from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, TensorMeta
from autopar.machine.presets import preset
from autopar.runtime import Executor, SequentialRunner
from autopar.schedule.place import place
from autopar.schedule.plan import make_plan

aten = torch.ops.aten


def chain_graph(steps: int, device: str) -> Graph:
    g = Graph("tiny_chain")
    x = g.input(TensorMeta.make((64,), device=device), "x")
    for _ in range(steps):
        x = g.call(aten.mul.Tensor, (x, 1.0001))
        x = g.call(aten.add.Tensor, (x, 0.001))
    g.set_outputs([x])
    return g


def eager(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = x * 1.0001 + 0.001
    return x


def timed(fn, repeat: int) -> float:
    """Median seconds per call (every GPU synchronized around each sample)."""
    return measure(fn, warmup=3, repeat=repeat, inner=1).median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = args.device
    g = chain_graph(args.steps, dev)
    cost = CostModel(preset("h200x2" if dev.startswith("cuda") else "cpu-only", cpu_workers=1))
    plan = make_plan(place(g, cost, policy="single"), cost)
    ex = Executor(plan)
    seq = SequentialRunner(g)
    x = torch.randn(64, device=dev)
    torch.testing.assert_close(ex([x])[0], eager(x, args.steps))
    ops = 2 * args.steps
    t_eager = timed(lambda: eager(x, args.steps), args.repeat)
    t_seq = timed(lambda: seq([x]), args.repeat)
    t_ex = timed(lambda: ex([x]), args.repeat)
    result = {
        "benchmark": "overhead", "device": dev, "ops": ops, "date": date.today().isoformat(),
        "host": platform.node(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if dev.startswith("cuda") else None,
        "eager_us_per_op": t_eager / ops * 1e6,
        "sequential_us_per_op": t_seq / ops * 1e6,
        "executor_us_per_op": t_ex / ops * 1e6,
        "executor_overhead_us_per_op": (t_ex - t_eager) / ops * 1e6,
    }
    print(f"{'variant':<12} {'us/op':>8}   ({ops} ops on {dev}, median of {args.repeat})")
    for k in ("eager", "sequential", "executor"):
        print(f"{k:<12} {result[f'{k}_us_per_op']:>8.2f}")
    print(f"executor overhead above eager: {result['executor_overhead_us_per_op']:+.2f} us/op")
    out = args.json or Path(__file__).parent / "results" / (
        f"overhead-{dev.replace(':', '')}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

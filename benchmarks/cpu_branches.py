"""Two independent CPU-bound branches: eager against autopar on one and on two logical workers.

Each branch is a chain of ops on a tensor small enough that one op runs on one thread (below
ATen's parallel grain), so eager leaves a core idle. On two logical CPU workers autopar runs the
branches side by side. Medians, results checked against eager first.

    python benchmarks/cpu_branches.py [--elements 16384] [--steps 150] [--repeat 15] [--json P]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import date
from pathlib import Path

import torch

import autopar
from autopar.bench.measure import measure


def branch(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = torch.sin(x * 1.01 + 0.1)
    return x


def median_s(fn, repeat: int) -> float:
    return measure(fn, warmup=3, repeat=repeat, inner=1).median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    steps = args.steps

    def two(a, b):
        return branch(a, steps), branch(b, steps)

    a, b = torch.randn(args.elements), torch.randn(args.elements)
    variants = {
        "eager": two,
        "autopar cpu:0": autopar.compile(two, devices="cpu:0"),
        "autopar cpu:0,cpu:1": autopar.compile(two, devices="cpu:0,cpu:1"),
    }
    ref = two(a, b)
    for name, fn in variants.items():
        for got, want in zip(fn(a, b), ref):
            torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{n}: {m}")
    times = {name: median_s(lambda f=fn: f(a, b), args.repeat) for name, fn in variants.items()}
    eager = times["eager"]
    print(f"{'variant':<22} {'median':>10} {'vs eager':>9}   "
          f"({args.elements} elements, 2 x {steps} x 3 ops, {os.cpu_count()} cores)")
    for name, t in times.items():
        print(f"{name:<22} {t * 1e3:>8.2f} ms {eager / t:>8.2f}x")
    result = {"benchmark": "cpu_branches", "date": date.today().isoformat(),
              "host": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
              "elements": args.elements, "steps": steps, "median_s": times}
    out = args.json or Path(__file__).parent / "results" / (
        f"cpu_branches-{platform.node()}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

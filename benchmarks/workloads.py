"""Benchmark family "workloads": W1-W6 and four common workloads, every variant side by side.

    python benchmarks/workloads.py                      # all workloads, sizes for this host
    python benchmarks/workloads.py W1 W4 --size small --json
    python benchmarks/workloads.py --out benchmarks/results --simulate h200x2

Prints a table (or, with --json, only the report as JSON on stdout); with --out writes
<machine>-<date>.json and .md there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

try:
    import autopar  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from autopar.bench.harness import VARIANTS, collect, write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="*", help="names (default: all); W3 is every W3 case")
    p.add_argument("--size", default="auto", choices=("auto", "full", "small"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--devices", default="auto", help="what autopar may use, e.g. cpu:0,cpu:1")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--simulate", default="none", help="a preset to predict on, e.g. h200x2")
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    p.add_argument("--out", type=Path, help="write <machine>-<date>.json and .md here")
    args = p.parse_args(argv)

    def progress(what: str) -> None:
        print(f"  {what}", file=sys.stderr, flush=True)

    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the result
        report, timelines = collect(
            args.workloads or None, size=args.size, variants=args.variants.split(","),
            devices=args.devices, simulate_on=None if args.simulate == "none" else args.simulate,
            repeat=args.repeat, progress=progress)
    if args.out is not None:
        for path in write_report(report, args.out, timelines=timelines):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        from rich.console import Console

        Console().print(report.to_rich())
        for miss in report.misses():
            print(f"  missed: {miss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

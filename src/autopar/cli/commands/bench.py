"""``autopar bench``: time workloads' variants side by side on this machine.

``autopar bench`` runs every workload; ``autopar bench W1 W4`` runs those (``W3`` is every W3
case). With ``--out DIR`` the report is written as ``DIR/<machine>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import contextlib
import json as json_module
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ...bench.harness import collect, write_report
from . import preset_names

__all__ = ["bench"]


def bench(
    workloads: Annotated[list[str] | None, typer.Argument(
        help="Workloads to run (default: all), e.g. W1 W3 ensemble4.")] = None,
    size: Annotated[str, typer.Option(
        help="full (benchmarks/README.md's sizes), small (CPU-sized), auto (full with a GPU).")
    ] = "auto",
    variants: Annotated[str, typer.Option(
        help="Comma-separated variants among eager, hand, compile, autopar.")
    ] = "eager,hand,compile,autopar",
    devices: Annotated[str, typer.Option(
        help="Devices autopar may use: auto, or e.g. cpu:0,cpu:1 or cpu:0,cuda:0,cuda:1.")
    ] = "auto",
    repeat: Annotated[int, typer.Option(help="Timed samples per variant (at most).")] = 10,
    simulate: Annotated[str, typer.Option(
        help=f"Also predict each workload on this preset ({preset_names()}), or none.")
    ] = "none",
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    out: Annotated[Path | None, typer.Option(
        help="Write <machine>-<date>.json and .md into this directory.")] = None,
) -> None:
    """Time eager, hand-tuned, torch.compile and autopar forms of each workload."""
    stream = sys.stderr if json else sys.stdout
    console = Console(stderr=json, width=None if stream.isatty() else 160)
    redirect = contextlib.redirect_stdout(sys.stderr) if json else contextlib.nullcontext()
    try:
        with redirect, console.status("running workloads") as status:
            report, timelines = collect(
                workloads, size=size, variants=[v.strip() for v in variants.split(",")],
                devices=devices, simulate_on=None if simulate == "none" else simulate,
                repeat=repeat, progress=lambda what: status.update(what))
    except ValueError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2) from None
    paths = write_report(report, out, timelines=timelines) if out is not None else []
    if json:
        print(json_module.dumps(report.to_json(), indent=1))
        return
    console.print(report.to_rich())
    for miss in report.misses():
        console.print(f"  missed: {miss}")
    if paths:
        console.print(f"wrote {', '.join(str(p) for p in paths[:2])}")

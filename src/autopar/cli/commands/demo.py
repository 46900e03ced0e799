"""``autopar demo``: every workload of benchmarks/README.md on this machine, eager against autopar.

Detects the machine (calibrating quickly when it has no profile yet), runs each workload in its
eager, hand-tuned, ``torch.compile`` and autopar forms, and prints one table (its last columns:
where autopar ran, ``plain`` where calls ran as the function itself). On a host without
GPUs it runs the small sizes on the CPU workers for real and shows every workload predicted on
a 2xH200 preset as well, labelled simulated. Writes the report (JSON, markdown) and a timeline
PNG per workload under ``--out``.
"""

from __future__ import annotations

import contextlib
import json as json_module
import sys
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console

from ...bench.harness import Report, collect, gpus_of, machine_label, write_report
from ...bench.workloads import select
from ...machine.detect import detect
from . import preset_names

__all__ = ["demo", "run_demo"]

SIMULATE_WITHOUT_GPU = "h200x2"
# A 2-core host must finish in about two minutes, torch.compile's compile times included.
CPU_TIMING = {"warmup": 1, "repeat": 5, "budget_s": 0.5}
GPU_TIMING = {"warmup": 2, "repeat": 15, "budget_s": 3.0}


def _detect_machine(console: Console) -> str:
    """Load (or make) this host's profile; describe the machine in one line."""
    try:
        return str(detect())
    except Exception as e:  # a failed calibration must not stop the demo
        console.print(f"[yellow]calibration failed ({type(e).__name__}: {e}); "
                      "using conservative defaults[/]")
        return str(detect(measure=False))


def _simulate_on(machine: str, n_gpus: int) -> str | None:
    if machine == "none":
        return None
    if machine == "auto":
        return SIMULATE_WITHOUT_GPU if n_gpus == 0 else "auto"
    return machine


def run_demo(console: Console, machine: str = "auto", out: Path = Path("out/demo"),
             workloads: list[str] | None = None, variants: str = "eager,hand,compile,autopar"
             ) -> tuple[Report, list[Path]]:
    """Run the demo; returns the report and the paths written."""
    start = time.perf_counter()
    n_gpus = torch.cuda.device_count()
    simulate_on = _simulate_on(machine, n_gpus)
    select(workloads)  # names are checked before anything is measured
    if simulate_on:
        gpus_of(simulate_on)
    console.print(f"[bold]machine:[/] {_detect_machine(console)}")
    timing = GPU_TIMING if n_gpus else CPU_TIMING
    with console.status("running workloads") as status:
        def progress(what: str) -> None:
            status.update(f"{what} ({time.perf_counter() - start:.0f} s)")

        report, timelines = collect(
            workloads, size="auto", variants=[v.strip() for v in variants.split(",")],
            simulate_on=simulate_on, progress=progress, **timing)
    paths = write_report(report, out, stem=f"demo-{machine_label(report.machine)}",
                         timelines=timelines)
    console.print(f"done in {time.perf_counter() - start:.0f} s")
    return report, paths


def demo(
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    machine: Annotated[str, typer.Option(
        help="Where to simulate: auto (h200x2 on a host without GPUs, this host's model "
             f"otherwise), a preset ({preset_names()}), or none.")] = "auto",
    out: Annotated[Path, typer.Option(
        help="Directory for the report (JSON, markdown) and the timeline PNGs.")
    ] = Path("out/demo"),
    workload: Annotated[list[str] | None, typer.Option(
        "--workload", "-w", help="Only these workloads (repeat or comma-separate; W3 means "
                                 "every W3 case).")] = None,
    variants: Annotated[str, typer.Option(
        help="Comma-separated variants among eager, hand, compile, autopar.")
    ] = "eager,hand,compile,autopar",
) -> None:
    """Run W1-W6 and four common workloads: eager, hand-tuned, torch.compile and autopar."""
    stream = sys.stderr if json else sys.stdout
    console = Console(stderr=json, width=None if stream.isatty() else 160)
    redirect = contextlib.redirect_stdout(sys.stderr) if json else contextlib.nullcontext()
    try:
        with redirect:
            report, paths = run_demo(console, machine, out, workload, variants)
    except ValueError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2) from None
    if json:
        print(json_module.dumps(report.to_json(), indent=1))
        return
    console.print(report.to_rich())
    misses = report.misses()
    if report.machine.get("gpus"):
        console.print("speed goals: " + ("met" if not misses else "missed:"))
        for m in misses:
            console.print(f"  - {m}")
    console.print(f"wrote {', '.join(str(p) for p in paths[:2])}"
                  + (f" and {len(paths) - 2} timeline PNGs" if len(paths) > 2 else ""))

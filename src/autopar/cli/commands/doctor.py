"""``autopar doctor FILE.py``: run a file's functions eagerly while watching, report hazards."""

from __future__ import annotations

import contextlib
import json as json_module
import sys
from pathlib import Path
from typing import Annotated

import typer

from autopar.doctor import DoctorError, UserCodeError, doctor_file

from . import preset_names

__all__ = ["doctor"]


def doctor(
    file: Annotated[Path, typer.Argument(help="The Python file to run.", show_default=False)],
    func: Annotated[str | None, typer.Option(
        "--func", "-f",
        help="Function(s) to run, comma-separated. Default: those in the file's __doctor__ "
             "list, else main. Arguments come from the file's example_inputs().")] = None,
    json: Annotated[bool, typer.Option(
        "--json", help="Print the reports as a JSON list.")] = False,
    machine: Annotated[str, typer.Option(
        "--machine", "-m",
        help=f"Whose costs to estimate with: auto (this host) or a preset ({preset_names()})."
             " A preset with GPUs on a host without CUDA simulates them.")] = "auto",
    inputs_on: Annotated[str | None, typer.Option(
        "--inputs-on",
        help="Take the argument tensors example_inputs() builds on the host to live on this "
             "device (e.g. cuda:0 with a preset's simulated GPUs).")] = None,
) -> None:
    """Run FILE's functions eagerly while watching, and report every hidden host/device sync,
    GPU scalar, tiny GPU op, pageable copy and ping-pong copy: file:line, count per call, cost,
    the fix and the time it would save."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the file's own prints stay off the report
            reports = doctor_file(file, func=func, machine=machine, inputs_on=inputs_on)
    except DoctorError as e:  # the user's function raised: 1 (failed); else 2 (bad usage)
        typer.echo(f"autopar doctor: {e}", err=True)
        raise typer.Exit(1 if isinstance(e, UserCodeError) else 2) from None
    if json:
        typer.echo(json_module.dumps([r.to_dict() for r in reports], indent=2))
    else:
        typer.echo("\n\n".join(r.to_text() for r in reports))

"""``autopar calibrate``: measure this machine's devices and links, save and print the profile."""

from __future__ import annotations

import json

import typer

from autopar.machine.calibrate import profile_tables
from autopar.machine.detect import detect
from autopar.machine.host import host_info, load_profile, profile_path
from autopar.machine.model import ProfileError, fingerprint_of
from autopar.machine.presets import PRESETS, preset

from . import preset_names

__all__ = ["calibrate"]


def calibrate(
    quick: bool = typer.Option(True, "--quick/--full",
                               help="Quick (<= 20 s) or full measurement of this host."),
    show: bool = typer.Option(False, "--show", help="Print the current profile, with each step's "
                              "spread and when it was measured; measure nothing."),
    force: bool = typer.Option(False, "--force", help="Save the new profile even if the host was "
                               "busy while measuring (else a good earlier one is kept)."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
    machine: str = typer.Option("auto", "--machine",
                                help=f"auto (this host) or a preset, shown as is: "
                                     f"{preset_names()}."),
) -> None:
    """Measure this machine's devices and links, save the profile, print it."""
    from rich.console import Console  # lazy: start-up cost

    if machine != "auto":
        if machine not in PRESETS:
            raise typer.BadParameter(f"unknown machine {machine!r}; presets: {sorted(PRESETS)}",
                                     param_hint="--machine")
        profile = preset(machine).profile  # a machine not at hand can only be shown
    elif show:  # read only: nothing measured, nothing written
        fp = fingerprint_of(host_info())
        try:
            profile = load_profile(profile_path(fp), fp)
        except (FileNotFoundError, ProfileError, OSError) as e:
            why = "none saved" if isinstance(e, FileNotFoundError) else str(e)
            typer.echo(f"autopar: no usable profile for this host ({why}); `autopar calibrate` "
                       "measures one", err=True)
            raise typer.Exit(1) from None
    else:
        profile = detect(calibrate="quick" if quick else "full", force=force).profile
    if as_json:
        typer.echo(json.dumps(profile.to_json(), indent=1))
        return
    console = Console()
    for table in profile_tables(profile):
        console.print(table)

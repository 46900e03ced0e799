"""The ``autopar`` command line: thin wrappers over the library (no logic lives here).

Each command is a function in :mod:`autopar.cli.commands`; this module only registers them.
"""

from __future__ import annotations

import typer

from autopar.cli.commands.bench import bench
from autopar.cli.commands.calibrate import calibrate
from autopar.cli.commands.demo import demo
from autopar.cli.commands.doctor import doctor
from autopar.cli.commands.explain import explain

app = typer.Typer(
    name="autopar",
    help="Automatic parallelism for PyTorch: calibrate, explain, doctor, bench, demo.",
    no_args_is_help=True,
    add_completion=False,
)

for name, command in (("demo", demo), ("bench", bench), ("calibrate", calibrate),
                      ("explain", explain), ("doctor", doctor)):
    app.command(name)(command)

"""The ``autopar`` command line: thin wrappers over the library (no logic lives here).

Each command is a function in :mod:`autopar.cli.commands`; this module only registers them.
Conventions: ``-h``/``--help`` on every command, ``--version``, shell completion
(``--install-completion``), exit codes 0 (done), 1 (failed), 2 (bad usage).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import typer

from autopar.cli.commands.bench import bench
from autopar.cli.commands.calibrate import calibrate
from autopar.cli.commands.demo import demo
from autopar.cli.commands.doctor import doctor
from autopar.cli.commands.explain import explain
from autopar.cli.commands.run import CONTEXT as RUN_CONTEXT
from autopar.cli.commands.run import run

EPILOG = (
    "Exit codes: 0 done, 1 failed, 2 bad usage.\n\n"
    "Logging: AUTOPAR_LOGS=ITEM,... shows autopar's records on stderr, as TORCH_LOGS does "
    "PyTorch's. An ITEM is a topic (capture, placement, trials, runtime, torch, dataparallel, "
    "explain, calibrate, or all): 'topic' logs it at INFO, '+topic' at DEBUG, '-topic' "
    "errors only; or a level alone (debug, info, warning, error) for every topic. "
    "E.g. AUTOPAR_LOGS=placement,trials shows each graph's placement, each trial and its "
    "verdict; AUTOPAR_LOGS=debug shows everything, PyTorch's compile messages included."
)


def _version(value: bool) -> None:
    if not value:
        return
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    typer.echo(f"autopar {version('autopar')} (torch {torch_version})")
    raise typer.Exit()


app = typer.Typer(
    name="autopar",
    help="Automatic parallelism for PyTorch: run, calibrate, explain, doctor, bench, demo.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print autopar's and torch's versions and exit.")
          ) -> None:
    """Automatic parallelism for PyTorch: run, calibrate, explain, doctor, bench, demo."""


for name, command in (("demo", demo), ("bench", bench), ("calibrate", calibrate),
                      ("explain", explain), ("doctor", doctor)):
    app.command(name)(command)
app.command("run", context_settings=RUN_CONTEXT)(run)

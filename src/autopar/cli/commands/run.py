"""``autopar run [torchrun's options] script.py ARGS``: torchrun with defaults that fit."""

from __future__ import annotations

import typer

from autopar.distributed.launch import run as launch

__all__ = ["CONTEXT", "run"]

CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True,
           "help_option_names": ["-h", "--help"]}


def run(ctx: typer.Context) -> None:
    """Run a script written for one device on every device: one process per GPU (on a machine
    without GPUs, up to 4 host processes on gloo), as `torchrun` does, whose options are all
    accepted (--nproc-per-node, --nnodes, --rdzv-endpoint, --max-restarts, ...). In the script,
    autopar.data_parallel(step) gives each process its share of the batch.

    Examples: `autopar run train.py --epochs 3`; two machines, on each:
    `autopar run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py`."""
    if not ctx.args:
        typer.echo("autopar run: name a script: autopar run [torchrun's options] script.py "
                   "ARGS", err=True)
        raise typer.Exit(2)
    launch(ctx.args)

"""``autopar explain FILE.py:FUNC``: where each op would run, why, and the predicted time."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from autopar.capture.fx import Unsupported
from autopar.report.explain import explain as run_explain
from autopar.report.graphviz import MissingRenderer, render
from autopar.report.trace import save_chrome_trace, save_gantt
from autopar.report.userfile import (
    UserFileError,
    example_args,
    functions_of,
    load_module,
    needs_args,
    users_error,
)

from . import policy_names, preset_names

__all__ = ["explain"]


def explain(
    target: Annotated[str, typer.Argument(
        help="FILE.py:FUNC, the function to explain.", show_default=False)],
    machine: Annotated[str, typer.Option(
        "--machine", "-m", help=f"auto (this host) or a preset: {preset_names()}. Predicted, "
                                "not run (but with --run), so any preset works anywhere.")
    ] = "auto",
    inputs_on: Annotated[str | None, typer.Option(
        "--inputs-on", help="Device of the machine where CPU-built example inputs are taken "
                            "to live, e.g. cuda:0.")] = None,
    inputs: Annotated[str, typer.Option(
        "--inputs", help="Function in FILE returning the example inputs.")] = "example_inputs",
    policy: Annotated[str, typer.Option(
        "--policy", help=f"How to place ops: {policy_names()}.")] = "heft",
    run: Annotated[bool, typer.Option(
        "--run", help="If FUNC can't be traced with fake inputs (it reads tensor values or "
                      "calls backward()), capture it by running it once on this host.")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Write the predicted timeline as a Chrome/Perfetto trace here.")] = None,
    png: Annotated[Path | None, typer.Option(
        "--png", help="Write a Gantt chart of the predicted timeline (and eager's) here.")] = None,
    graph: Annotated[Path | None, typer.Option(
        "--graph", help="Write the placed graph here: .dot, or .svg/.png (drawn by Graphviz, "
                        "else by matplotlib).")] = None,
) -> None:
    """Explain how autopar would place FUNC's ops on a machine: a table of ops, devices,
    predicted times and reasons; predicted time against eager's; the critical path."""
    file, _, func = target.rpartition(":")
    if not file or not func:
        raise typer.BadParameter("write FILE.py:FUNC, e.g. model.py:step", param_hint="TARGET")
    path = Path(file)
    try:
        # what the user's code prints goes to stderr: stdout is the report (JSON with --json)
        with contextlib.redirect_stdout(sys.stderr):
            module = load_module(path)
            fn = getattr(module, func, None)
            if not callable(fn):
                raise UserFileError(f"{path} has no function {func!r}; its functions: "
                                    f"{functions_of(module)}")
            args = example_args(module, path, func, provider=inputs) if needs_args(fn) else ()
            report = run_explain(fn, *args, machine=machine, policy=policy,
                                 inputs_on=inputs_on, run=run)
    except (UserFileError, Unsupported, ValueError) as e:
        typer.echo(f"autopar explain: {e}", err=True)
        raise typer.Exit(2) from None
    except Exception as e:  # the user's function raised, run for real (--run): one line
        said = users_error(e, path, f"{func}(...)")
        if said is None:
            raise
        typer.echo(f"autopar explain: {said}", err=True)
        raise typer.Exit(1) from None  # the run failed; the command was used as meant
    # the report first, then each file asked for: one that can't be written is said, the
    # others and the report are kept
    typer.echo(report.to_json() if json else report.to_text())
    writes = [
        (trace, lambda: save_chrome_trace(report.timeline, trace, report.plan.graph,
                                          extra=[report.eager_timeline])),
        (png, lambda: save_gantt(report.timeline, png, predicted=report.eager_timeline,
                                 title=f"{report.graph_name}: {report.policy} vs eager",
                                 labels=(f"{report.policy}, predicted", "eager, predicted"))),
        (graph, lambda: render(report.plan.placement, graph, report.critical_nodes))]
    failed = False
    for where, write in writes:  # (a list: two options may name one path)
        if where is None:
            continue
        try:
            wrote = write()
        except (MissingRenderer, ValueError) as e:
            typer.echo(f"autopar explain: {e}", err=True)
            failed = True
        except ImportError as e:
            typer.echo(f"autopar explain: can't write {where}: {e} (pip install "
                       "'autopar[plot]')", err=True)
            failed = True
        except OSError as e:
            typer.echo(f"autopar explain: can't write {where}: {e.strerror or e}", err=True)
            failed = True
        else:
            typer.echo(f"wrote {wrote}", err=json)
    if failed:  # a file asked for was not written
        raise typer.Exit(1)

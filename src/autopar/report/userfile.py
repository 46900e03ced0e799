"""Loading a user's file for the CLI (doctor, explain): its functions and example inputs.

Convention: a function that takes arguments gets them from the file's ``example_inputs()``,
which returns a tuple of arguments, or a dict of such tuples keyed by function name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["UserFileError", "example_args", "load_module", "needs_args", "targets"]


class UserFileError(ValueError):
    """The file, a function of it or its example inputs can't be used; the message says why."""


def load_module(path: Path) -> Any:
    """Import the file at ``path`` as a module (its folder first on sys.path meanwhile)."""
    if not path.is_file():
        raise UserFileError(f"no such file: {path}")
    name = f"_autopar_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserFileError(f"{path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def targets(module: Any, path: Path, func: str | None,
            listed: str) -> list[tuple[str, Callable[..., Any]]]:
    """The functions to run: ``func`` (names, comma-separated), else those named in the
    module's ``listed`` list (e.g. ``__doctor__``), else ``main``."""
    if func:
        names: Sequence[Any] = [n.strip() for n in func.split(",") if n.strip()]
    elif hasattr(module, listed):
        names = list(getattr(module, listed))
    elif callable(getattr(module, "main", None)):
        names = ["main"]
    else:
        raise UserFileError(f"{path} has no `main` function and no `{listed}` list: name the "
                            "function with --func NAME")
    out = []
    for n in names:
        if callable(n):
            out.append((n.__name__, n))
            continue
        fn = getattr(module, n, None)
        if not callable(fn):
            have = sorted(k for k, v in vars(module).items()
                          if inspect.isfunction(v) and not k.startswith("_"))
            raise UserFileError(f"{path} has no function {n!r}; its functions: {have}")
        out.append((n, fn))
    return out


def needs_args(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def example_args(module: Any, path: Path, name: str, provider: str = "example_inputs") -> tuple:
    """The arguments for ``name`` from the module's ``example_inputs()`` (or ``provider()``)."""
    make = getattr(module, provider, None)
    if not callable(make):
        raise UserFileError(f"{name}() in {path} takes arguments: define {provider}() in the "
                            "file, returning its arguments (a tuple), or a dict of them by "
                            "function name")
    inputs = make()
    if isinstance(inputs, dict):
        if name not in inputs:
            raise UserFileError(f"{provider}() in {path} returns a dict without {name!r} "
                             f"(its keys: {sorted(inputs)})")
        inputs = inputs[name]
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

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

from ..ir.logs import first_line, line_in

__all__ = ["UserFileError", "example_args", "functions_of", "load_module", "needs_args",
           "targets", "users_error"]


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
    except SyntaxError as e:
        raise UserFileError(f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}") from None
    except Exception as e:  # the file's own code raised as it was imported
        raise UserFileError(users_error(e, path, f"importing {path}") or
                            f"importing {path} raised {type(e).__name__}: {e}") from None
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def users_error(error: BaseException, path: Path, what: str) -> str | None:
    """One line for an exception the user's code raised: ``what`` (e.g. "step(...)"), the
    exception's type and first line, and the last line of the file at ``path`` its traceback
    passed through; None where it never passed through that file (not the user's error)."""
    line = line_in(error, str(path))
    if line is None:
        return None
    return (f"{what} raised {type(error).__name__}: {first_line(error)} "
            f"(at {Path(path).name}:{line})")


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
            raise UserFileError(f"{path} has no function {n!r}; its functions: "
                                f"{functions_of(module)}")
        out.append((n, fn))
    return out


def functions_of(module: Any) -> list[str]:
    """The public functions a user's file defines or imports, sorted."""
    return sorted(k for k, v in vars(module).items()
                  if inspect.isfunction(v) and not k.startswith("_"))


def needs_args(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    keyword = [p.name for p in params if p.default is p.empty and p.kind is p.KEYWORD_ONLY]
    if keyword:
        raise UserFileError(f"{getattr(fn, '__name__', fn)}() has keyword-only arguments "
                            f"without defaults ({', '.join(keyword)}); example inputs are "
                            "passed by position: wrap it in a function that takes them so")
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def example_args(module: Any, path: Path, name: str, provider: str = "example_inputs") -> tuple:
    """The arguments for ``name`` from the module's ``example_inputs()`` (or ``provider()``)."""
    make = getattr(module, provider, None)
    if not callable(make):
        raise UserFileError(f"{name}() in {path} takes arguments: define {provider}() in the "
                            "file, returning its arguments (a tuple), or a dict of them by "
                            "function name")
    try:
        inputs = make()
    except Exception as e:
        raise UserFileError(users_error(e, path, f"{provider}()") or
                            f"{provider}() raised {type(e).__name__}: {e}") from e
    if isinstance(inputs, dict):
        if name not in inputs:
            raise UserFileError(f"{provider}() in {path} returns a dict without {name!r} "
                             f"(its keys: {sorted(inputs)})")
        inputs = inputs[name]
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

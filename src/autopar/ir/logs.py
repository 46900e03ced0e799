"""autopar's logging: the ``autopar`` logger tree, ``AUTOPAR_LOGS``, and dynamo kept quiet.

Loggers (standard :mod:`logging`, all under ``autopar``; configure them as any other):

- ``autopar.capture``: graphs captured, graphs that run eagerly and why (one line each);
- ``autopar.placement``: where each graph's ops were placed, its plan, fallbacks;
- ``autopar.trials``: the ways (eager, Inductor, autopar) timed per signature, and verdicts
  (:mod:`autopar.choose`);
- ``autopar.runtime``: the executor, fused regions, CUDA graphs;
- ``autopar.torch``: what PyTorch (dynamo, Inductor, fake tensors) logged while autopar
  compiled: kept off the user's console (see :func:`quiet`), at DEBUG here;
- ``autopar.dataparallel``, ``autopar.explain``, ``autopar.calibrate``.

By default nothing is configured: warnings (a graph run eagerly, a failed plan: one line each)
reach Python's last-resort handler on stderr, and nothing else is shown.

``AUTOPAR_LOGS`` (read when autopar is imported; :func:`set_logs` takes the same text), in
the style of ``TORCH_LOGS``: comma-separated items, each a topic above (``capture``,
``placement``, ``trials``, ``runtime``, ``torch``, ...) or ``all``, with an optional prefix:
``+topic`` logs it at DEBUG, ``topic`` at INFO, ``-topic`` only errors. A level name alone
(``debug``, ``info``, ``warning``, ``error``) sets every topic. Examples::

    AUTOPAR_LOGS=placement,trials        # each graph's placement, each trial and its verdict
    AUTOPAR_LOGS=+placement,trials       # ...and each plan, step by step
    AUTOPAR_LOGS=debug                   # everything, PyTorch's compile messages included

The records go to stderr as ``[autopar.<topic>] message``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

__all__ = ["TOPICS", "first_line", "line_in", "quiet", "quiet_code", "set_logs"]

TOPICS = ("capture", "placement", "trials", "runtime", "torch", "dataparallel", "explain",
          "calibrate")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
_HANDLER_NAME = "autopar-logs"


def parse(spec: str) -> dict[str, int]:
    """``AUTOPAR_LOGS`` text -> {logger name: level} (see the module docstring)."""
    out: dict[str, int] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.lower() in _LEVELS:
            out["autopar"] = _LEVELS[item.lower()]
            continue
        level = logging.INFO
        if item[0] in "+-":
            level = logging.DEBUG if item[0] == "+" else logging.ERROR
            item = item[1:]
        if item == "all":
            out["autopar"] = level
        elif item in TOPICS:
            out[f"autopar.{item}"] = level
        else:
            raise ValueError(f"AUTOPAR_LOGS: unknown topic {item!r}; topics: all, "
                             f"{', '.join(TOPICS)}, or a level: {', '.join(_LEVELS)}")
    return out


def set_logs(spec: str) -> None:
    """Show autopar's records as ``spec`` says (``AUTOPAR_LOGS`` syntax) on stderr; ``""``
    removes what an earlier call set up."""
    root = logging.getLogger("autopar")
    for h in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(h)
    levels = parse(spec)
    for name in ("autopar", *(f"autopar.{t}" for t in TOPICS)):
        logging.getLogger(name).setLevel(logging.NOTSET)
    if not levels:
        return
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    if "autopar" not in levels:  # topics not named keep the default: warnings
        root.setLevel(logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root.addHandler(handler)


def configure_from_env() -> None:
    """Apply ``AUTOPAR_LOGS`` if set; a malformed value is reported once, not raised."""
    spec = os.environ.get("AUTOPAR_LOGS")
    if not spec:
        return
    try:
        set_logs(spec)
    except ValueError as e:
        print(f"autopar: ignoring {e}", file=sys.stderr)


# -- PyTorch's records while autopar compiles ----------------------------------------------------

# id -> code, looked up by id: a code object's hash hashes its constants, and code dynamo
# generates can hold a slice among them (unhashable before Python 3.12: the filter raised
# "unhashable type: 'slice'" inside the user's call, torch 2.11). The values keep each id's code
# alive, so an id is never another code's.
_QUIET_CODES: dict[int, CodeType] = {}
"""Code objects of the functions inside which PyTorch's records are rerouted (see :func:`quiet`)."""
_torch_log = logging.getLogger("autopar.torch")
_covered = [0]  # the size of logging's logger table when torch's loggers were last covered


def quiet_code(fn: Callable) -> Callable:
    """Register ``fn``'s code: while a call of it is on the stack, records of PyTorch's loggers
    (dynamo's graph-break warnings, fake tensors' errors on a user's shape mistake) go to
    ``autopar.torch`` at DEBUG instead of the console. Costs nothing per call: the stack is
    only looked at when PyTorch emits a record."""
    _QUIET_CODES[id(fn.__code__)] = fn.__code__
    cover_torch_loggers()
    return fn


def quiet(fn: Callable) -> Callable:
    """``fn`` called with PyTorch's compile-time records kept quiet (see :func:`quiet_code`)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return quiet_code(call)


def _inside_quiet() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if id(frame.f_code) in _QUIET_CODES:
            return True
        frame = frame.f_back
    return False


class _Reroute(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not _QUIET_CODES or not _inside_quiet():
            return True
        if _torch_log.isEnabledFor(logging.DEBUG):
            _torch_log.debug("%s %s: %s", record.levelname, record.name, record.getMessage())
        return False


_FILTER = _Reroute()


def cover_torch_loggers() -> None:
    """Put the rerouting filter on every ``torch`` logger made so far (a filter on a logger
    sees only that logger's own records). Cheap when no logger was made since the last call."""
    loggers = logging.Logger.manager.loggerDict
    if len(loggers) == _covered[0]:
        return
    _covered[0] = len(loggers)
    for name, lg in list(loggers.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(lg, logging.Logger) \
                and _FILTER not in lg.filters:
            lg.addFilter(_FILTER)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message ("" for none): what one-line log messages
    quote of an error. A first line ending in a colon is joined to the next one, which says
    what it announces (dynamo's ``BackendCompilerFailed``: "backend='inductor' raised:", then
    the backend's own error)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return ""
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def line_in(e: BaseException, filename: str) -> int | None:
    """The line of the last frame of ``e``'s traceback in the file ``filename`` (compared as
    real paths), or None where the traceback never passed through it: where a user's own
    file stands in an error's messages."""
    target, found, tb = os.path.realpath(filename), None, e.__traceback__
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == target:
            found = tb.tb_lineno
        tb = tb.tb_next
    return found

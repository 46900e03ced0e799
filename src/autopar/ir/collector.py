"""Python's cyclic garbage collector, paused while autopar builds a plan.

Policy
- Capturing and planning a step allocates millions of small objects (nodes, metas, spans),
  and the collector's passes over them are pure overhead there: pausing it cut the planning of
  GPT-2 small's step on ``h200x8`` by about a fifth (measured: see benchmarks/NOTES.md).
- :func:`paused` turns the collector off for its block and back on after, as it was. The
  collector is process-wide: blocks in several threads nest (a count under a lock), and it
  comes back on when the last one ends, only if it was on when the first began. Nothing is
  freed later than it would be: reference counting frees as before, and the next automatic
  pass after the block collects what cycles the block left.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off for the block (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

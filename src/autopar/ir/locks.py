"""The lock autopar's own tracing shares with ``torch.compile``.

Policy
- Every trace autopar starts outside dynamo (``make_fx`` of a training step, of a function
  traced by running it, of a region Inductor fuses, and that region's Inductor compile) holds
  :func:`tracing`: dynamo's ``compile_lock``, on which ``torch.compile`` serializes its own
  compiles. FX's tracer patches ``nn.Module.__call__`` and wrapped functions for the whole
  process while it traces; a compile in another thread traced through the patch and failed
  ("CURRENT_PATCHER is None in finally block", "Guard failed on the same frame it was
  created": 3 runs in 5 of threads sharing a compiled module while each trained its own,
  2026-12-05).
- The lock is reentrant: a trace inside a backend, which dynamo calls holding it, passes.
  Calls that trace nothing never take it.
- FX also raises a process-wide flag while it traces, and dynamo's entry refuses a compiled
  call made while it is up, in any thread ("Detected that you are using FX to symbolically
  trace a dynamo-optimized function"). :func:`enter` makes autopar's calls into dynamo: where
  the flag is up it waits for the lock first (the traces autopar and ``torch.compile`` start
  hold it), and a call refused at the entry itself (the flag rose after that look; nothing of
  the call ran) is made again once the lock is free. A trace in the calling thread (the user's
  ``symbolic_trace`` of code calling a compiled function) is refused as dynamo refuses it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.fx._symbolic_trace as _fx

__all__ = ["enter", "tracing"]

_own = threading.RLock()


def tracing() -> Any:
    """The lock to hold while tracing (a context manager): dynamo's ``compile_lock``, or one of
    autopar's own where a torch has none."""
    try:
        from torch._dynamo.convert_frame import compile_lock  # dynamo: slow to import
    except ImportError:  # pragma: no cover - every torch autopar supports has it
        return _own
    return compile_lock


_REFUSED = "symbolically trace a dynamo-optimized function"


def enter(compiled: Callable, args: tuple, kwargs: dict) -> Any:
    """``compiled(*args, **kwargs)``, a dynamo-compiled function's call, past another thread's
    trace (see the module docstring)."""
    if _fx._is_fx_tracing_flag:
        with tracing():
            pass
    try:
        return compiled(*args, **kwargs)
    except RuntimeError as e:
        tb = e.__traceback__
        at_entry = tb is not None and tb.tb_next is not None and tb.tb_next.tb_next is None
        if not (at_entry and _REFUSED in str(e)):
            raise
    with tracing():
        pass
    return compiled(*args, **kwargs)

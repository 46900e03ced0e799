"""The lock autopar's own tracing shares with ``torch.compile``.

Policy
- Every trace autopar starts outside dynamo (``make_fx`` of a training step, of a function
  traced by running it, of a region Inductor fuses, and that region's Inductor compile) holds
  :func:`tracing`: dynamo's ``compile_lock``, on which ``torch.compile`` serializes its own
  compiles. FX's tracer patches ``nn.Module.__call__`` and wrapped functions for the whole
  process while it traces; a compile in another thread traced through the patch and failed
  ("CURRENT_PATCHER is None in finally block", "Guard failed on the same frame it was
  created", where threads sharing a compiled module each trained their own).
- The lock is reentrant: a trace inside a backend, which dynamo calls holding it, passes.
  Calls that trace nothing never take it.
- FX also raises a process-wide flag while it traces, and dynamo's entry refuses a compiled
  call made while it is up, in any thread ("Detected that you are using FX to symbolically
  trace a dynamo-optimized function"). :func:`enter` makes autopar's calls into dynamo: where
  the flag is up it waits for the lock first (the traces autopar and ``torch.compile`` start
  hold it), and a call refused at the entry itself (the flag rose after that look; nothing of
  the call ran) is made again once the lock is free. A trace in the calling thread (the user's
  ``symbolic_trace`` of code calling a compiled function) is refused as dynamo refuses it.
- A :class:`Gate` lets any number of calls run at once, or one section that must see no call
  in flight in another thread (a split's capture, which swaps the user's module's parameters
  for fake ones while it traces: a call of that module in another thread then read
  FunctionalTensors, and two overlapping swaps each put back the other's fakes for good).
  A thread's own calls never wait for its own section, nor it for them.
- Between processes, :func:`file_lock`: a file beside what is written (the cost model's
  history; the host's profile while it is measured, so that processes started at once, as
  ``torchrun`` starts them, measure the host one at a time and the later ones load the
  first one's profile instead of measuring a host the others keep busy).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.fx._symbolic_trace as _fx

__all__ = ["Gate", "enter", "file_lock", "tracing"]

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


class Gate:
    """Calls at once (:meth:`enter` ... :meth:`leave`) or one exclusive section
    (:meth:`exclusive`) at a time (module docstring). Reentrant per thread both ways. A call
    takes no lock while no section is open: it appends its thread to a list, then looks for
    an owner; a section sets its owner, then waits for the list to hold no other thread (under
    the GIL one of the two sees the other). A call costs ~0.1 us, where a Condition's lock
    taken on entry and exit cost ~0.6 us (measured: see benchmarks/NOTES.md)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls: list[int] = []  # one entry per call in flight: its thread
        self._owner: int | None = None  # the thread in the exclusive section
        self._depth = 0

    def enter(self) -> None:
        me = threading.get_ident()
        self._calls.append(me)
        while self._owner is not None and self._owner != me:
            self._calls.remove(me)
            with self._cond:
                while self._owner is not None and self._owner != me:
                    self._cond.wait()
            self._calls.append(me)

    def leave(self) -> None:
        self._calls.remove(threading.get_ident())
        if self._owner is not None:
            with self._cond:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            while self._owner is not None and self._owner != me:
                self._cond.wait()
            self._owner = me
            self._depth += 1
            while any(t != me for t in tuple(self._calls)):
                self._cond.wait(0.01)
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                self._cond.notify_all()


@contextlib.contextmanager
def file_lock(path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock between processes on what is written to ``path``: a lock file beside
    it (``.NAME.lock``, created), where the OS has ``fcntl`` and the file can be made;
    elsewhere none. ``waiting`` is called once, before waiting, where another process holds
    it."""
    try:
        import fcntl  # POSIX only: absent on Windows
    except ImportError:  # not a POSIX system
        yield
        return
    try:
        f = open(path.with_name(f".{path.name}.lock"), "a")  # noqa: SIM115 - closed below
    except OSError:  # a folder that can't be written: nothing there to protect
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

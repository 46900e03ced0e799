"""The caller's thread-local state, carried into the worker threads that run its programs.

Policy
- A worker thread runs its part of a call in the world of the thread that made the call: grad
  mode, inference mode, and autocast's on/off, dtype and cache flag per device type (off
  inside aot_autograd's runtime wrapper, which has applied autocast at capture). Eager code
  run on the caller's thread sees exactly these; a worker that did not would record autograd
  history under ``no_grad`` (outputs with a ``grad_fn``), save inference tensors for
  backward, or cast where the caller doesn't.
- It is captured once per call, on the caller's thread, and applied around each worker's
  program; the worker's own state is restored afterwards (its threads are reused across
  calls and callers).
- The dispatcher's key sets are not copied whole: they hold Python-dispatch keys that are
  only valid with the caller's Python mode stack (copied, they fail PyTorch's internal assert
  in ``PythonFallbackKernel``).
- Nothing process-wide is changed: no ``torch.set_num_threads`` (in PyTorch it sets the count
  every thread started later inherits), no global flags.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

__all__ = ["CallerState"]

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass(frozen=True)
class CallerState:
    """What a worker thread takes from the caller's thread (see the module docstring)."""

    grad: bool  #: grad mode
    inference: bool  #: inference mode
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  #: per device type: on, dtype
    autocast_cache: bool  #: autocast's weight-cast cache

    @staticmethod
    def capture() -> CallerState:
        """The state of the calling thread."""
        return CallerState(
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                           for d in _AUTOCAST_DEVICES),
            autocast_cache=torch.is_autocast_cache_enabled())

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Run the body in this state on the current thread, then restore the thread's own."""
        own = CallerState.capture()
        with ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            _set_autocast(self)
            try:
                yield
            finally:
                _set_autocast(own)


def _set_autocast(state: CallerState) -> None:
    for device, enabled, dtype in state.autocast:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(state.autocast_cache)

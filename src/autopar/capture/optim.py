"""Optimizers as eager code built them, for the eager way of a step that dynamo also traced.

Dynamo, tracing a ``torch.optim`` step whose parameters are on a GPU, changes the optimizer
for good (``torch/_dynamo/variables/optimizer.py``, torch 2.11 and 2.13): each param group whose
state is not made yet gets ``capturable=True`` (``_set_capturable``), so its step counts are
made on the parameters' device, and counts already on the host are moved there
(``move_step_if_cpu``). The compiled code is guarded on those very objects. Eager code run
afterwards takes the capturable path: its bias corrections become GPU kernels instead of Python
floats. The trial's eager way was then 13-15% slower than eager with the optimizer as built
(AdamW steps of HF's OPT and ResNet): the trial kept a compiled way slower than eager, and a
step kept eager ran slower than eager (measured: see benchmarks/NOTES.md).

:class:`OptimizerForms` holds both forms of each optimizer a step reaches
(:func:`autopar.capture.state.find_state`) and switches between them: the dispatcher enters
the eager form before a call of the function itself and the compiled form before a call of a
compiled way, so the eager way is eager's, in the trial and once kept.

Policy and invariants
- The eager form is the optimizer as found before the step's first capture: each param group's
  ``capturable`` as it was then, and step counts where eager's ``_init_group`` makes them (on
  the host, unless that group was capturable or fused).
- The compiled form is what the compiled code last saw: its flags and its step-count tensors,
  the very objects (its guards hold on them), recorded each time the eager form is entered.
- A switch carries the counts' values over (one copy per device each way), so both forms step
  one optimizer: the count is every step taken, whichever way took it.
- Only ``capturable`` and ``state[p]["step"]`` change; moments, momentum buffers and the
  parameters are the same tensors in both forms. An optimizer dynamo left alone (parameters on
  the host, an optimizer without step counts such as SGD) switches as a no-op.
- An optimizer made after the step's first capture is not found (left in whatever form).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from .state import find_state

__all__ = ["OptimizerForms", "dynamo_changes_optimizers"]


def dynamo_changes_optimizers() -> bool:
    """Whether a capture can have changed an optimizer: dynamo changes only those whose
    parameters are on a GPU, and there is none before CUDA is initialized."""
    return torch.cuda.is_initialized()


class OptimizerForms:
    """The eager and compiled forms of ``optimizers`` (see the module docstring); the form is
    the compiled one until :meth:`eager` is called."""

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self.optimizers = list(optimizers)
        # per optimizer, per param group: capturable as built, and whether eager keeps the
        # group's step counts on the host
        self._built = [[g.get("capturable") for g in o.param_groups] for o in self.optimizers]
        self._on_host = [[not (g.get("capturable") or g.get("fused")) for g in o.param_groups]
                         for o in self.optimizers]
        self._flags: list[list[Any]] = []  # the compiled form's flags, when last left
        self._steps: list[tuple[dict, torch.Tensor]] = []  # (state[p], its compiled count)
        self.form = "compiled"
        self.changed = False  #: whether a switch found anything to change

    @classmethod
    def of(cls, fn: Callable, args: Sequence[Any]) -> OptimizerForms | None:
        """The forms of the optimizers ``fn(*args)`` reaches that have step counts or a
        ``capturable`` flag, as they are now (before the first capture), or None."""
        try:
            found = find_state(fn, args).optimizers
        except Exception:  # a GradScaler, an odd object: nothing to keep
            return None
        opts = [o for _, o in found if any("capturable" in g for g in o.param_groups)]
        return cls(opts) if opts else None

    def eager(self) -> None:
        """Enter the eager form (recording the compiled one)."""
        if self.form == "eager":
            return
        self.form = "eager"
        self._flags = [[g.get("capturable") for g in o.param_groups] for o in self.optimizers]
        self._steps = []
        for o, built in zip(self.optimizers, self._built, strict=True):
            for g, flag in zip(o.param_groups, built, strict=False):
                if "capturable" in g and g["capturable"] != flag:
                    g["capturable"] = flag
                    self.changed = True
        moves: list[tuple[dict, torch.Tensor]] = []
        for o, on_host in zip(self.optimizers, self._on_host, strict=True):
            for g, host in zip(o.param_groups, on_host, strict=False):
                if not host:
                    continue
                for p in g["params"]:
                    s = o.state.get(p)
                    step = s.get("step") if s else None
                    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                        moves.append((s, step))
        if not moves:
            return
        self.changed = True
        self._steps = moves
        for group in _by_device(moves).values():
            values = torch.stack([step for _, step in group]).cpu()  # one copy a device
            for (s, _), v in zip(group, values, strict=True):
                s["step"] = v.clone()  # a 0-dim host tensor of its own, as eager makes

    def compiled(self) -> None:
        """Enter the compiled form: its flags and its very step-count tensors, each holding
        the count the eager form reached."""
        if self.form == "compiled":
            return
        self.form = "compiled"
        for o, flags in zip(self.optimizers, self._flags, strict=True):
            for g, flag in zip(o.param_groups, flags, strict=False):
                if "capturable" in g:
                    g["capturable"] = flag
        for device, group in _by_device(self._steps).items():
            counts = torch.stack([s["step"] for s, _ in group]).to(device)
            torch._foreach_copy_([step for _, step in group], list(counts.unbind()))
            for s, step in group:
                s["step"] = step
        self._steps = []

    def describe(self) -> str | None:
        """A line for ``explain`` where the two forms differ, else None."""
        if not self.changed:
            return None
        names = sorted({type(o).__name__ for o in self.optimizers})
        return (f"  eager's calls run {', '.join(names)} as built (capturable and step counts "
                "on the host as eager makes them), not as dynamo's trace left it")


def _by_device(moves: Sequence[tuple[dict, torch.Tensor]]
               ) -> dict[torch.device, list[tuple[dict, torch.Tensor]]]:
    out: dict[torch.device, list[tuple[dict, torch.Tensor]]] = {}
    for s, step in moves:
        out.setdefault(step.device, []).append((s, step))
    return out

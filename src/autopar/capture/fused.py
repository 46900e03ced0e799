"""``torch.optim``'s fused kernels (``fused=True``) in a functional trace.

A fused optimizer updates everything in one in-place op over lists: ``_fused_adamw_(params,
grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, ...)``, ``_fused_adam_``,
``_fused_sgd_``, ``_fused_adagrad_``. Functionalization (``FunctionalTensorMode``, and
``torch.func.functionalize``) fails on them where one of the lists they write is empty, as
AdamW's ``max_exp_avg_sqs`` is without ``amsgrad`` and SGD's momentum buffers without momentum:
torch's generated kernel takes an empty list for one that is not functional ("mutating a
non-functional tensor with a functional tensor is not allowed", torch 2.11 and 2.13). And the
kernels require that list to be empty.

:class:`FunctionalFusedUpdates` is a ``TorchFunctionMode`` for the trace: it calls each such
op's functional form (``_fused_adamw``: the same kernel on copies, the new lists returned)
and makes every tensor the op writes hold its new value, as the generated kernel would
(replace, commit, sync). So the trace holds eager's own kernel, and its numbers are eager's.

Policy
- Only ops named ``aten::_fused_*_`` with a functional form of the same arguments whose
  results are the written lists in order; anything else passes through untouched.
- Inside a trace only: the mode is entered by :func:`autopar.capture.step.capture_step` around
  the step's functional trace (and around the functionalizing replay of a plain one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.overrides import TorchFunctionMode

__all__ = ["FunctionalFusedUpdates"]


def _written(schema: torch.FunctionSchema) -> list[int]:
    """Positions of the arguments the op writes (every one a list of tensors)."""
    return [i for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


_FORMS: dict[tuple[Any, bool], tuple[Any, torch.FunctionSchema] | None] = {}


def _functional_form(func: Any, tensor_lr: bool) -> tuple[Any, torch.FunctionSchema] | None:
    """``(functional overload, in-place schema)`` for ``torch._fused_adamw_`` (its overload
    for a tensor ``lr`` where ``tensor_lr``) or one of its ``aten`` overloads, else None."""
    key = (func, tensor_lr)
    if key in _FORMS:
        return _FORMS[key]
    got = None
    name = getattr(func, "__name__", "")
    if isinstance(func, torch._ops.OpOverload):
        name = func._schema.name.split("::", 1)[1]
    if name.startswith("_fused_") and name.endswith("_"):
        packet = getattr(torch.ops.aten, name, None)
        functional = getattr(torch.ops.aten, name[:-1], None)
        if packet is not None and functional is not None:
            inplace = func if isinstance(func, torch._ops.OpOverload) else \
                getattr(packet, "tensor_lr" if tensor_lr else "default", None)
            overload = getattr(functional, getattr(inplace, "_overloadname", ""), None)
            if overload is not None and \
                    len(overload._schema.returns) == len(_written(inplace._schema)):
                got = (overload, inplace._schema)
    _FORMS[key] = got
    return got


def _bind(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> list[Any]:
    """The value of every argument of ``schema`` (defaults filled in)."""
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out.append(args[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        else:
            out.append(a.default_value)
    return out


def _set(old: torch.Tensor, new: torch.Tensor) -> None:
    """Make the functional tensor ``old`` hold ``new``'s value (an in-place write, traced)."""
    if isinstance(old, FunctionalTensor):  # FunctionalTensorMode
        old.replace_(FunctionalTensor.from_functional(new))
        old.commit_update()
        old.sync()
    else:  # torch.func.functionalize's C++ wrappers
        torch._sync(new)
        torch._functionalize_replace(old, torch._from_functional_tensor(new))
        torch._functionalize_commit_update(old)
        torch._functionalize_sync(old)


def _is_functional(t: Any) -> bool:
    return isinstance(t, FunctionalTensor) or (isinstance(t, torch.Tensor)
                                                and torch._is_functional_tensor(t))


class FunctionalFusedUpdates(TorchFunctionMode):
    """Trace fused optimizer kernels through their functional forms (module docstring)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        form = _functional_form(func, isinstance(kwargs.get("lr"), torch.Tensor)) \
            if isinstance(func, torch._ops.OpOverload) or \
            getattr(func, "__name__", "").startswith("_fused_") else None
        if form is None:
            return func(*args, **kwargs)
        functional, schema = form
        values = _bind(schema, args, kwargs)
        written = [values[i] for i in _written(schema)]
        if not any(_is_functional(t) for ts in written for t in ts):
            return func(*args, **kwargs)  # not inside the functional trace
        new = functional(*(v for a, v in zip(schema.arguments, values) if not a.kwarg_only),
                         **{a.name: v for a, v in zip(schema.arguments, values) if a.kwarg_only})
        for olds, news in zip(written, new):
            for old, n in zip(olds, news):
                _set(old, n)
        return None

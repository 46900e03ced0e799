"""ATen and Python operations several stages name: the ops whose value is a Python number,
shape queries, the arithmetic dynamo records on numbers read from tensors; and the plain number a
traced scalar stands for."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from .graph import LOCAL_SCALAR_DENSE

PLAIN_VALUES = (int, float, bool, str, type(None))
"""Python values that stand for themselves: passed to an op, keyed or checked by value."""

__all__ = ["SCALAR_FUNCTIONS", "SCALAR_OPS", "SIZE_OPS", "always_a_view", "has_kernel",
           "is_fused_update", "known_number"]

_aten = torch.ops.aten
SCALAR_OPS = frozenset({LOCAL_SCALAR_DENSE, _aten._assert_scalar.default,
                        _aten._assert_async.default, _aten._assert_async.msg,
                        _aten.sym_constrain_range.default,
                        _aten.sym_constrain_range_for_size.default})
"""ATen ops whose value is a Python number (or None): they run on the host (an
``_assert_async``, as ``F.one_hot``'s range check: its condition, a 0-dim tensor, checked
where it is, on a GPU by the device)."""
SIZE_OPS = frozenset({_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
                      _aten.sym_storage_offset.default})
"""Shape queries: their value is known when the shape is, and then becomes a constant."""
SCALAR_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.not_, math.floor, math.ceil, math.trunc, torch.sym_max,
    torch.sym_min, torch.sym_float, torch.sym_int, torch.sym_not, torch.sym_ite})
"""Python arithmetic dynamo records on numbers read from tensors."""


_ALWAYS_A_VIEW: dict[Any, bool] = {}


def always_a_view(op: Any) -> bool:
    """Does ``op`` return one tensor that is always a view of its first argument (never a
    copy)? An ATen view op with a kernel of its own: ``reshape``, ``contiguous`` and
    ``flatten`` (composite: they copy where strides don't allow a view) are not, nor ``split``
    (a list)."""
    got = _ALWAYS_A_VIEW.get(op)
    if got is None:
        got = _ALWAYS_A_VIEW[op] = (
            isinstance(op, torch._ops.OpOverload) and op.is_view
            and not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
            and len(op._schema.returns) == 1
            and isinstance(op._schema.returns[0].type, torch.TensorType))
    return got


_KERNELS: dict[tuple[Any, str], bool] = {}


def has_kernel(op: Any, key: str) -> bool:
    """Has ``op`` a kernel for dispatch key ``key`` ("CPU", "CUDA"), its own or a composite
    one: ``_scaled_dot_product_cudnn_attention`` and the other fused attention kernels have
    CUDA ones only, ``_convert_weight_to_int4pack_for_cpu`` a CPU one only. Anything
    that is not an ATen op (Python arithmetic, a function of numbers) runs anywhere. A build
    without CUDA registers no CUDA kernels: ask for "CUDA" only where
    ``torch.backends.cuda.is_built()``."""
    got = _KERNELS.get((op, key))
    if got is None:
        got = _KERNELS[op, key] = not isinstance(op, torch._ops.OpOverload) or \
            torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key)
    return got


def is_fused_update(op: Any) -> bool:
    """Is ``op`` a fused optimizer kernel (``torch.optim``'s ``fused=True``: ``_fused_adamw``
    and the like, in place or functional)? One kernel over lists of parameters, gradients
    and state; its functional form clones each list it writes, then updates the clones."""
    return isinstance(op, torch._ops.OpOverload) and \
        op._schema.name.startswith("aten::_fused_")


def known_number(value: Any) -> int | float | bool | None:
    """The plain number a traced scalar stands for, if it is not symbolic (else None)."""
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        node = value.node
        if node.is_constant():
            return node.pytype(node.constant)  # type: ignore[no-any-return]
        expr = getattr(node, "expr", None)  # a sympy expression; a number once shapes agree
        if getattr(expr, "is_number", False):
            return node.pytype(expr)  # type: ignore[no-any-return]
    return None

"""How a loss averages over its batch, read from its autograd graph, and the seed that makes
every rank's backward give the one-process gradient.

One process computes ``loss = S / C`` (a mean: ``S`` summed over the whole batch, ``C`` its
count of rows, tokens or class weights) or ``loss = S`` (a sum). A rank computes its share,
``S_r / c_r``. DDP averages the ranks' gradients, so the rank's backward is seeded with

    mean: w_r = c_r * W / C        sum: w_r = W

and the average ``(1/W) sum_r w_r g_r`` is the one-process gradient exactly (``w_r = 1`` for
even shards). ``c_r`` stays a tensor on the loss's device: no host sync.

Policy and invariants
- :func:`reduction_of` walks from the loss's ``grad_fn`` through ops that keep one scalar
  and one differentiable input (:data:`THROUGH`: casts, views, negation, scaling by a
  constant such as GradScaler's or ``loss / accumulation_steps``) to the op that reduced
  (:data:`REDUCERS`). A mean reached through scaling keeps its count; a sum reached through
  scaling is unknown (``x.sum() / x.shape[0]`` is a mean over rows written by hand).
- DDP's sink around a module's outputs (:data:`FORWARDING`) is followed through the output
  the loss came from.
- Unknown (a sum of two losses, an op not in the tables): None. The caller weighs ranks by
  rows, which is exact for a mean over rows, and says so once, naming the op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REDUCERS", "THROUGH", "Reduction", "reduction_of"]

THROUGH = frozenset({
    "ToCopyBackward0", "CloneBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "ReshapeAliasBackward0", "AliasBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SqueezeBackward4", "UnsqueezeBackward0", "NegBackward0",
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
})
"""Ops a loss passes through on its way from its reduction to backward (see the docstring);
``Mul``/``Div`` only where exactly one input is differentiable (a constant factor), and a
``Div`` only where that input is the numerator."""

_SCALING = frozenset({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})

FORWARDING = frozenset({"_DDPSinkBackward"})
"""Nodes whose output k is their input k, unchanged (DDP's sink around a module's outputs)."""


@dataclass(frozen=True)
class Reduction:
    """How one rank's loss reduced its batch."""

    #: "mean" or "sum"
    kind: str
    #: the mean's count on this rank (rows, tokens, class weights); 1 for a sum
    count: torch.Tensor | float
    #: the op it was read from, for messages
    source: str


def _numel(node: Any) -> float:
    return float(math.prod(int(s) for s in node._saved_self_sym_sizes))


def _loss_fn(node: Any) -> Reduction | None:
    """A loss function's own reduction (``_saved_reduction``: 0 none, 1 mean, 2 sum)."""
    name = type(node).__name__
    reduction = getattr(node, "_saved_reduction", None)
    if reduction == 2:
        return Reduction("sum", 1.0, name)
    if reduction != 1:
        return None
    if name.startswith("NllLoss"):
        return Reduction("mean", node._saved_total_weight, name)
    return Reduction("mean", float(node._saved_self.numel()), name)


def _mean(node: Any) -> Reduction:
    return Reduction("mean", _numel(node), type(node).__name__)


def _sum(node: Any) -> Reduction:
    return Reduction("sum", 1.0, type(node).__name__)


REDUCERS = {
    "MeanBackward0": _mean, "MeanBackward1": _mean,
    "SumBackward0": _sum, "SumBackward1": _sum,
}
"""Reducing ops by name; any other node with a ``_saved_reduction`` (``nll_loss``,
``mse_loss``, ``binary_cross_entropy_with_logits``, ...) is read by its own reduction."""


def reduction_of(loss: torch.Tensor) -> Reduction | None:
    """How scalar ``loss`` reduced its batch, or None where its graph doesn't say."""
    node, nr, scaled = loss.grad_fn, loss.output_nr, False
    while node is not None:
        name = type(node).__name__
        if name in FORWARDING:
            node, nr = node.next_functions[nr]
            continue
        if name in REDUCERS or hasattr(node, "_saved_reduction"):
            found = REDUCERS[name](node) if name in REDUCERS else _loss_fn(node)
            if found is None or (scaled and found.kind == "sum"):
                return None
            return found
        if name not in THROUGH:
            return None
        edges = [i for i, (fn, _) in enumerate(node.next_functions) if fn is not None]
        if len(edges) != 1 or (name.startswith("Div") and edges[0] != 0):
            return None
        scaled |= name in _SCALING
        node, nr = node.next_functions[edges[0]]
    return None


def name_of(loss: torch.Tensor) -> str:
    """The op that made ``loss``, for messages."""
    return type(loss.grad_fn).__name__ if loss.grad_fn is not None else "a leaf"

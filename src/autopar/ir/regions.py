"""A group of a program's nodes seen from outside: the values it reads, those read outside it, and
whether a value shares a storage (a region or segment must not hand out a view)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from .graph import Node

__all__ = ["inputs_of", "is_view", "outputs_of"]


def outputs_of(group: Sequence[Node], users: dict[Node, list[Node]],
               graph_outputs: set[Node]) -> list[Node]:
    """The nodes of ``group`` read outside it, in order."""
    inside = set(group)
    return [n for n in group
            if n in graph_outputs or any(u not in inside for u in users[n])]


def inputs_of(group: Sequence[Node]) -> list[Node]:
    """The values ``group`` reads from outside, in order of first use."""
    inside = set(group)
    return list(dict.fromkeys(v for n in group for v in n.inputs if v not in inside))


def is_view(node: Node) -> bool:
    """Does ``node`` share a storage with another value? A view, or an element of a tuple of
    views (``split``, ``unbind``); an element of a tuple of fresh tensors is fresh itself."""
    if node.op is operator.getitem:
        node = node.args[0]
    return bool(node.aliases) or bool(getattr(node.op, "is_view", False))

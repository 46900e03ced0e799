"""The reference runner: every op in graph order on the device eager uses, freed at last use.

It is the ground truth the concurrent executor is checked against, and what runs a graph when
placement is not wanted. No threads, no streams: exactly eager PyTorch's sequence of ATen calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils._pytree import tree_map

from ..graph import Graph, Node


class SequentialRunner:
    """Runs one graph: ``runner(args) -> outputs`` (a list, in the graph's output order)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        last = graph.last_uses()
        # what to drop after each op: inputs whose last reader is that op
        self._free_after: dict[Node, list[Node]] = {}
        for value, user in last.items():
            if user is not None:
                self._free_after.setdefault(user, []).append(value)
        self._inputs = graph.inputs
        self._ops = graph.ops

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        if len(args) != len(self._inputs):
            raise TypeError(
                f"graph {self.graph.name} takes {len(self._inputs)} inputs, got {len(args)}")
        env: dict[Node, Any] = dict(zip(self._inputs, args))

        def lookup(x: Any) -> Any:
            return env[x] if isinstance(x, Node) else x

        for node in self._ops:
            env[node] = node.op(*tree_map(lookup, node.args), **tree_map(lookup, node.kwargs))
            for dead in self._free_after.get(node, ()):
                env.pop(dead, None)
        return [lookup(o) for o in self.graph.outputs]

"""The reference runner: every op in graph order on the device eager uses, freed at last use.

It is what runs a graph when placement fails or is not wanted, and the ground truth the
concurrent executor is checked against. No threads, no streams: exactly eager PyTorch's sequence
of ATen calls, compiled once to straight-line code by the executor's own code generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..ir.graph import Graph, Node
from ..schedule.steps import Free, Plan, Run, Step
from .codegen import SlotTable, build_program

_SPACE = "cpu:0"  # one slot space: values stay wherever eager put them


class SequentialRunner:
    """Runs one graph: ``runner(args) -> outputs`` (a list, in the graph's output order)."""

    def __init__(self, graph: Graph, plan: Plan | None = None) -> None:
        self.graph = graph
        self.plan = plan  # the plan this runs instead of, when one was made (it changed nothing)
        outputs = set(graph.output_nodes)
        free_after: dict[Node, list[Node]] = {}
        for value, user in graph.last_uses().items():
            if user is not None and value not in outputs:
                free_after.setdefault(user, []).append(value)
        steps: list[Step] = []
        for node in graph.ops:
            steps.append(Run(node))
            steps += [Free(v, _SPACE) for v in free_after.get(node, ())]
        self.slots = SlotTable()
        self._input_slots = [self.slots(x, _SPACE) for x in graph.inputs]
        outputs = [("slot", self.slots(o, _SPACE)) if isinstance(o, Node) else ("const", o)
                   for o in graph.outputs]
        # the whole call as one generated function, args -> outputs (no env built here)
        self.program = build_program(_SPACE, steps, self.slots, lambda v, d: _SPACE, set(),
                                     eager_devices=True, entry=(self._input_slots, outputs))
        self._n = len(self._input_slots)
        #: the call without the argument count check, for callers that know the count
        #: (:mod:`autopar.capture.direct`'s entries)
        self.unchecked = self.program.fn
        #: the whole call as lines a caller's generated function takes in (codegen.Inline)
        self.call_lines = self.program.call_lines

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        if len(args) != self._n:
            raise TypeError(f"graph {self.graph.name} takes {self._n} inputs, got {len(args)}")
        return self.unchecked(args)

"""The steps of a plan and the plan itself: the data the runtime obeys (what each step means, and
the invariants a plan keeps, are in :mod:`autopar.schedule.plan`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..ir.graph import Graph, Node, op_name
from ..ir.routing import copy_lane

if TYPE_CHECKING:
    from .place import Placement

__all__ = ["Free", "Plan", "Record", "Run", "Send", "Step", "Wait"]


@dataclass(frozen=True, slots=True)
class Run:
    node: Node

    def __str__(self) -> str:
        n = self.node
        args = [_arg(a) for a in n.args] + [f"{k}={_arg(v)}" for k, v in n.kwargs.items()]
        return f"run    {n!r} = {op_name(n.op)}({', '.join(args)})"


def _arg(a: Any) -> str:
    if isinstance(a, list | tuple):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


@dataclass(frozen=True, slots=True)
class Send:
    value: Node
    src: str
    dst: str
    stream: str
    event: int

    @property
    def lane(self) -> str:
        """Timeline lane of the copy, e.g. ``"cuda:0/d2h"`` (:func:`copy_lane`)."""
        return copy_lane(self.src, self.dst)

    def __str__(self) -> str:
        return f"send   {self.value!r} -> {self.dst} on {self.lane}  (e{self.event})"


@dataclass(frozen=True, slots=True)
class Record:
    value: Node
    event: int

    def __str__(self) -> str:
        return f"record {self.value!r} ready  (e{self.event})"


@dataclass(frozen=True, slots=True)
class Wait:
    event: int
    value: Node
    src: str

    def __str__(self) -> str:
        return f"wait   e{self.event}: {self.value!r} from {self.src}"


@dataclass(frozen=True, slots=True)
class Free:
    value: Node
    device: str

    def __str__(self) -> str:
        return f"free   {self.value!r}"


Step = Run | Send | Record | Wait | Free


@dataclass(frozen=True)
class Plan:
    """Per-device programs (see the module docstring), and where to read the outputs."""

    graph: Graph
    placement: Placement
    programs: dict[str, list[Step]]
    outputs: tuple[tuple[Any, str | None], ...]
    n_events: int

    def copies(self) -> list[Send]:
        """Every Send, in event order."""
        sends = [s for steps in self.programs.values() for s in steps if isinstance(s, Send)]
        return sorted(sends, key=lambda s: s.event)

    def steps(self) -> Iterator[tuple[str, Step]]:
        """(device, step) of every program, program by program."""
        for device, steps in self.programs.items():
            for step in steps:
                yield device, step

    def __str__(self) -> str:
        p = self.placement
        lines = [f"plan {self.graph.name}: {p.policy}, {len(self.programs)} programs, "
                 f"{len(self.copies())} copies, {self.n_events} events, predicted "
                 f"{p.predicted_s:.6g} s"]
        for device, steps in self.programs.items():
            lines.append(f"{device}:")
            lines += [f"  {i:>3}  {step}" for i, step in enumerate(steps)]
        outs = ", ".join(f"{o!r} @ {d}" if d is not None else repr(o) for o, d in self.outputs)
        lines.append(f"outputs: {outs}")
        return "\n".join(lines)

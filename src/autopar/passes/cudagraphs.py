"""Whether replaying GPU segments as CUDA graphs pays, and what it saves (the segments are
:mod:`autopar.schedule.segments`'; the mechanism is :mod:`autopar.runtime.cudagraphs`).

Policy
- A replay costs about one launch, plus one copy per input that is not already a static
  buffer and one clone per escaping output (see :mod:`autopar.schedule.segments`); with
  ``"auto"`` a segment is captured when its launches are at least twice that. ``True``
  captures every capturable segment; ``False`` none.
- Prediction (:class:`GraphedCost`): the ops of a captured segment cost the GPU their device
  time and the issuing thread nothing, but the segment's first op carries the replay
  (``REPLAY_S``) and a launch per input copied and output cloned; a view made again after a
  replay costs what it costs on streams, and a view made once (outside segments too)
  ``MADE_ONCE_S``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

from ..ir.graph import Node
from ..ir.routing import index_of, is_free_move
from ..schedule.segments import (
    chosen_segments_each,
    launches,
    step_ops,
    tuples_unpacked_at_once,
    views_made_once,
)
from ..schedule.simulate import host_time
from ..schedule.steps import Plan
from .fusion import reads_locally

__all__ = ["MADE_ONCE_S", "REPLAY_S", "Graphed", "GraphedCost", "capture_rule", "graphed_segments",
           "graphed_segments_each", "pays"]

REPLAY_S = 5e-6
"""Host seconds of one graph replay (``cudaGraphLaunch`` and the replay's Python): about one
kernel launch's (7.4 us on the H200 preset), less than a launch per op it replaces."""


MADE_ONCE_S = 0.1e-6
"""Host seconds of a view made once (:func:`~autopar.schedule.segments.views_made_once`),
at each call after the first: an identity check in the generated program (0.05 us on the
2-core VM; a view op is 0.4-2 us there, 2.4 us on the H200 preset)."""


def pays(mode: bool | str, n_launches: int, n_copies: int, n_clones: int) -> bool:
    """Is capturing worth it? (see the module docstring)."""
    if mode is False or n_launches == 0:
        return False
    if mode is True:
        return True
    return n_launches >= 2 * (1 + n_copies + n_clones)


def capture_rule(mode: bool | str) -> Callable[[int, int, int], bool] | None:
    """The executor's ``cuda_graphs``: ``pays`` under ``mode`` (``autopar.compile``'s
    ``cuda_graphs`` option), or None for ``False``."""
    return None if mode is False else partial(pays, mode)


class Graphed(NamedTuple):
    """What the executor replays under one rule, per device: each segment's ops, input copies
    and output clones; the views made again after a replay (``Segment.again``); the views
    made once (:func:`~autopar.schedule.segments.views_made_once`)."""

    segments: dict[str, list[tuple[list[Node], int, int]]]
    again: dict[str, frozenset[Node]]
    once: dict[str, frozenset[Node]]


def graphed_segments(plan: Plan, devices: Sequence[str], rule: Callable[[int, int, int], bool],
                     fused: dict[str, list[list[Node]]] | None = None,
                     in_place: frozenset[Node] = frozenset(),
                     transient: frozenset[Node] = frozenset()
                     ) -> dict[str, list[tuple[list[Node], int, int]]]:
    """The segments of the programs of ``devices`` the executor would capture under ``rule``
    (the same :func:`chosen_segments`, on the plan's steps; a region of ``fused`` counts one
    launch): per device, each segment's ops, input copies and output clones."""
    return graphed_segments_each(plan, devices, [rule], fused, in_place, transient)[0].segments


def graphed_segments_each(plan: Plan, devices: Sequence[str],
                          rules: Sequence[Callable[[int, int, int], bool]],
                          fused: dict[str, list[list[Node]]] | None = None,
                          in_place: frozenset[Node] = frozenset(),
                          transient: frozenset[Node] = frozenset()) -> list[Graphed]:
    """What the executor replays under each of ``rules`` (see :class:`Graphed`), each
    program's segments found once."""
    graph = plan.graph
    device_of = plan.placement.device
    ix = index_of(plan.placement, graph)
    outputs = set(graph.output_nodes)
    moved = {n for n in graph.ops if is_free_move(n, device_of, ix.passthrough)}
    found = [Graphed({}, {}, {}) for _ in rules]
    for device in devices:
        steps = plan.programs.get(device)
        if not steps:
            continue
        steps = tuples_unpacked_at_once(steps)
        region = {n: k for k, group in enumerate((fused or {}).get(device, ())) for n in group}
        each = chosen_segments_each(
            steps, ix, outputs, reads_locally(device, device_of, ix), rules,
            lambda seg, region=region: launches(seg, moved, region), label=device,
            transient=transient.__contains__, in_place=in_place.__contains__)
        for got, chosen in zip(found, each, strict=True):
            got.segments[device] = [([n for step in steps[c.start:c.end] for n in step_ops(step)],
                                     c.copies, len(c.escapes)) for c in chosen]
            got.again[device] = frozenset(v for c in chosen for v in c.again)
            got.once[device] = views_made_once(steps, chosen)
    return found


class GraphedCost:
    """``cost`` (a CostModel, or a :class:`~autopar.passes.fusion.FusedCost` over one) with the
    ops of captured segments priced as replayed (see the module docstring): their device time
    on the GPU and nothing on the issuing thread, the segment's first op carrying the replay
    and a launch per input copied and output cloned."""

    def __init__(self, cost: Any,
                 segments: dict[str, list[tuple[list[Node], int, int]]],
                 again: Mapping[str, frozenset[Node]] | None = None,
                 once: Mapping[str, frozenset[Node]] | None = None) -> None:
        self.cost = cost
        self._host: dict[tuple[Node, str], float] = {}
        prof = cost.machine.profile
        for device, segs in segments.items():
            launch = prof.device(device).launch("copy")
            for nodes, copies, clones in segs:
                for n in nodes:
                    self._host[(n, device)] = 0.0
                self._host[(nodes[0], device)] = REPLAY_S + (copies + clones) * launch
            for v in (again or {}).get(device, ()):  # run again after the replay
                self._host[(v, device)] = host_time(cost, v, device)
            for v in (once or {}).get(device, ()):
                self._host[(v, device)] = MADE_ONCE_S

    def _device_s(self, node: Node, device: str) -> float:
        device_s = getattr(self.cost, "device_s", None)
        return device_s(node, device) if device_s is not None else \
            self.cost.op_cost(node, device).device_s

    def node_time(self, node: Node, device: str) -> float:
        host = self._host.get((node, device))
        if host is None:
            return self.cost.node_time(node, device)
        return max(host, self._device_s(node, device))

    def host_s(self, node: Node, device: str) -> float:
        host = self._host.get((node, device))
        return host_time(self.cost, node, device) if host is None else host

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cost, name)

"""Fusion-aware choice of placement.

Policy
- The placement policies price every op as its own launch. With fusion on, a GPU region of
  fusible ops (see :mod:`autopar.runtime.fuse`) costs about one launch: a chain of 200 tiny
  pointwise ops that HEFT moves to the host, where each op is cheaper than a GPU launch, is
  one kernel on the GPU it started on.
- So, when some GPU's programs will be fused, the HEFT plan is compared with eager's placement
  (``single``), each predicted by :func:`autopar.schedule.simulate.simulate` under
  :class:`FusedCost`, and the faster is kept. Pure functions of plans and costs: nothing here
  touches a device.

``FusedCost`` prices a region at its first node: one launch for its pointwise, reduction and
view ops together (the host time of a launch or their longest device time, whichever is longer:
one kernel reads the inputs once), plus each matmul or other library call on its own; the
region's other ops cost nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..ir.graph import Graph, Node
from ..ir.routing import GraphIndex, kind_of, pool, route
from ..runtime.fuse import fusible, regions
from ..schedule.place import place
from ..schedule.plan import Plan, make_plan
from ..schedule.simulate import simulate

__all__ = ["FusedCost", "fused_regions", "prefer_fused"]

log = logging.getLogger("autopar")

_EXTERN = ("matmul", "other")  # Inductor calls these as library kernels, one launch each


def fused_regions(plan: Plan, devices: Sequence[str]) -> dict[str, list[list[Node]]]:
    """The regions the executor will fuse in the programs of ``devices``."""
    graph = plan.graph
    device_of = plan.placement.device
    ix = GraphIndex.of(graph)
    outputs = set(graph.output_nodes)
    found: dict[str, list[list[Node]]] = {}
    for device in devices:
        steps = plan.programs.get(device)
        if not steps:
            continue

        def local(v: Node, device: str = device) -> bool:
            return (route(v, device_of[v], device, ix) != "event"
                    or pool(device_of[v]) == pool(device))

        def ok(n: Node, device: str = device, local: Any = local) -> bool:
            return fusible(n, device, local, device_of, ix.passthrough)

        found[device] = regions(steps, ok, ix.users, outputs)
    return found


class FusedCost:
    """``cost`` with each fused region priced as one op (see the module docstring)."""

    def __init__(self, cost: Any, fused: dict[str, list[list[Node]]]) -> None:
        self.cost = cost
        self._times: dict[tuple[Node, str], float] = {}
        for device, groups in fused.items():
            for group in groups:
                for n in group:
                    self._times[(n, device)] = 0.0
                self._times[(group[0], device)] = self._region_time(group, device)

    def _region_time(self, group: list[Node], device: str) -> float:
        extern = [n for n in group if kind_of(n.op) in _EXTERN]
        fused = [n for n in group if kind_of(n.op) not in _EXTERN]
        time = sum(self.cost.node_time(n, device) for n in extern)
        op_cost = getattr(self.cost, "op_cost", None)
        if not fused:
            return time
        if op_cost is None:  # a cost model without host/device split: its longest op
            return time + max(self.cost.node_time(n, device) for n in fused)
        costs = [op_cost(n, device) for n in fused]
        return time + max(max(c.host_s for c in costs), max(c.device_s for c in costs))

    def node_time(self, node: Node, device: str) -> float:
        t = self._times.get((node, device))
        return self.cost.node_time(node, device) if t is None else t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cost, name)


def prefer_fused(plan: Plan, graph: Graph, cost: Any, devices: Sequence[str],
                 fusing: Sequence[str]) -> Plan:
    """``plan``, or eager's placement planned, whichever is predicted faster once the programs
    of ``fusing`` (GPUs) are fused."""
    if not fusing:
        return plan
    eager = make_plan(place(graph, cost, policy="single", devices=tuple(devices)), cost)

    def predicted(p: Plan) -> float:
        return simulate(p, FusedCost(cost, fused_regions(p, fusing))).makespan

    mine, theirs = predicted(plan), predicted(eager)
    if theirs < mine:
        log.info("autopar: %s keeps eager's placement: %.3g s fused, against %.3g s for %s",
                 graph.name, theirs, mine, plan.placement.policy)
        return eager
    return plan

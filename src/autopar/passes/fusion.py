"""Fusion policy: which regions of which programs are compiled by Inductor, and the fusion-aware
choice of placement (the compiling is :mod:`autopar.runtime.fuse`'s).

Policy
- Which devices fuse: :func:`fusion_devices` (``autopar.compile``'s ``fuse`` option). Which
  ops and regions: :func:`fusible` and :func:`regions` (the rules are in the docstring of
  :mod:`autopar.runtime.fuse`); :func:`regions_to_fuse` is what the executor is handed.
- The placement policies price every op as its own launch. With fusion on, a GPU region of
  fusible ops costs about one launch: a chain of 200 tiny pointwise ops that HEFT moves to the
  host, where each op is cheaper than a GPU launch, is one kernel on the GPU it started on.
- So, when some GPU's programs will be fused, the HEFT plan is compared with eager's placement
  (``single``), each predicted by :func:`autopar.schedule.simulate.simulate` under
  :class:`FusedCost`, and the faster is kept. Pure functions of plans and costs: nothing here
  touches a device.

``FusedCost`` prices a region at its first node: one launch for its pointwise, reduction and
view ops together (the host time of a launch or their longest device time, whichever is longer:
one kernel reads the inputs once), plus each matmul or other library call on its own; the
region's other ops cost nothing. Normalizations (batch, layer and group norm and their
backward ops, :data:`NORMALIZATIONS`) are not library calls there: Inductor decomposes them.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..ir.graph import Graph, Node, TensorMeta
from ..ir.regions import is_view, outputs_of
from ..ir.routing import index_of, is_free_move, kind_of, pool, route
from ..machine.host import cpu_fusion_unavailable
from ..schedule.place import place
from ..schedule.plan import make_plan
from ..schedule.simulate import host_time, simulate
from ..schedule.steps import Free, Plan, Run, Step

__all__ = ["MIN_FUSED_OPS", "NORMALIZATIONS", "FusedCost", "fused_regions", "fusible",
           "prefer_fused", "regions", "regions_to_fuse"]

log = logging.getLogger("autopar.placement")

_EXTERN = ("matmul", "other")  # Inductor calls these as library kernels, one launch each

NORMALIZATIONS = frozenset({
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "_batch_norm_with_update_functional",
    "native_batch_norm_backward", "batch_norm_backward", "native_layer_norm",
    "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward"})
"""Ops of kind ``other`` that Inductor decomposes into pointwise ops and reductions (each is in
``torch._inductor.decomposition.select_decomp_table()``, torch 2.11 and 2.13): in a region
they fuse like its own ops, so they are priced with its one kernel, not as library calls, and
they count towards a region's paying ops."""

MIN_FUSED_OPS = 2
"""A region is compiled when it has at least this many pointwise or reduction ops."""

_PAYING_KINDS = ("pointwise", "reduction")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _library_call(node: Node) -> bool:
    """Whether Inductor calls ``node`` as a library kernel of its own in a region."""
    return kind_of(node.op) in _EXTERN and not _normalization(node)


def _fuses(node: Node) -> bool:
    """Whether ``node`` is an op Inductor fuses into a region's kernel (a paying op)."""
    return kind_of(node.op) in _PAYING_KINDS or _normalization(node)


def _normalization(node: Node) -> bool:
    """Whether ``node``'s op is one of :data:`NORMALIZATIONS` (remembered per op: regions and
    ``FusedCost`` ask it of every node of every candidate plan)."""
    op = node.op
    known = _IS_NORMALIZATION.get(op)
    if known is None:
        known = _IS_NORMALIZATION[op] = isinstance(op, torch._ops.OpOverload) and \
            op._schema.name.partition("::")[2] in NORMALIZATIONS
    return known


_IS_NORMALIZATION: dict[Any, bool] = {}


def fusion_devices(devices: Sequence[str], fuse: bool | str) -> list[str]:
    """The devices whose programs get their regions compiled by Inductor.

    ``False``: none. ``"auto"``: the GPUs (where a launch costs most). ``True``: every device,
    CPU workers too when Inductor has a C++ compiler here (else they are skipped, logged).
    """
    if fuse is False:
        return []
    gpus = [d for d in devices if not d.startswith("cpu")]
    if fuse == "auto":
        return gpus
    cpus = [d for d in devices if d.startswith("cpu")]
    why = cpu_fusion_unavailable() if cpus else None
    if why:
        log.info("autopar: no fusion on %s: %s", ", ".join(cpus), why)
        return gpus
    return list(devices)


# -- which ops, which regions -------------------------------------------------------------
def fusible(node: Node, device: str, local: Callable[[Node], bool],
            device_of: dict[Node, str], passthrough: frozenset[Node] = frozenset()) -> bool:
    """May ``node`` (placed on ``device``) be part of a region? See the module docstring."""
    if node.op is operator.getitem:
        return True  # with its tuple's producer only: regions() checks
    if not isinstance(node.op, torch._ops.OpOverload) or node.writes or not node.tensor_metas:
        return False
    if isinstance(node.meta, tuple) and any(m is None for m in node.meta):
        return False
    if kind_of(node.op) == "random" or is_free_move(node, device_of, passthrough):
        return False
    if torch.Tag.nondeterministic_seeded in node.op.tags:
        return False
    if not all(local(v) for v in node.inputs):
        return False
    if not all(isinstance(v.meta, TensorMeta) for v in node.inputs):
        return False
    metas = [*node.tensor_metas, *(v.meta for v in node.inputs)]
    return not any(m.dtype in _LOW_PRECISION for m in metas)


def regions(steps: Sequence[Step], can_fuse: Callable[[Node], bool],
            users: dict[Node, list[Node]], graph_outputs: set[Node],
            min_ops: int = MIN_FUSED_OPS) -> list[list[Node]]:
    """The regions of one program worth compiling, each a list of nodes in program order."""
    left_out: set[Node] = set()
    known: dict[Node, bool] = {}  # can_fuse, asked once a node (the loop below asks again)

    def ok(n: Node) -> bool:
        if n in left_out:
            return False
        got = known.get(n)
        if got is None:
            got = known[n] = can_fuse(n)
        return got

    while True:
        groups = _groups(steps, ok)
        misfits = {n for g in groups for n in _misfits(g, users, graph_outputs)}
        if not misfits:
            break
        left_out |= misfits
    return [g for g in groups
            if sum(_fuses(n) for n in g) >= min_ops
            and outputs_of(g, users, graph_outputs)]


def _groups(steps: Sequence[Step], ok: Callable[[Node], bool]) -> list[list[Node]]:
    groups: list[list[Node]] = []
    current: list[Node] = []
    for step in steps:
        if isinstance(step, Free):
            continue
        if isinstance(step, Run) and ok(step.node):
            current.append(step.node)
            continue
        if current:
            groups.append(current)
        current = []
    if current:
        groups.append(current)
    return groups


def _misfits(group: list[Node], users: dict[Node, list[Node]],
             graph_outputs: set[Node]) -> list[Node]:
    """Nodes that must leave ``group``: escaping views and tuples, getitems of outside tuples."""
    inside = set(group)
    out: list[Node] = []
    for n in group:
        if n.op is operator.getitem and n.args[0] not in inside:
            out.append(n)
    for n in outputs_of(group, users, graph_outputs):
        if isinstance(n.meta, tuple) or is_view(n):
            out.append(n)
    return out


def regions_to_fuse(plan: Plan, fuse: bool | str) -> dict[str, list[list[Node]]]:
    """The executor's ``fuse``: the regions to compile in each program under the ``fuse`` option
    (``autopar.compile``'s: False, ``"auto"`` or True, see :func:`fusion_devices`)."""
    return fused_regions(plan, fusion_devices(list(plan.programs), fuse))


def reads_locally(device: str, device_of: dict[Node, str],
                  ix: Any) -> Callable[[Node], bool]:
    """``local(v)``: does a reader on ``device`` find ``v`` in its own memory pool (what a
    fused region or a CUDA graph may read)?"""
    def local(v: Node) -> bool:
        return route(v, device_of[v], device, ix) != "event" or pool(device_of[v]) == pool(device)
    return local


def fused_regions(plan: Plan, devices: Sequence[str]) -> dict[str, list[list[Node]]]:
    """The regions the executor will fuse in the programs of ``devices``."""
    graph = plan.graph
    device_of = plan.placement.device
    ix = index_of(plan.placement, graph)
    outputs = set(graph.output_nodes)
    found: dict[str, list[list[Node]]] = {}
    for device in devices:
        steps = plan.programs.get(device)
        if not steps:
            continue

        local = reads_locally(device, device_of, ix)

        def ok(n: Node, device: str = device, local: Any = local) -> bool:
            return fusible(n, device, local, device_of, ix.passthrough)

        found[device] = regions(steps, ok, ix.users, outputs)
    return found


class FusedCost:
    """``cost`` with each fused region priced as one op (see the module docstring)."""

    def __init__(self, cost: Any, fused: dict[str, list[list[Node]]]) -> None:
        self.cost = cost
        self._times: dict[tuple[Node, str], float] = {}
        self._host: dict[tuple[Node, str], float] = {}
        self._device: dict[tuple[Node, str], float] = {}
        self._regions: dict[tuple[Node, str], tuple[list[Node], list[Node]]] = {}
        for device, groups in fused.items():
            for group in groups:
                for n in group:
                    self._times[(n, device)] = self._host[(n, device)] = 0.0
                extern: list[Node] = []
                fused: list[Node] = []
                for n in group:
                    (extern if _library_call(n) else fused).append(n)
                self._times[(group[0], device)] = self._region_time(extern, fused, device)
                self._host[(group[0], device)] = \
                    sum(host_time(cost, n, device) for n in extern) + \
                    max((host_time(cost, n, device) for n in fused), default=0.0)
                self._regions[(group[0], device)] = (extern, fused)

    def _region_time(self, extern: list[Node], fused: list[Node], device: str) -> float:
        """A region's time: its library calls', and one launch for its other ops."""
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

    def device_s(self, node: Node, device: str) -> float:
        """The GPU's seconds of a region at its first node (its library calls', and its
        longest other op's), nothing at its other nodes; other nodes as ``cost``."""
        region = self._regions.get((node, device))
        if region is not None:  # asked for by CUDA graphs' predictions only: worked out then
            t = self._device.get((node, device))
            if t is None:
                extern, fused = region
                t = self._device[(node, device)] = \
                    sum(self.cost.op_cost(n, device).device_s for n in extern) + \
                    max((self.cost.op_cost(n, device).device_s for n in fused), default=0.0)
            return t
        if (node, device) in self._times:  # a region's other nodes
            return 0.0
        return self.cost.op_cost(node, device).device_s

    def host_s(self, node: Node, device: str) -> float:
        """A region's launches at its first node (its library calls', and one for the
        rest), nothing at its other nodes; other nodes as ``cost``."""
        t = self._host.get((node, device))
        return host_time(self.cost, node, device) if t is None else t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cost, name)


def prefer_fused(plan: Plan, graph: Graph, cost: Any, devices: Sequence[str],
                 fusing: Sequence[str]) -> Plan:
    """``plan``, or eager's placement planned, whichever is predicted faster once the programs
    of ``fusing`` (GPUs) are fused; eager's only where its ops are all on ``devices``.

    By the simulated makespan, not counting the one thread that issues the host's and every
    GPU's work (:func:`~autopar.schedule.simulate.issue_s`, which ``explain`` shows): counted,
    W1's plan (its bounds read on the host, the design's motivating case) predicts 86 µs of
    issue against eager's 58.5 on ``h200x2``, its four scalar copies priced at 17.4 µs each,
    a price never measured; where the thread does bind (such plans of GPT-2's and BERT's
    training steps measured 2.4-2.8× eager's time: see benchmarks/NOTES.md) the measured
    choice drops the plan."""
    if not fusing:
        return plan
    placed = place(graph, cost, policy="single", devices=tuple(devices))
    if any(placed.device[n] not in devices for n in graph.ops):
        return plan  # eager's devices are not all among those allowed (devices="cuda:1")
    eager = make_plan(placed, cost)

    def predicted(p: Plan) -> float:
        return simulate(p, FusedCost(cost, fused_regions(p, fusing))).makespan

    mine, theirs = predicted(plan), predicted(eager)
    if theirs < mine:
        log.info("autopar: %s keeps eager's placement: %.3g s fused, against %.3g s for %s",
                 graph.name, theirs, mine, plan.placement.policy)
        return eager
    return plan

"""explain: where each op would run, why, and what the whole graph is predicted to take.

Policy
- Nothing runs. The function is traced with fake inputs (:func:`autopar.capture.fx.trace_fake`), so
  it can be explained for a machine that isn't at hand (``machine="h200x2"``); CPU-built example
  inputs are taken to live on ``inputs_on``.
- The same graph is placed twice: by the chosen policy and by ``single`` (eager's placement).
  Both plans are simulated under one cost model; the report compares their makespans.
- Host syncs are listed: each GPU value the host reads (a slice bound, ``.item()``, a host
  scalar made from it) is one sync per call, however many ops use it; a read the plan leaves on
  a GPU (no CPU device allowed) is one sync per reading op.
- The critical path is the longest chain of (op time on its device + transfer time to the next
  op's device) through the placed graph.
- Code that can't be traced with fake inputs (it reads tensor values, or calls ``backward()``)
  is, with ``run=True``, captured by running it once on this host; each graph it makes is
  explained, and the report adds them up in order (graphs run one after another). With
  ``inputs_on``, values the run put on the CPU are taken to live there instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from io import StringIO
from typing import Any

import torch

from ..capture.fake import capture_by_running, relabel_devices, trace_fake
from ..capture.fx import Unsupported
from ..cost.model import CostModel, reads_to_host
from ..ir.graph import Graph, Node, op_name
from ..ir.routing import GraphIndex, free_move_on
from ..ir.units import fmt_seconds
from ..machine.detect import load_machine
from ..machine.host import no_cuda_error
from ..machine.model import Machine, parse_devices
from ..passes.fusion import fusion_devices, prefer_fused
from ..runtime.sequential import SequentialRunner
from ..schedule.place import Placement, place, places_by_cost
from ..schedule.plan import make_plan
from ..schedule.simulate import issue_s, runs_as_eager, simulate
from ..schedule.steps import Plan
from ..schedule.timeline import Timeline

__all__ = ["ExplainReport", "Row", "critical_path", "explain", "explain_graph"]

log = logging.getLogger("autopar.explain")


@dataclass
class Row:
    graph: str
    node: int
    name: str
    op: str
    shapes: str
    device: str
    eager_device: str
    times: dict[str, float]
    why: str
    source: str | None


@dataclass
class ExplainReport:
    graph_name: str
    machine: str
    policy: str
    predicted_s: float
    eager_predicted_s: float
    rows: list[Row]
    critical_path: list[str]
    transfers: int
    transfer_bytes: int
    timeline: Timeline = field(repr=False)
    eager_timeline: Timeline = field(repr=False)
    plan: Plan = field(repr=False)
    critical_nodes: list[Node] = field(repr=False, default_factory=list)
    captured: str = "traced with fake inputs"
    syncs: list[str] = field(default_factory=list)
    runs_as_eager: bool = False  # simulate.runs_as_eager: eager's sequence, not the executor
    issue_s: float = 0.0  # the plan's seconds on the one thread that issues all its work

    @property
    def speedup(self) -> float:
        return self.eager_predicted_s / self.predicted_s if self.predicted_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph_name, "machine": self.machine, "policy": self.policy,
            "predicted_s": self.predicted_s, "eager_predicted_s": self.eager_predicted_s,
            "speedup": self.speedup, "critical_path": self.critical_path,
            "transfers": self.transfers, "transfer_bytes": self.transfer_bytes,
            "captured": self.captured, "syncs": self.syncs, "runs_as_eager": self.runs_as_eager,
            "issue_s": self.issue_s,
            "rows": [asdict(r) for r in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self, max_rows: int = 60) -> str:
        from rich.console import Console  # lazy: start-up cost
        from rich.table import Table  # lazy: start-up cost

        devices = sorted({d for r in self.rows for d in r.times})
        table = Table(title=f"{self.graph_name} on {self.machine} ({self.policy})")
        for col in ("op", "shapes", "device", *[f"t@{d}" for d in devices], "why"):
            table.add_column(col, overflow="fold")
        for r in self.rows[:max_rows]:
            table.add_row(r.op, r.shapes, r.device,
                          *[fmt_seconds(r.times.get(d)) for d in devices], r.why)
        buf = StringIO()
        console = Console(file=buf, width=160, force_terminal=False)
        console.print(f"{self.graph_name}: {self.captured}")
        console.print(table)
        if len(self.rows) > max_rows:
            console.print(f"... {len(self.rows) - max_rows} more ops (use --json for all)")
        console.print(
            f"predicted {fmt_seconds(self.predicted_s)} vs eager "
            f"{fmt_seconds(self.eager_predicted_s)}: "
            f"{self.speedup:.2f}x; {self.transfers} transfers, "
            f"{self.transfer_bytes / 1e6:.3g} MB moved")
        if self.issue_s > self.timeline.makespan:
            console.print(f"bound by the issuing thread: {fmt_seconds(self.issue_s)} of "
                          "launches, host ops and copies on the one thread that issues the "
                          "host's and every GPU's work (the devices' own time "
                          f"{fmt_seconds(self.timeline.makespan)})")
        for sync in self.syncs:
            console.print(f"host sync: {sync}")
        if self.runs_as_eager and self.plan.graph.folded:
            console.print("runs as eager does: eager's placement with nothing to overlap (unless "
                          "fused GPU regions pay), on the graph with its constants folded at "
                          "capture, so autopar.compile times a few calls through dynamo and "
                          "plain, and keeps the faster")
        elif self.runs_as_eager:
            console.print("runs as eager does: eager's placement with nothing to overlap (unless "
                          "fused GPU regions pay), so autopar.compile calls the function itself "
                          "from the second call with the same argument shapes")
        else:
            console.print("placed: autopar.compile times a few calls this way, as the function "
                          "itself and as torch.compile's default, and keeps the fastest "
                          "(autopar.choose)")
        path = " -> ".join(self.critical_path[:12])
        more = " ..." if len(self.critical_path) > 12 else ""
        console.print(f"critical path ({len(self.critical_path)} ops): {path}{more}")
        return buf.getvalue()

    def __str__(self) -> str:
        return self.to_text()




def _shapes(node: Node) -> str:
    metas = [m for i in node.inputs for m in i.tensor_metas]
    outs = node.tensor_metas
    ins = ", ".join(str(m) for m in metas[:3]) + (", ..." if len(metas) > 3 else "")
    return f"{ins} -> {', '.join(str(m) for m in outs)}"


def host_syncs(plan: Plan) -> list[str]:
    """Where the host waits for a GPU each call: GPU values read by host ops (one sync per
    value), and ops that read a value back to the host on a GPU (one sync each)."""
    device = plan.placement.device
    graph = plan.graph
    out = []
    for send in plan.copies():
        if send.dst.startswith("cpu") and send.src != "cpu":
            readers = [n for n in graph.ops if send.value in n.inputs
                       and device[n].startswith("cpu")]
            if readers:
                uses = ", ".join(f"{op_name(n.op)}{n!r}" for n in readers[:4])
                more = ", ..." if len(readers) > 4 else ""
                out.append(f"{send.value!r} is read from {send.src} once per call "
                           f"(one sync) by {len(readers)} host op(s): {uses}{more}")
    for n in graph.ops:
        if reads_to_host(n) and not device[n].startswith("cpu"):
            out.append(f"{op_name(n.op)}{n!r} reads a value back to the host on {device[n]} "
                       "(one sync per call)")
    return out


def critical_path(placement: Placement, cost: CostModel) -> list[Node]:
    """The longest chain of op and transfer times through the placed graph."""
    graph = placement.graph
    finish: dict[Node, float] = {}
    prev: dict[Node, Node | None] = {}
    for n in graph.nodes:
        dev = placement.device[n]
        start, best = 0.0, None
        for i in n.inputs:
            moved = sum(m.nbytes for m in i.tensor_metas)
            t = finish[i] + cost.transfer_time(moved, placement.device[i], dev)
            if t > start or best is None:
                start, best = t, i
        finish[n] = start + (0.0 if n.is_input else cost.node_time(n, dev))
        prev[n] = best
    ends = graph.output_nodes or graph.ops[-1:]
    if not ends:
        return []
    node: Node | None = max(ends, key=lambda n: finish[n])
    path: list[Node] = []
    while node is not None:
        if not node.is_input:
            path.append(node)
        node = prev[node]
    return path[::-1]


def explain_graph(graph: Graph, machine: Machine | str | None = None,
                  policy: str = "heft", devices: str | Sequence[str] | None = None
                  ) -> ExplainReport:
    """Place, plan and simulate ``graph`` under ``policy`` and under eager placement.

    ``devices``: the machine's devices ops may be placed on (None: all of them), as
    ``autopar.compile(devices=...)`` restricts them."""
    machine = load_machine(machine)
    cost = CostModel(machine)
    devices = list(parse_devices(devices, len(machine.gpus), f"machine {machine.name}")) \
        if devices is not None else None
    placement = place(graph, cost, policy=policy, devices=devices)
    plan = make_plan(placement, cost)
    if places_by_cost(policy):  # the plan autopar.compile keeps (see prefer_fused)
        chosen = list(devices) if devices is not None else [d.name for d in machine.devices]
        plan = prefer_fused(plan, graph, cost, chosen, fusion_devices(chosen, "auto"))
        placement = plan.placement
    eager_plan = make_plan(place(graph, cost, policy="single"), cost)
    timeline = simulate(plan, cost)
    eager_timeline = simulate(eager_plan, cost)
    names = [d.name for d in machine.devices]
    passthrough = GraphIndex.of(graph).passthrough
    rows = []
    for n in graph.ops:
        # a device move costs its lane nothing where the copy is it, or where it hands its
        # input on (routing.free_move_on); the copy itself is counted with the transfers
        times = {d: 0.0 if free_move_on(n, d, placement.device, passthrough)
                 else cost.node_time(n, d) for d in names if cost.can_run(n, d)}
        rows.append(Row(
            graph=graph.name, node=n.id, name=repr(n), op=op_name(n.op), shapes=_shapes(n),
            device=placement.device[n], eager_device=machine.home(n.device or "cpu").name,
            times=times, why=placement.notes.get(n, ""), source=n.source))
    copies = plan.copies()
    path = critical_path(placement, cost)
    # no faster than the one thread that issues it all (runtime.interleave), eager included
    issue, eager_issue = issue_s(plan, cost), issue_s(eager_plan, cost)
    return ExplainReport(
        graph_name=graph.name, machine=machine.name, policy=policy,
        predicted_s=max(timeline.makespan, issue),
        eager_predicted_s=max(eager_timeline.makespan, eager_issue), issue_s=issue,
        rows=rows, critical_path=[f"{op_name(n.op)}{n!r}" for n in path],
        transfers=len(copies),
        transfer_bytes=sum(m.nbytes for s in copies for m in s.value.tensor_metas),
        timeline=timeline, eager_timeline=eager_timeline, plan=plan, critical_nodes=path,
        syncs=host_syncs(plan),
        runs_as_eager=runs_as_eager(plan, cost, devices or names))


def explain(fn: Callable, *args: Any, machine: Machine | str | None = None,
            policy: str = "heft", inputs_on: str | None = None,
            run: bool = False, devices: str | Sequence[str] | None = None) -> ExplainReport:
    """Explain how autopar would run ``fn(*args)`` on ``machine``.

    Nothing is computed unless ``run=True`` and the function can't be traced with fake inputs
    (see the module docstring). ``inputs_on``: the device of the machine on which CPU-built
    example inputs are taken to live (e.g. ``"cuda:0"`` for code written for a GPU, explained
    on a CPU-only machine). ``devices``: the devices of ``machine`` ops may be placed on (None:
    all), as ``autopar.compile(devices=...)`` restricts them.
    """
    if not callable(fn):
        raise TypeError(f"explain expects a function or nn.Module, got {type(fn).__name__}")
    resolved = load_machine(machine)
    if inputs_on is not None and inputs_on not in {d.name for d in resolved.devices}:
        have = ", ".join(d.name for d in resolved.devices)
        raise ValueError(f"inputs_on={inputs_on!r} is not a device of {resolved.name} ({have})")
    torch_device = "cpu" if inputs_on and inputs_on.startswith("cpu") else inputs_on
    try:
        return explain_graph(trace_fake(fn, args, inputs_on=torch_device), resolved, policy,
                             devices)
    except Unsupported as e:
        if _no_cuda_here(e, torch_device):
            # a CPU-only torch can't index or move fake GPU tensors: trace on the CPU instead
            # and take its values to live on the GPU (explicit moves in the code are not seen)
            with contextlib.suppress(Unsupported):
                graph = relabel_devices(trace_fake(fn, args), "cpu", torch_device)
                report = explain_graph(graph, resolved, policy, devices)
                report.captured = (f"traced with fake inputs on the CPU, values taken to live "
                                   f"on {torch_device} (device moves in the code are not seen)")
                return report
        if not run:
            raise Unsupported(f"{e}; pass run=True (--run) to capture it by running it once "
                              "on this host") from e
        why = str(e)
    graphs = capture_by_running(fn, args, SequentialRunner)
    if not graphs:
        raise Unsupported(f"running {getattr(fn, '__name__', fn)!r} made no graph to explain")
    if torch_device and torch_device != "cpu":
        graphs = [relabel_devices(g, "cpu", torch_device) for g in graphs]
    reports = [explain_graph(g, resolved, policy, devices) for g in graphs]
    log.info("autopar: explain captured %s by running it: %s", graphs[0].name, why)
    return _in_sequence(reports, f"captured by running on this host: {len(graphs)} graphs")


def _no_cuda_here(error: Exception, device: str | None) -> bool:
    return (bool(device) and device != "cpu" and not torch.cuda.is_available()
            and no_cuda_error(error))


def _in_sequence(reports: list[ExplainReport], captured: str) -> ExplainReport:
    """One report for graphs that run one after another: times add up, timelines follow each
    other; the plan and critical path shown are those of the longest graph."""
    main = max(reports, key=lambda r: r.eager_predicted_s)

    def chain(timelines: list[Timeline]) -> Timeline:
        spans, offset = [], 0.0
        for tl in timelines:
            start = min((s.start for s in tl.spans), default=0.0)
            spans += [replace(s, start=s.start - start + offset, end=s.end - start + offset)
                      for s in tl.spans]
            offset += tl.makespan
        return Timeline(spans, source=timelines[0].source, label=main.graph_name)

    return ExplainReport(
        graph_name=" + ".join(r.graph_name for r in reports), machine=main.machine,
        policy=main.policy, predicted_s=sum(r.predicted_s for r in reports),
        eager_predicted_s=sum(r.eager_predicted_s for r in reports),
        rows=[row for r in reports for row in r.rows], critical_path=main.critical_path,
        transfers=sum(r.transfers for r in reports),
        transfer_bytes=sum(r.transfer_bytes for r in reports),
        timeline=chain([r.timeline for r in reports]),
        eager_timeline=chain([r.eager_timeline for r in reports]),
        plan=main.plan, critical_nodes=main.critical_nodes, captured=captured,
        syncs=[sync for r in reports for sync in r.syncs],
        runs_as_eager=all(r.runs_as_eager for r in reports),
        issue_s=sum(r.issue_s for r in reports))

"""Simulate: run a Plan under the cost model, in virtual time, and return its Timeline.

Policy (a discrete-event loop; no threads, no CUDA)
- Each device's program runs its steps in order on its lane (``cpu:N``, or ``cuda:N/compute``).
  A Run starts when the program reaches it and takes ``place.op_time``; a Wait holds the program
  until its event has fired; Record fires its event a thread hand-off after its value is ready
  (``place.handoff_time``; none on the collectives' lane, or where only that lane waits: its
  program is run by the thread that launches the GPUs' work); Free takes no time.
- A Send does not hold its program: the copy joins its copy lane (e.g. ``cuda:0/d2h``). Each copy
  lane serves its copies in event order, each from max(value ready, lane free), for
  :func:`~autopar.ir.routing.copy_time`; the copy's event fires when it lands.
- The loop takes the program with the earliest clock from a heap and runs it until it blocks
  on an event; firing an event pushes its waiters back. Steps are visited once: linear in the
  plan's size, up to the heap's log factor. A plan whose programs wait on each other forever
  raises RuntimeError naming them.
- The times do not depend on the order the loop visits programs in, and for a placement made
  by :func:`autopar.schedule.place.place` they equal the planned slots: ``makespan == predicted_s``.

Glossary of loop state (:class:`_Sim`)
- ``clock[d]``: when program ``d``'s lane is next free; ``pc[d]``: its next step.
- ``ready[(v, d)]``: when value ``v`` was produced on device ``d``.
- ``fired[e]``: when event ``e`` fired; ``waiters[e]``: programs blocked on it.
- ``queue[lane]`` / ``head[lane]``: a copy lane's events in order and the next one to serve;
  ``issued[e]``: Sends issued but not yet served; ``free_at[lane]``: when the lane is free.

:func:`peak_memory` replays the memory model of :mod:`autopar.schedule.place` on a simulated
Timeline; :func:`runs_as_eager` says from a simulation whether a plan gains anything over eager's
sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from ..ir.collective import COMM, inline
from ..ir.graph import Node, op_name
from ..ir.routing import (
    GraphIndex,
    compute_lane,
    copy_time,
    gc_paused,
    handoff_time,
    hands_off,
    home_device,
    index_of,
    is_pure_move,
    op_time,
    owns_storage,
    pinned_storage,
    pool,
    route,
    storage_of,
    value_bytes,
)
from .place import place
from .steps import Free, Plan, Record, Run, Send, Wait
from .timeline import Span, Timeline

__all__ = ["EAGER_OVERLAP_GAIN", "host_time", "issue_s", "peak_memory", "runs_as_eager",
           "send_issue_s", "simulate", "wait_issue_s"]


def simulate(plan: Plan, cost: Any) -> Timeline:
    """Discrete-event run of ``plan`` under ``cost`` (see the module docstring)."""
    with gc_paused():
        return _Sim(plan, cost).run()


class _Sim:
    def __init__(self, plan: Plan, cost: Any) -> None:
        self.plan = plan
        self.cost = cost
        self.handoff = handoff_time(cost)
        self.device_of = plan.placement.device
        self.index = index_of(plan.placement, plan.graph)
        self.programs = plan.programs
        self.clock = {d: 0.0 for d in self.programs}
        self.pc = {d: 0 for d in self.programs}
        self.ready: dict[tuple[Node, str], float] = {
            (x, self.device_of[x]): 0.0 for x in plan.graph.inputs}
        self.fired: dict[int, float] = {}
        self.waiters: dict[int, list[str]] = {}
        self.queue: dict[str, list[int]] = {}
        for send in plan.copies():
            self.queue.setdefault(send.lane, []).append(send.event)
        self.head = dict.fromkeys(self.queue, 0)
        self.free_at = dict.fromkeys(self.queue, 0.0)
        self.issued: dict[int, tuple[Send, float]] = {}
        self.spans: list[Span] = []
        self.heap = [(0.0, d) for d in sorted(self.programs)]
        readers: dict[int, set[str]] = {}
        for d, steps in self.programs.items():
            for s in steps:
                if isinstance(s, Wait):
                    readers.setdefault(s.event, set()).add(d)
        # events no reader waits a thread hand-off for (as placement times them)
        self.no_handoff = {s.event for d, steps in self.programs.items() for s in steps
                           if isinstance(s, Record) and readers.get(s.event)
                           and not any(hands_off(d, r) for r in readers[s.event])}

    def run(self) -> Timeline:
        while self.heap:
            _, device = heapq.heappop(self.heap)
            self._advance(device)
        stuck = {d: self.programs[d][self.pc[d]] for d in self.programs
                 if self.pc[d] < len(self.programs[d])}
        if stuck:
            where = "; ".join(f"{d} at step {self.pc[d]} ({s})" for d, s in stuck.items())
            raise RuntimeError(f"plan {self.plan.graph.name} deadlocks: {where}")
        unserved = [lane for lane, q in self.queue.items() if self.head[lane] < len(q)]
        if unserved:
            raise RuntimeError(f"plan {self.plan.graph.name}: copies never issued on {unserved}")
        self.spans.sort(key=lambda s: (s.start, s.end, s.lane))
        label = f"{self.plan.graph.name} ({self.plan.placement.policy})"
        return Timeline(self.spans, source="simulated", label=label)

    def _advance(self, device: str) -> None:
        steps = self.programs[device]
        while self.pc[device] < len(steps):
            step = steps[self.pc[device]]
            if isinstance(step, Wait):
                t = self.fired.get(step.event)
                if t is None:
                    self.waiters.setdefault(step.event, []).append(device)
                    return
                self.clock[device] = max(self.clock[device], t)
            elif isinstance(step, Run):
                self._run(device, step.node)
            elif isinstance(step, Send):
                ready = self._value_ready(step.value, step.src, step)
                self.issued[step.event] = (step, ready)
                self._serve(step.lane)
            elif isinstance(step, Record):
                handoff = 0.0 if step.event in self.no_handoff else self.handoff
                self._fire(step.event, self._value_ready(step.value, device, step) + handoff)
            elif not isinstance(step, Free):
                raise TypeError(f"unknown plan step {step!r} in the program of {device}")
            self.pc[device] += 1

    def _value_ready(self, value: Node, device: str, step: Any) -> float:
        t = self.ready.get((value, device))
        if t is None:
            raise RuntimeError(f"{step} on {device}: {value!r} was not produced there before")
        return t

    def _run(self, device: str, node: Node) -> None:
        start = self.clock[device]
        end = start + op_time(self.cost, node, device, self.device_of, self.index.passthrough)
        self.spans.append(Span(compute_lane(device), op_name(node.op), start, end, "op", node.id))
        self.clock[device] = end
        self.ready[(node, device)] = end

    def _serve(self, lane: str) -> None:
        """Serve the lane's copies in event order, as far as they have been issued."""
        queue = self.queue[lane]
        while self.head[lane] < len(queue) and queue[self.head[lane]] in self.issued:
            send, ready = self.issued.pop(queue[self.head[lane]])
            nbytes = self.index.nbytes[send.value]
            start = max(ready, self.free_at[lane])
            end = start + copy_time(self.cost, nbytes, send.src, send.dst)
            self.spans.append(Span(lane, f"copy {send.value!r}", start, end, "copy",
                                   send.value.id, nbytes, send.src, send.dst))
            self.free_at[lane] = end
            self.head[lane] += 1
            self._fire(send.event, end)

    def _fire(self, event: int, t: float) -> None:
        self.fired[event] = t
        for device in self.waiters.pop(event, ()):
            heapq.heappush(self.heap, (max(self.clock[device], t), device))


# -- the calling thread ------------------------------------------------------------------
def issue_s(plan: Plan, cost: Any) -> float:
    """Seconds the calling thread spends on a plan: the host's program (the first CPU
    worker's) and every GPU's run on that one thread (:mod:`autopar.runtime.interleave`), so
    a call takes at least its host ops' time plus the host time of every GPU op's launch
    (``cost.host_s``; a collective's covers its launches and its parts' events) and of every
    copy and cross-stream wait it issues (:func:`send_issue_s`, :func:`wait_issue_s`: a GPU's
    wait for a copy or a collective). :func:`simulate`'s lanes each count their own launches
    only: on ``h200x8`` GPT-2 small's AdamW step split over the 8 GPUs simulated 29.7 ms
    while its GPU ops' launches alone add up to 36.6 ms."""
    copied = {s.event for steps in plan.programs.values() for s in steps
              if isinstance(s, Send)}
    total = 0.0
    for device, steps in plan.programs.items():
        gpu = not device.startswith("cpu")
        if not gpu and device != "cpu:0":
            continue  # another CPU worker: a thread of its own
        for step in steps:
            if isinstance(step, Run):
                total += host_time(cost, step.node, device) if gpu else \
                    cost.node_time(step.node, device)
            elif isinstance(step, Send):
                total += send_issue_s(cost, step)
            elif gpu and isinstance(step, Wait) and (
                    step.event in copied or (step.src == COMM and not inline(
                        step.value.args[0].meta.nbytes))):  # (inline: the same stream)
                total += wait_issue_s(cost)
    return total


def send_issue_s(cost: Any, send: Send) -> float:
    """Host time of issuing one copy to or from a GPU: the copy's launch on the GPU's side
    stream, and ordering that stream after the producer and the consumer after the copy (an
    event recorded and waited on: ``event_wait_s``, calibrated). What the executor's
    ``rt.send`` does; 0 under a cost model without a machine."""
    machine = getattr(cost, "machine", None)
    if machine is None:
        return 0.0
    gpu = send.src if not send.src.startswith("cpu") else send.dst
    return machine.profile.device(machine.device(gpu).name).launch("copy") + \
        machine.profile.event_wait_s


def wait_issue_s(cost: Any) -> float:
    """Host time of a GPU program's wait for a copy: its stream made to wait on the copy's
    event (half of a record and a wait, ``event_wait_s``)."""
    machine = getattr(cost, "machine", None)
    return 0.0 if machine is None else machine.profile.event_wait_s / 2


def host_time(cost: Any, node: Node, device: str) -> float:
    """``cost.host_s`` of the node, or its whole time under a cost model without a host and
    device split."""
    host = getattr(cost, "host_s", None)
    return cost.node_time(node, device) if host is None else host(node, device)


# -- memory -------------------------------------------------------------------------------
def peak_memory(plan: Plan, timeline: Timeline) -> dict[str, int]:
    """Peak live bytes of each memory pool while ``plan`` runs as ``timeline`` says.

    The model of :mod:`autopar.schedule.place`: a storage lives from the start of the op or copy
    that writes it (graph inputs: from 0) to the end of the last op or copy that touches it, or to
    the end of the run when it is kept (inputs, delivered outputs, host storages several CPU
    workers use, host scalars read by a GPU kernel).
    """
    dev = plan.placement.device
    ix = index_of(plan.placement, plan.graph)
    runs = {(s.node, s.lane.split("/")[0]): s for s in timeline.spans if s.kind == "op"}
    copies = {(s.node, s.dst): s for s in timeline.spans if s.kind == "copy"}
    born: dict[Any, tuple[str, float, int]] = {}  # storage key -> (pool, alloc time, bytes)
    touched: dict[Any, float] = {}
    devices: dict[Any, set[str]] = {}

    def touch(key: Any, t: float, device: str) -> None:
        touched[key] = max(touched.get(key, t), t)
        devices.setdefault(key, set()).add(device)

    for x in plan.graph.inputs:
        born[("local", x)] = (pool(dev[x]), 0.0, value_bytes(x))
    for device, step in plan.steps():
        if isinstance(step, Run) and owns_storage(step.node, dev, ix.passthrough):
            span = runs[(step.node.id, device)]
            born[("local", step.node)] = (pool(device), span.start, step.node.out_bytes)
        elif isinstance(step, Send):
            span = copies[(step.value.id, step.dst)]
            born[("copy", step.value, pool(step.dst))] = (pool(step.dst), span.start,
                                                          value_bytes(step.value))
    for device, step in plan.steps():
        if isinstance(step, Run):
            n, end, here = step.node, runs[(step.node.id, device)].end, pool(device)
            touch(storage_of(n, here, dev, ix.passthrough), end, device)
            for v in ix.ins[n]:
                where = here if route(v, dev[v], device, ix) == "copy" else pool(dev[v])
                touch(storage_of(v, where, dev, ix.passthrough), end, device)
        elif isinstance(step, Send):
            end = copies[(step.value.id, step.dst)].end
            touch(storage_of(step.value, pool(step.src), dev, ix.passthrough), end, step.src)
            touch(("copy", step.value, pool(step.dst)), end, step.dst)
    kept = {("local", x) for x in plan.graph.inputs}
    for o, d in plan.outputs:
        if isinstance(o, Node) and o.tensor_metas and d is not None:
            kept.add(storage_of(o, pool(home_device(o.device) if o.device else d), dev,
                                ix.passthrough))
    events: dict[str, list[tuple[float, int]]] = {}
    for key, (where, t, nbytes) in born.items():
        if not nbytes:
            continue
        events.setdefault(where, []).append((t, nbytes))
        if key not in kept and not pinned_storage(where, devices.get(key, ())):
            events[where].append((touched.get(key, t), -nbytes))
    peaks: dict[str, int] = {}
    for where, evs in sorted(events.items()):
        live = best = 0
        for _, delta in sorted(evs):
            live += delta
            best = max(best, live)
        peaks[where] = best
    return peaks


EAGER_OVERLAP_GAIN = 0.05
"""A plan of eager's placement runs as its own program (side-stream copies, events) only when
the model predicts overlap to save at least this share of the serial time."""




def _eager_move(node: Node, placed: dict[Node, str], eager: dict[Node, str],
                users: list[Node]) -> bool:
    """A device move left in its input's pool whose every consumer reads its value where eager
    moved it: eager's move, done by the plan's copy."""
    return (is_pure_move(node) and pool(placed[node]) == pool(placed[node.args[0]])
            and bool(users) and all(pool(placed[u]) == pool(eager[node]) for u in users))


def runs_as_eager(plan: Any, cost: Any, devices: Sequence[str]) -> bool:
    """Whether a plan (with nothing fused or replayed as a CUDA graph) gains nothing from the
    executor, so that its graph should run as eager's sequence of ops
    (:class:`~autopar.runtime.SequentialRunner`): every op is placed where eager runs it, and
    the simulated plan overlaps less than ``EAGER_OVERLAP_GAIN`` of its serial time (a chain
    such as copy in, matmul, copy out). The executor's streams, events and staging would cost
    more than they save."""
    graph = plan.graph
    eager = place(graph, cost, policy="single", devices=devices).device
    placed, users = plan.placement.device, GraphIndex.of(graph).users
    if any(placed[n] != eager[n] and not _eager_move(n, placed, eager, users[n])
           for n in graph.ops):
        return False
    timeline = simulate(plan, cost)
    serial = sum(s.duration for s in timeline.spans)
    return timeline.makespan >= (1 - EAGER_OVERLAP_GAIN) * serial

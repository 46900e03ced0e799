"""Plan: a placement turned into one straight-line program per device.

Steps (frozen dataclasses of :mod:`autopar.schedule.steps`; a program is a list of them, run in
order by one worker)
- ``Run(node)``: run the op on this device's lane.
- ``Send(value, src, dst, stream, event)``: copy ``value`` from ``src`` to ``dst`` on a copy
  stream: ``h2d`` of the destination GPU (host to GPU), ``d2h`` of the source GPU (GPU to host),
  ``peer`` of the source GPU (GPU to GPU). Issued by the source's program; ``event`` fires when
  the copy has landed. A copy depends on its value's producer only: the runtime must order it
  after the producing Run by an event, not after everything issued before it on that device.
- ``Record(value, event)``: ``value`` is ready for another program without a copy (another CPU
  worker, which shares host memory; a value with no tensor; a host 0-dim tensor a GPU kernel
  takes as a scalar argument).
- ``Wait(event, value, src)``: block this program (for a GPU: its compute stream) until
  ``event``; placed right before the first Run that needs ``value`` here.
- ``Free(value, device)``: this program's last use of ``value`` is over.

Invariants (tests/test_plan.py checks them on random graphs)
- Programs are built from one global order: ops and copies sorted by their planned
  ``(start, end, seq)`` (see :mod:`autopar.schedule.place`), or, for a hand-made placement without
  times, :func:`autopar.schedule.place.merged_order` with each copy right after its value's
  producer. Every Wait's event comes from exactly one Send or Record in another program that is
  earlier in that global order, so no set of programs can wait on each other in a cycle.
- Events are numbered in that global order. Copies sharing a copy stream run in event order;
  within one program a Send is issued as early as that allows (right after its value's
  producer, or after the previous Send on its stream), so a Send never waits behind later ops.
- One Send per (value, memory pool): a copy into the host serves every CPU worker (its ``dst``
  is the first one that reads it; the others Wait on the same event).
- Frees: a value's last use in a program is followed by one Free, except graph inputs in their
  own pool, outputs where they are read, and values several programs hold in one pool (CPU
  workers) or read across pools (a host scalar taken by a GPU kernel): those are kept until
  the call returns.
- ``outputs[i]`` is ``(value, device)``: where the caller reads output ``i`` after every program
  has finished (the eager device, after a delivery Send); ``(constant, None)`` for constants.
"""

from __future__ import annotations

from typing import Any

from ..ir.graph import Node
from ..ir.routing import (
    GraphIndex,
    copy_stream,
    delivery_needed,
    gc_paused,
    home_device,
    index_of,
    pool,
    route,
)
from .place import Placement, Slot, merged_order, retime
from .steps import Free, Plan, Record, Run, Send, Step, Wait

__all__ = ["make_plan"]


# -- building -----------------------------------------------------------------------------
def make_plan(placement: Placement, cost: Any | None = None) -> Plan:
    """Turn ``placement`` into per-device programs.

    A placement from :func:`autopar.schedule.place.place` carries planned times, which fix the
    global order. A hand-made one without times is first timed under ``cost`` when given
    (:func:`autopar.schedule.place.retime`); without ``cost`` each copy follows its value's
    producer.
    """
    with gc_paused():
        if not placement.slots and cost is not None:
            placement = retime(placement, cost)
        ix = index_of(placement)
        builder = _Builder(placement, ix)
        for item in _sequence(placement, ix):
            if isinstance(item, Node):
                builder.run(item)
            else:
                builder.send(*item)
        return builder.finish()


def _needed_copies(placement: Placement, runs: list[Node],
                   ix: GraphIndex) -> dict[Node, list[str]]:
    """value -> destination devices of its copies, one per pool, first reader's device first."""
    dev = placement.device
    out: dict[Node, dict[str, str]] = {}
    for n in runs:
        d = dev[n]
        for v in ix.ins[n]:
            if route(v, dev[v], d, ix) == "copy":
                out.setdefault(v, {}).setdefault(pool(d), d)
    for o in placement.graph.output_nodes:
        home = home_device(o.device) if o.device else None
        if home is not None and delivery_needed(o, dev[o], home):
            out.setdefault(o, {}).setdefault(pool(home), home)
    return {v: list(by_pool.values()) for v, by_pool in out.items()}


def _sequence(placement: Placement, ix: GraphIndex) -> list[Node | tuple[Node, str]]:
    """The global order: ops (nodes) and copies ((value, dst)), see the module docstring."""
    if placement.slots:
        return _sequence_by_slots(placement, ix)
    runs = merged_order(placement)
    copies = _needed_copies(placement, runs, ix)
    seq: list[Node | tuple[Node, str]] = []
    for x in placement.graph.inputs:
        seq += [(x, d) for d in copies.get(x, ())]
    for n in runs:
        seq.append(n)
        seq += [(n, d) for d in copies.get(n, ())]
    return seq


def _sequence_by_slots(placement: Placement,
                       ix: GraphIndex) -> list[Node | tuple[Node, str]]:
    slots: dict[Any, Slot] = placement.slots
    seq = sorted(slots, key=slots.__getitem__)
    runs = [k for k in seq if isinstance(k, Node)]
    for device, ops in placement.order.items():
        if [n for n in runs if placement.device[n] == device] != list(ops):
            raise ValueError(f"placement of {placement.graph.name}: the order of {device} "
                             "disagrees with its planned times")
    planned = {(v, pool(d)) for k in seq if isinstance(k, tuple) for v, d in [k]}
    for v, dsts in _needed_copies(placement, runs, ix).items():
        for d in dsts:
            if (v, pool(d)) not in planned:
                raise ValueError(f"placement of {placement.graph.name} plans no copy of "
                                 f"{v!r} into {pool(d)}, which {d} needs")
    return seq


class _Builder:
    """Appends steps in global order.

    State: ``base[d]`` the program of ``d`` without its Sends; ``attached[d][i]`` the Sends
    issued right after ``base[d][i]`` (``-1``: before the first step); ``produced[n]`` the
    index of ``Run(n)`` in its program; ``copy_event[(v, pool)]`` and ``record_event[v]`` the
    events that make ``v`` available; ``waited[d]`` events program ``d`` has waited for.
    """

    def __init__(self, placement: Placement, ix: GraphIndex) -> None:
        self.placement = placement
        self.ix = ix
        self.dev = placement.device
        graph = placement.graph
        self.base: dict[str, list[Step]] = {}
        self.attached: dict[str, dict[int, list[Send]]] = {}
        self.lane_anchor: dict[tuple[str, str], int] = {}
        self.produced: dict[Node, int] = {}
        self.copy_event: dict[tuple[Node, str], int] = {}
        self.record_event: dict[Node, int] = {}
        self.waited: dict[str, set[int]] = {}
        self.n_events = 0
        self.needs_record = {
            v for n in graph.ops for v in ix.ins[n]
            if not v.is_input and route(v, self.dev[v], self.dev[n], ix) == "event"}
        for device in sorted(set(placement.order) | {self.dev[x] for x in graph.inputs}):
            self._program(device)

    def _program(self, device: str) -> list[Step]:
        if device not in self.base:
            self.base[device] = []
            self.attached[device] = {}
            self.waited[device] = set()
        return self.base[device]

    def _event(self) -> int:
        self.n_events += 1
        return self.n_events - 1

    def _wait(self, device: str, event: int, value: Node) -> None:
        if event not in self.waited[device]:
            self.waited[device].add(event)
            self.base[device].append(Wait(event, value, self.dev[value]))

    def run(self, node: Node) -> None:
        device = self.dev[node]
        program = self._program(device)
        for v in self.ix.ins[node]:
            how = route(v, self.dev[v], device, self.ix)
            if how == "copy":
                key = (v, pool(device))
                if key not in self.copy_event:
                    raise ValueError(f"{node!r} on {device} reads {v!r}, whose copy into "
                                     f"{pool(device)} is ordered after it")
                self._wait(device, self.copy_event[key], v)
            elif how == "event" and not v.is_input:
                if v not in self.record_event:
                    raise ValueError(f"{node!r} on {device} reads {v!r} before it is produced")
                self._wait(device, self.record_event[v], v)
        self.produced[node] = len(program)
        program.append(Run(node))
        if node in self.needs_record:
            self.record_event[node] = e = self._event()
            program.append(Record(node, e))

    def send(self, value: Node, dst: str) -> None:
        src = self.dev[value]
        self._program(src)
        _, stream = copy_stream(src, dst)
        event = self._event()
        step = Send(value, src, dst, stream, event)
        if not value.is_input and value not in self.produced:
            raise ValueError(f"copy of {value!r} to {dst} is ordered before its producer")
        # as early as the producer and the previous copy on the same lane allow
        anchor = max(self.produced.get(value, -1), self.lane_anchor.get((src, step.lane), -1))
        self.lane_anchor[(src, step.lane)] = anchor
        self.attached[src].setdefault(anchor, []).append(step)
        self.copy_event[(value, pool(dst))] = event

    def finish(self) -> Plan:
        programs = {d: self._flatten(d) for d in self.base}
        graph = self.placement.graph
        outputs = tuple(
            (o, home_device(o.device) if o.device else self.dev[o]) if isinstance(o, Node)
            else (o, None) for o in graph.outputs)
        recorded = set(self.record_event.values())
        _add_frees(programs, self.placement, outputs, recorded, self.ix)
        return Plan(graph, self.placement, programs, outputs, self.n_events)

    def _flatten(self, device: str) -> list[Step]:
        attached = self.attached[device]
        out: list[Step] = list(attached.get(-1, ()))
        for i, step in enumerate(self.base[device]):
            out.append(step)
            out += attached.get(i, ())
        return out


def _uses(step: Step, device: str, dev: dict[Node, str], recorded: set[int],
          ix: GraphIndex) -> list[tuple[Node, str]]:
    """(value, pool) pairs a step of ``device``'s program holds a reference to.

    A value made available by a Record stays in its producer's pool; one a Send brought is here.
    """
    here = pool(device)
    if isinstance(step, Run):
        n = step.node
        pairs = [(n, here)]
        for v in ix.ins[n]:
            local = route(v, dev[v], device, ix) in ("local", "copy")
            pairs.append((v, here if local else pool(dev[v])))
        return pairs
    if isinstance(step, Send | Record):
        return [(step.value, here)]
    if isinstance(step, Wait):
        return [(step.value, pool(step.src) if step.event in recorded else here)]
    return []


def _add_frees(programs: dict[str, list[Step]], placement: Placement,
               outputs: tuple[tuple[Any, str | None], ...], recorded: set[int],
               ix: GraphIndex) -> None:
    """Insert Free steps after last uses (see the module docstring for what is never freed)."""
    dev = placement.device
    kept = {(o, pool(d)) for o, d in outputs if isinstance(o, Node) and d is not None}
    kept |= {(x, pool(dev[x])) for x in placement.graph.inputs}
    holders: dict[tuple[Node, str], set[str]] = {}
    last: dict[str, dict[tuple[Node, str], int]] = {}
    for device, steps in programs.items():
        mine = last[device] = {}
        for i, step in enumerate(steps):
            for key in _uses(step, device, dev, recorded, ix):
                holders.setdefault(key, set()).add(device)
                mine[key] = i
    for device, steps in programs.items():
        after: dict[int, list[Node]] = {}
        for (value, where), i in last[device].items():
            if where != pool(device) or (value, where) in kept or len(holders[(value, where)]) > 1:
                continue
            after.setdefault(i, []).append(value)
        out: list[Step] = []
        for i, step in enumerate(steps):
            out.append(step)
            out += [Free(v, device) for v in sorted(after.get(i, ()), key=lambda n: n.id)]
        steps[:] = out

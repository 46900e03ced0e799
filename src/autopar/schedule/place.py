"""Placement: which device runs each op of a graph, and in what order.

A pure function ``place(graph, cost) -> Placement``: no CUDA, no threads, deterministic for the same
inputs. Every policy runs through one list scheduler (:class:`_Schedule`) that predicts when each
op and each copy happens; the policies differ only in the order ops are taken, how a device is
chosen, and whether an op may fill an idle gap (dispatch table ``_POLICIES``).

Policy ``heft`` (the default)
1. Rank. An op's upward rank is its mean time over the devices that can run it plus the largest
   ``mean transfer time of its value + rank`` over its consumers (for a graph output, at least
   the mean time of delivering it). Ops are taken in decreasing rank, ties in graph order: with
   non-negative costs that is a topological order. Views of graph inputs (a weight's ``t``)
   come first: they take no time and their value is ready at once, but a lane runs its items
   in order, so one taken after a long op on its lane would start (and its copy to another
   device leave) only when that op ends (ensemble4 planned 16.0 ms this way, 10.3 ms with views
   first: benchmarks/NOTES.md, d935b70). The ops that exist only to feed a collective (a
   gradient bucket's GEMMs, views and ``cat``) rank just below the ops they read, so that
   the collective overlaps the rest of backward (:func:`_hurry`).
2. Choose. For every device that may run the op: its inputs arrive (a value on the same device
   when it is produced; from another CPU worker after an ordering event; from elsewhere by a copy
   reserved in the earliest idle gap of that link's copy lane), then the op takes the earliest
   idle gap of the device's lane that fits (insertion; at most ``GAP_SEARCH`` gaps are looked
   at, then the op goes to the lane's end). A graph output's finish includes its delivery to
   the device eager produces it on. The op goes where it finishes soonest. Ties go, for tiny
   values (at most one element), to the host; else to the eager device; then to the machine's
   device order. Devices are tried in order of a lower bound (last input ready + op time), and
   those whose bound is past the best finish so far are skipped: same choice, fewer trials.
3. Constraints. Graph inputs stay on their eager device; views and ``getitem`` run with their
   base, an op that writes a tensor in place runs where that tensor lives, a host scalar
   (:func:`autopar.ir.routing.host_scalars`: a Python number, or a 0-dim tensor made from host
   values or from a value the host reads anyway) runs on the first CPU device allowed, a
   device move (``x.cpu()``, ``x.to("cuda")``) runs on its target, except under HEFT without
   ``pins`` when it is no graph output: then it is an op like others, and one left in its
   input's pool hands the input on where :attr:`GraphIndex.passthrough` allows (W3's
   ``(x.to("cuda") @ y.to("cuda")).cpu()`` runs on the host where the host is faster); an op
   the caller pins (``pins``: a graph transform's decision, e.g. a data-parallel shard, see
   :mod:`autopar.passes.shard`) runs there;
   other ops only where ``cost.can_run`` allows (random ops are pinned this way); under HEFT,
   never on the host when they read a value over ``HOST_PULL_BYTES`` that eager keeps on a GPU
   and a GPU may run them: the host's compute holds the thread that launches GPU work
   (Python's GIL), which the timing model doesn't see (benchmarks/NOTES.md, 25178e5). No
   memory pool ends up over its limit (see Memory); if no device has room for an op, a warning is
   logged on the ``autopar.placement`` logger and the placement falls back to ``single``.
4. Lookahead. HEFT is greedy: an op's device is the one where it finishes soonest, blind to
   what that commits its consumers to. On graphs small enough (``LOOKAHEAD_WORK``), the ops
   are also scheduled choosing by finish plus PEFT's optimistic cost table
   (:func:`_lookahead`: the least time the work an op feeds still takes from each device),
   and that schedule is kept when it is predicted to finish sooner.
5. Guard. When eager placement (``single``) is predicted to finish sooner, uses only allowed
   devices and fits in memory, it is kept, with a note saying so: HEFT is greedy, and never
   planning slower than eager matters more than purity. (Skipped when HEFT already beats a
   lower bound of eager: the busiest eager device's total work; and for a graph placed with
   ``pins``, whose eager placement is a graph transform's, not the user's: the data-parallel
   choice compares a split with the graph unsplit, and on GPT-2 small's and ResNet-50's
   splits over 2 to 8 GPUs ``single`` was 1.3-11 ms slower than HEFT every time, at half
   the placing time.)

Baselines: ``single`` puts every op where eager runs it (a node without tensor output goes with
its first input); ``round_robin`` deals free ops to devices in turn. Both keep graph order and
never fill gaps.

Timing model (what :mod:`autopar.schedule.simulate` replays exactly)
- Lanes: a CPU worker ``cpu:N`` runs one op at a time; a GPU has a compute lane
  ``cuda:N/compute`` and two copy lanes: ``d2h`` (this GPU to the host) and ``peer`` (this GPU
  to another); copies from the host to any GPU share the lane ``cpu/h2d`` (the issuing thread
  stages pageable host memory itself: see :mod:`autopar.ir.routing`). Ops take
  ``cost.node_time``; copies take :func:`copy_time` (the link, plus ``crossing_s`` between
  host and GPU); a device move whose
  input arrives by a copy costs nothing more (the copy *is* the move).
- No copy between CPU workers: they share host memory. A value without a tensor needs no copy
  either, nor does a host 0-dim tensor whose consumers are all binary arithmetic ops: a GPU
  kernel takes it as a scalar argument (see :class:`GraphIndex`).
- One copy per (value, memory pool), always from the device that produced the value.

Memory (per pool: ``"cpu"`` for the host, shared by CPU workers, and each ``"cuda:N"``)
- A storage is allocated when the op that writes it starts (a copy's, when the copy starts;
  graph inputs from time 0) and freed when the last step that touches it ends: ops reading it
  or any view of it, copies out of it. Graph inputs, outputs where they are delivered, host
  storages touched by more than one CPU worker and host scalars a GPU kernel reads are never
  freed during the run (:func:`pinned_storage`).
- Limits: the ``memory`` argument, else the machine profile's ``memory_bytes``. HEFT only
  chooses a device if the planned live bytes of every pool stay within its limit at all times.
  When all of the graph's values together fit in every pool, nothing is tracked.

Glossary of scheduler state (:class:`_Schedule`)
- ``device[n]``: the device of node ``n``; ``ready[n]``: when ``n``'s value is ready there.
- ``arrival[(v, pool)]``: when the copy of ``v`` into ``pool`` has landed.
- ``slots[n]``: planned ``Slot(start, end, seq)`` of op ``n``; ``slots[(v, dst)]`` of the copy of
  ``v`` to device ``dst``. ``seq`` numbers reservations, so sorting by ``(start, end, seq)`` gives
  one global order that is topological and matches every lane's order.
- ``lanes[name]``: a lane's idle gaps and the time its tail becomes free.
- ``storages[key]``: bytes, pool, allocation time, last touch, devices touching it;
  ``pending[owner]``: uses of an alias class not yet scheduled (a class closes, and its
  storages are freed, when this reaches zero).
"""

from __future__ import annotations

import heapq
import logging
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

from ..ir.collective import COMM, is_collective
from ..ir.graph import Graph, Node, op_name
from ..ir.routing import (
    GraphIndex,
    StorageKey,
    alias_base,
    compute_lane,
    copy_lane,
    copy_time,
    delivery_needed,
    free_move_on,
    gc_paused,
    handoff_time,
    hands_off,
    index_of,
    is_free_move,
    is_pure_move,
    is_tiny,
    kind_of,
    pinned_storage,
    pool,
    route,
    storage_of,
)
from ..ir.units import fmt_bytes, fmt_seconds
from ..machine.model import parse_devices

__all__ = ["POLICIES", "Placement", "Slot", "lower_bound", "memory_limits",
           "merged_order", "place", "places_by_cost", "retime"]

HOST_PULL_BYTES = 1 << 20
"""The host takes no op reading a value larger than this that eager keeps on a GPU."""

log = logging.getLogger("autopar.placement")

# -- the result ---------------------------------------------------------------------------
class Slot(NamedTuple):
    """Planned interval of one op or copy; ``seq`` orders reservations made at the same time.

    Slots compare as ``(start, end, seq)`` tuples: sorting by them gives the global order.
    """

    start: float
    end: float
    seq: int


@dataclass(frozen=True)
class Placement:
    """Where each node runs and in what order, with the scheduler's predicted times.

    ``device``: every node, inputs included, to a machine device name. ``order``: the op nodes
    of each device in execution order (a topological order; inputs excluded). ``notes``: a short
    reason per node. ``predicted_s``: when the last op or copy ends. ``slots``: planned times of
    ops (key: node) and copies (key: ``(value, dst device)``); empty for a hand-made placement.
    """

    graph: Graph
    device: dict[Node, str]
    order: dict[str, list[Node]]
    policy: str
    notes: dict[Node, str]
    predicted_s: float
    slots: dict[Any, Slot] = field(default_factory=dict)
    #: the graph's GraphIndex, as placing built it (None: a hand-made placement); read through
    #: :func:`index_of` by planning and simulation, so that one graph is indexed once
    index: GraphIndex | None = field(default=None, repr=False, compare=False)

    def copies(self) -> list[tuple[Node, str]]:
        """Planned copies ``(value, dst device)`` in planned start order."""
        keys = [k for k in self.slots if isinstance(k, tuple)]
        return sorted(keys, key=self.slots.__getitem__)

    def __str__(self) -> str:
        head = (f"placement {self.graph.name} ({self.policy}, predicted "
                f"{fmt_seconds(self.predicted_s)})")
        return head + "\n" + self.graph.format(
            annotate=lambda n: f"@ {self.device[n]}  ({self.notes.get(n, '')})")


# -- lanes --------------------------------------------------------------------------------
GAP_SEARCH = 32
"""Insertion looks at most this many idle gaps past an op's ready time, then appends: long
schedules collect many small gaps, and scanning them all makes placement quadratic."""


class _Tentative:
    """A trial's copies planned on one lane so far: ``[start, end)`` intervals, none straddling
    another (each was placed clear of the earlier ones; a zero-length one is a point that
    later ones may not straddle), sorted by start and so by end, and the latest end."""

    __slots__ = ("ends", "last_end", "starts")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.last_end = 0.0

    def add(self, start: float, end: float) -> None:
        i = bisect_right(self.starts, start)
        while i and self.starts[i - 1] == start and self.ends[i - 1] > end:
            i -= 1  # a point (a zero-length copy) before an interval starting there
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.last_end = max(self.last_end, end)


class _Lane:
    """Busy time of one lane: sorted disjoint idle gaps before ``tail``, when it is free for good.

    A zero-length reservation still splits its gap: later ops may not straddle it, so every
    planned start stays ``max(inputs ready, end of the previous item on the lane)``, which is
    what the simulator replays.
    """

    __slots__ = ("gap_ends", "gap_starts", "insertion", "tail", "widest")

    def __init__(self, insertion: bool) -> None:
        self.insertion = insertion
        self.gap_starts: list[float] = []
        self.gap_ends: list[float] = []
        self.tail = 0.0
        self.widest = 0.0  # >= the longest gap: a longer item skips the search

    def find(self, ready: float, dur: float, avoid: _Tentative | None = None) -> float:
        """Earliest start >= ``ready`` for ``dur`` seconds, clear of the ``avoid`` intervals
        (tentative reservations, which will be made first)."""
        if avoid is None or not avoid.starts:
            return self._fit(ready, dur)
        if not self.insertion:
            ready = max(ready, avoid.last_end)  # the lane keeps reservation order
        starts, ends = avoid.starts, avoid.ends
        while True:
            start = self._fit(ready, dur)
            end = start + dur
            # the intervals are disjoint and sorted: those that clash are one run of them
            first, stop = bisect_right(ends, start), bisect_left(starts, end)
            if first >= stop:
                return start
            ready = max(ends[first:stop])

    def _fit(self, ready: float, dur: float) -> float:
        if self.insertion and dur <= self.widest:
            gs, ge = self.gap_starts, self.gap_ends
            first = bisect_left(ge, ready)
            last = min(len(gs), first + GAP_SEARCH)
            widest = 0.0
            for j in range(first, last):
                start = ready if ready > gs[j] else gs[j]
                if start + dur <= ge[j]:
                    return start
                widest = max(widest, ge[j] - gs[j])
            if first == 0 and last == len(gs):
                self.widest = widest  # every gap was seen: the bound is now exact
        return ready if ready > self.tail else self.tail

    def reserve(self, start: float, dur: float) -> None:
        end = start + dur
        if start >= self.tail:
            if self.insertion and start > self.tail:
                self.gap_starts.append(self.tail)
                self.gap_ends.append(start)
                self.widest = max(self.widest, start - self.tail)
            self.tail = end
            return
        j = bisect_right(self.gap_starts, start) - 1
        gs, ge = self.gap_starts[j], self.gap_ends[j]
        if not (gs <= start and end <= ge):
            raise AssertionError(f"reservation [{start}, {end}) is not inside an idle gap")
        starts = [gs] if start > gs else []
        ends = [start] if start > gs else []
        if ge > end:
            starts.append(end)
            ends.append(ge)
        self.gap_starts[j:j + 1] = starts
        self.gap_ends[j:j + 1] = ends


# -- memory -------------------------------------------------------------------------------
class _Pools:
    """Planned live bytes of each pool over time, as (time, +/-bytes) events.

    Events are appended as they come and sorted only for an exact sweep (at equal times frees
    sort before allocations: a negative delta first). ``bound[pool]`` is an upper bound of the
    peak, kept cheaply, so that the sweep runs only when a pool gets near its limit.
    """

    def __init__(self, limits: dict[str, int | None]) -> None:
        self.limits = limits
        self.events: dict[str, list[tuple[float, int]]] = {}
        self.bound: dict[str, int] = {}

    def alloc(self, where: str, t: float, nbytes: int) -> None:
        if nbytes:
            self.events.setdefault(where, []).append((t, nbytes))
            self.bound[where] = self.bound.get(where, 0) + nbytes

    def free(self, where: str, t: float, nbytes: int) -> None:
        if nbytes:
            self.events.setdefault(where, []).append((t, -nbytes))

    def peak(self, where: str, extra: Iterable[tuple[float, int]] = ()) -> int:
        events = self.events.get(where, [])
        events.sort()  # nearly sorted already: cheap
        live = best = 0
        for _, delta in heapq.merge(events, sorted(extra)):
            live += delta
            best = max(best, live)
        return best

    def full(self, allocs: Iterable[tuple[str, float, int]]) -> list[tuple[str, int]]:
        """Pools that ``allocs`` (pool, time, bytes) would overflow, with the bytes they'd need."""
        new: dict[str, int] = {}
        for where, _, nbytes in allocs:
            if nbytes and self.limits.get(where) is not None:
                new[where] = new.get(where, 0) + nbytes
        over = []
        for where in sorted(new):
            limit = self.limits[where]
            assert limit is not None
            if self.bound.get(where, 0) + new[where] <= limit:
                continue
            self.bound[where] = self.peak(where)  # tighten the bound, then check exactly
            need = self.peak(where, [(t, b) for w, t, b in allocs if w == where and b])
            if need > limit:
                over.append((where, need))
        return over


@dataclass(slots=True)
class _Storage:
    where: str
    nbytes: int
    touched: float
    devices: set[str]
    keep: bool = False


# -- the scheduler ------------------------------------------------------------------------
class _Copy(NamedTuple):
    value: Node
    src: str
    dst: str
    lane: str
    start: float
    end: float
    delivery: bool


class _Trial(NamedTuple):
    device: str
    start: float
    end: float
    finish: float  # end, or when a graph output has reached its eager device
    copies: list[_Copy]
    allocs: list[tuple[str, float, int]]


def _shared_output_bases(graph: Graph, eager: dict[Node, str | None]) -> dict[Node, str]:
    """Storage owners that two graph outputs share (views of one base, or a base and its view),
    mapped to the outputs' eager device. Eager returns them sharing one storage; copied to that
    device one by one they would not, so the base runs there and its views with it."""
    groups: dict[Node, list[Node]] = {}
    for o in dict.fromkeys(graph.output_nodes):
        root = o
        while (base := alias_base(root)) is not None:
            root = base
        groups.setdefault(root, []).append(o)
    return {root: home for root, outs in groups.items()
            if len(outs) > 1 and not root.is_input and (home := eager[outs[0]]) is not None}


class _NoRoom(Exception):
    def __init__(self, node: Node, reasons: str) -> None:
        super().__init__(f"no device has room for {node!r} ({op_name(node.op)}): {reasons}")
        self.node = node


class _Schedule:
    """List scheduler shared by every policy (see the module docstring for the state).

    Memory is tracked only when some pool could fill up: when all values of the graph together
    fit in every pool's limit, no placement can overflow one, and the bookkeeping is skipped.
    """

    def __init__(self, graph: Graph, cost: Any, devices: Sequence[str], insertion: bool,
                 limits: dict[str, int | None], index: GraphIndex | None = None,
                 pins: Mapping[Node, str] | None = None, free_moves: bool = False,
                 like: _Schedule | None = None) -> None:
        self.graph = graph
        self.pins: Mapping[Node, str] = pins or {}
        self.cost = cost
        self.machine = cost.machine
        self.handoff = handoff_time(cost)
        self.devices = list(devices)
        self.insertion = insertion
        self.rank_of = {d.name: i for i, d in enumerate(self.machine.devices)}
        self.host = _host_of(self.devices)
        self.index = ix = index or GraphIndex.of(graph, host_allowed=self.host is not None)
        self.ins, self.users, self.nbytes = ix.ins, ix.users, ix.nbytes
        self.outputs = set(graph.output_nodes)
        self.moves = {n for n in graph.ops if is_pure_move(n)}
        self.free_moves = free_moves
        self.tiny = {n for n in graph.ops if is_tiny(n)}
        self.eager: dict[Node, str | None] = {n: self._home(n) for n in graph.nodes}
        self.shared_outputs = _shared_output_bases(graph, self.eager)
        self.device: dict[Node, str] = {}
        self.ready: dict[Node, float] = {}
        self.arrival: dict[tuple[Node, str], float] = {}
        self.slots: dict[Any, Slot] = {}
        self.notes: dict[Node, str] = {}
        self.lanes: dict[str, _Lane] = {}
        self._compute: dict[str, _Lane] = {}
        total = sum(ix.nbytes.values())  # a pool holds each value at most once
        self.track = any(limit is not None and limit < total for limit in limits.values())
        self.pools = _Pools(limits)
        self.storages: dict[StorageKey, _Storage] = {}
        self.owner: dict[Node, Node] = {}
        self.pending: dict[Node, int] = {}
        self.class_keys: dict[Node, list[StorageKey]] = {}
        self.seq = 0
        self.turn = 0  # round_robin: the device whose turn is next
        # the cost model's answers, shared with ``like`` (a schedule of the same graph, cost
        # and devices: another policy's, or the lookahead's) instead of asked again
        self._times: dict[tuple[Node, str], float] = like._times if like else {}
        self._transfers: dict[tuple[int, str, str], float] = like._transfers if like else {}
        self._candidates: dict[Node, list[str]] = like._candidates if like else {}
        self._prefs: dict[tuple[bool, str | None, str], tuple[int, int, int]] = (
            like._prefs if like else {})
        self.lookahead: dict[Node, dict[str, float]] | None = None  # see _lookahead
        for x in graph.inputs:
            self._place_input(x)

    # -- facts about nodes and devices ----------------------------------------------------
    def _home(self, node: Node) -> str | None:
        dev = node.device
        if dev is None:
            return None
        try:
            return self.machine.home(dev).name
        except KeyError:
            raise ValueError(
                f"{node!r} ({op_name(node.op)}) is on {dev}, which machine "
                f"{self.machine.name!r} does not have (devices: "
                f"{[d.name for d in self.machine.devices]})") from None

    def time(self, node: Node, device: str) -> float:
        """``cost.node_time``, asked once per (node, device)."""
        key = (node, device)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = float(self.cost.node_time(node, device))
        return t

    def transfer(self, nbytes: int, src: str, dst: str) -> float:
        if src == COMM or dst == COMM:  # a collective's part or item: an event, no copy
            return 0.0
        key = (nbytes, src, dst)
        t = self._transfers.get(key)
        if t is None:
            t = self._transfers[key] = copy_time(self.cost, nbytes, src, dst)
        return t

    def forced(self, node: Node) -> tuple[str, str] | None:
        """(device, reason) for an op that has no choice, else None."""
        base = alias_base(node)
        if base is not None:
            return self.device[base], f"{kind_of(node.op)} of {base!r}: stays with its base"
        if node.writes:
            target = node.writes[0]
            where = self.device[target]
            return where, f"writes {target!r} in place: runs where it lives"
        if node in self.index.host and self.host is not None:
            return self.host, self._host_reason(node)
        if node in self.moves and not self.move_is_free(node):
            home = self.eager[node]
            assert home is not None
            return home, f"device move to {home}"
        pin = self.pins.get(node)
        if pin is not None:
            return pin, f"pinned to {pin} by the caller"
        home = self.shared_outputs.get(node)
        if home is not None:
            return home, f"outputs share its storage: produced on their device {home}"
        return None

    def move_is_free(self, node: Node) -> bool:
        """May this device move go elsewhere than its target (see Constraints)?"""
        return self.free_moves and node not in self.outputs and node not in self.pins

    def _host_reason(self, node: Node) -> str:
        far = [v for v in self.ins[node]
               if v.tensor_metas and pool(self.device[v]) != pool(self.host or "cpu")]
        if far:
            reads = ", ".join(f"{v!r} from {self.device[v]}" for v in far)
            return f"host scalar: reads {reads} to the host once per call (one sync)"
        return "host scalar: a number or 0-dim tensor computed from host values"

    def candidates(self, node: Node) -> list[str]:
        cands = self._candidates.get(node)
        if cands is None and is_collective(node.op):
            cands = self._candidates[node] = [COMM]
        if cands is None:
            cands = [d for d in self.devices if self.cost.can_run(node, d)]
            if not cands:
                raise ValueError(
                    f"no device among {self.devices} can run {node!r} ({op_name(node.op)})")
            self._candidates[node] = cands
        return cands

    def preference(self, node: Node, device: str) -> tuple[int, int, int]:
        """Tie-break: the host for tiny values, then the eager device, then machine order."""
        key = (node in self.tiny, self.eager[node], device)
        pref = self._prefs.get(key)
        if pref is None:
            tiny, eager, _ = key
            host = 0 if tiny and device.startswith("cpu") else 1
            order = self.rank_of.get(device, len(self.rank_of))
            pref = self._prefs[key] = (host, 0 if device == eager else 1, order)
        return pref

    def lane(self, name: str) -> _Lane:
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = _Lane(self.insertion)
        return lane

    def compute(self, device: str) -> _Lane:
        """The lane of ``device``'s ops."""
        lane = self._compute.get(device)
        if lane is None:
            lane = self._compute[device] = self.lane(compute_lane(device))
        return lane

    def run_time(self, node: Node, device: str) -> float:
        """Seconds ``node`` would occupy ``device``'s lane (0 for a free device move)."""
        return 0.0 if self._moved(node, device) else self.time(node, device)

    def _moved(self, node: Node, device: str) -> bool:
        """Would ``node`` on ``device`` be a free device move (:func:`is_free_move`)?"""
        return node in self.moves and free_move_on(node, device, self.device,
                                                   self.index.passthrough)

    # -- trying a device --------------------------------------------------------------------
    def _plan_copy(self, value: Node, src: str, dst: str, ready: float, copies: list[_Copy],
                   tentative: dict[str, _Tentative], delivery: bool = False) -> _Copy:
        lane = copy_lane(src, dst)
        dur = self.transfer(self.nbytes[value], src, dst)
        avoid = tentative.get(lane)
        start = self.lane(lane).find(ready, dur, avoid)
        c = _Copy(value, src, dst, lane, start, start + dur, delivery)
        copies.append(c)
        if avoid is None:
            avoid = tentative[lane] = _Tentative()
        avoid.add(c.start, c.end)
        return c

    def trial(self, node: Node, device: str, dur: float | None = None) -> _Trial:
        """Where and when ``node`` would run on ``device`` (``dur``: its run time, if known)."""
        copies: list[_Copy] = []
        tentative: dict[str, _Tentative] = {}  # lane -> the copies above planned on it
        data_ready = 0.0
        where = pool(device)
        ix, device_of, ready = self.index, self.device, self.ready
        for v in self.ins[node]:
            src = device_of[v]
            if src == device:
                t = ready[v]
            elif route(v, src, device, ix) == "event":
                # another worker's thread must wake this one
                t = ready[v] + (self.handoff if hands_off(src, device) else 0.0)
            else:
                t = self.arrival.get((v, where))  # type: ignore[assignment]
                if t is None:
                    t = self._plan_copy(v, src, device, ready[v], copies, tentative).end
            if t > data_ready:
                data_ready = t
        moved = self._moved(node, device)
        if dur is None:
            dur = self.run_time(node, device)
        start = self.compute(device).find(data_ready, dur)
        end = finish = start + dur
        if node in self.outputs:
            home = self.eager[node]
            if home is not None and delivery_needed(node, device, home):
                finish = max(finish, self._plan_copy(node, device, home, end, copies,
                                                     tentative, True).end)
        allocs: list[tuple[str, float, int]] = []
        if self.track:
            allocs = [(pool(c.dst), c.start, self.nbytes[c.value]) for c in copies]
            if alias_base(node) is None and not moved:
                allocs.append((where, start, node.out_bytes))
        return _Trial(device, start, end, finish, copies, allocs)

    def full(self, trial: _Trial) -> list[tuple[str, int]]:
        """Pools the trial would overflow (see :meth:`_Pools.full`)."""
        return self.pools.full(trial.allocs) if trial.allocs else []

    # -- committing a choice ----------------------------------------------------------------
    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def commit(self, node: Node, trial: _Trial, note: str) -> None:
        device = trial.device
        for c in trial.copies:
            if not c.delivery:
                self._commit_copy(c)
        self.device[node] = device
        self.ready[node] = trial.end
        self.compute(device).reserve(trial.start, trial.end - trial.start)
        self.slots[node] = Slot(trial.start, trial.end, self._next_seq())
        self.notes[node] = note
        if self.track:
            self._account_run(node, trial)
        for c in trial.copies:
            if c.delivery:
                self._commit_copy(c)
        if self.track:
            self._release_inputs(node)

    def _commit_copy(self, c: _Copy) -> None:
        self.lane(c.lane).reserve(c.start, c.end - c.start)
        dst_pool = pool(c.dst)
        self.arrival[(c.value, dst_pool)] = c.end
        self.slots[(c.value, c.dst)] = Slot(c.start, c.end, self._next_seq())
        if self.track:
            self._touch(storage_of(c.value, pool(c.src), self.device, self.index.passthrough),
                        c.end, c.src)
            self._new_storage(("copy", c.value, dst_pool), self.owner[c.value], dst_pool,
                              c.start, self.nbytes[c.value], c.dst, keep=c.delivery)
            self._touch(("copy", c.value, dst_pool), c.end, c.dst)

    # -- memory bookkeeping (only when self.track) ------------------------------------------
    def _touch(self, key: StorageKey, t: float, device: str) -> None:
        s = self.storages.get(key)
        if s is not None:
            s.touched = max(s.touched, t)
            s.devices.add(device)

    def _new_storage(self, key: StorageKey, owner: Node, where: str, t: float, nbytes: int,
                     device: str, keep: bool = False) -> None:
        self.storages[key] = _Storage(where, nbytes, t, {device}, keep)
        self.class_keys.setdefault(owner, []).append(key)
        self.pools.alloc(where, t, nbytes)

    def _place_input(self, x: Node) -> None:
        device = self.eager[x] or "cpu:0"
        self.device[x] = device
        self.ready[x] = 0.0
        self.notes[x] = f"input stays on {device}"
        self.owner[x] = x
        self.pending[x] = len(self.users[x])
        if self.track:
            self._new_storage(("local", x), x, pool(device), 0.0, self.nbytes[x], device,
                              keep=True)

    def _account_run(self, node: Node, trial: _Trial) -> None:
        device, where = trial.device, pool(trial.device)
        handed = self.index.passthrough
        base = alias_base(node)
        if base is not None:
            self.owner[node] = self.owner[base]
        elif is_free_move(node, self.device, handed):
            self.owner[node] = self.owner[node.args[0]]
        else:
            self.owner[node] = node
            self._new_storage(("local", node), node, where, trial.start, node.out_bytes, device)
        self._touch(storage_of(node, where, self.device, handed), trial.end, device)
        for v in self.ins[node]:
            src = self.device[v]
            in_pool = where if route(v, src, device, self.index) == "copy" else pool(src)
            self._touch(storage_of(v, in_pool, self.device, handed), trial.end, device)
        home = self.eager[node]
        if node in self.outputs and home is not None and node.tensor_metas:
            key = storage_of(node, pool(home), self.device, handed)
            if key in self.storages:
                self.storages[key].keep = True
        owner = self.owner[node]
        self.pending[owner] = self.pending.get(owner, 0) + len(self.users[node])

    def _release_inputs(self, node: Node) -> None:
        ins = self.ins[node]
        owners = [self.owner[v] for v in ins] + [self.owner[node]]
        for v in ins:
            self.pending[self.owner[v]] -= 1
        for owner in dict.fromkeys(owners):
            if self.pending[owner] == 0:
                self._close(owner)

    def _close(self, owner: Node) -> None:
        """Every use of this alias class is scheduled: free its storages when last touched."""
        for key in self.class_keys.pop(owner, ()):
            s = self.storages[key]
            if not (s.keep or pinned_storage(s.where, s.devices)):
                self.pools.free(s.where, s.touched, s.nbytes)

    # -- results ----------------------------------------------------------------------------
    def makespan(self) -> float:
        return max((s.end for s in self.slots.values()), default=0.0)

    def placement(self, policy: str) -> Placement:
        order: dict[str, list[Node]] = {}
        runs = sorted((n for n in self.slots if isinstance(n, Node)),
                      key=self.slots.__getitem__)
        for n in runs:
            order.setdefault(self.device[n], []).append(n)
        device = {n: self.device[n] for n in self.graph.nodes}
        notes = {n: self.notes.get(n, "") for n in self.graph.nodes}
        for n in self.index.passthrough:
            if pool(device[n]) == pool(device[n.args[0]]):
                notes[n] = f"hands {n.args[0]!r} on, no copy; {notes[n]}"
        return Placement(self.graph, device, order, policy, notes, self.makespan(),
                         dict(self.slots), self.index)

    def allowed(self, devices: Sequence[str]) -> bool:
        """Does every free op (not a view, writer or move) sit on one of ``devices`` that can
        run it? (``single`` does not ask: eager does not.)"""
        names = set(devices)
        for n, d in self.device.items():
            if n.is_input or self.forced(n) is not None:
                continue
            if d not in names or not self.cost.can_run(n, d):
                return False
        return True

    def peaks(self) -> dict[str, int]:
        return {where: self.pools.peak(where) for where in sorted(self.pools.events)}

    def fits(self) -> bool:
        limits = self.pools.limits
        return all(limits.get(w) is None or p <= limits[w]  # type: ignore[operator]
                   for w, p in self.peaks().items())




# -- policies -----------------------------------------------------------------------------
def _graph_order(sched: _Schedule) -> list[Node]:
    return sched.graph.ops


def _rank_order(sched: _Schedule) -> list[Node]:
    """Ops by decreasing upward rank (mean costs; a pinned op's on its device), ties in graph
    order."""
    devices = sched.devices
    pairs = [(a, b) for a in devices for b in devices if a != b]
    mean_comm: dict[int, float] = {}

    def comm(node: Node) -> float:
        nbytes = sched.nbytes[node]
        c = mean_comm.get(nbytes)
        if c is None:
            c = mean_comm[nbytes] = (
                sum(0.0 if pool(a) == pool(b) else sched.transfer(nbytes, a, b)
                    for a, b in pairs) / len(pairs) if pairs and nbytes else 0.0)
        return c

    rank: dict[Node, float] = {}
    for n in reversed(sched.graph.nodes):
        if n.is_input:
            continue
        if alias_base(n) is not None or n.writes or is_pure_move(n):
            w = 0.0  # no choice to make: their place and time follow their base
        elif n in sched.pins:  # (a split step's ops: all but a few; no mean to take)
            w = sched.time(n, sched.pins[n])
        else:
            cands = sched.candidates(n)
            w = sum(sched.time(n, d) for d in cands) / len(cands)
        tail = comm(n) if n in sched.outputs else 0.0
        users = sched.users[n]
        if users:
            c = comm(n)
            tail = max(tail, max(c + rank[u] for u in users))
        rank[n] = math.inf if _views_an_input(n) else w + tail
    for n in sched.graph.ops:
        if is_collective(n.op):
            for part in n.inputs:
                _hurry(part, rank, sched)
    return sorted(rank, key=lambda n: (-rank[n], n.id))


def _hurry(part: Node, rank: dict[Node, float], sched: _Schedule) -> None:
    """Rank a collective's part, and every op that exists only to make it (a bucket's
    ``cat``, the flattening views, the weight-gradient GEMMs), just below the ops whose
    values they read: each is taken as soon as it can run, so a bucket's collective starts
    while backward goes on, as autograd and DDP's buckets order it. By upward rank alone
    those ops waited for the lane's whole backward (the update they feed comes last): GPT-2
    small's step over 8 GPUs on ``h200x8`` ran 14 of its 17 all-reduces after its last
    activation-gradient GEMM."""
    feeds = {part}
    todo = [(-x.id, x) for x in sched.ins[part] if not x.is_input]
    heapq.heapify(todo)
    while todo:  # latest first: a value joins once every reader of it has
        _, x = heapq.heappop(todo)
        if x in feeds or not all(u in feeds for u in sched.users[x]):
            continue
        feeds.add(x)
        for i in sched.ins[x]:
            if not i.is_input and i not in feeds:
                heapq.heappush(todo, (-i.id, i))
    for x in sorted(feeds, key=lambda x: x.id):
        top = min((rank[i] for i in sched.ins[x] if not i.is_input), default=math.inf)
        if top != math.inf:
            rank[x] = max(rank[x], top * (1 - 1e-9))


def _views_an_input(node: Node) -> bool:
    """A view (of a view...) of a graph input: ready at time 0, so HEFT takes it first."""
    base = alias_base(node)
    while base is not None and not base.is_input:
        base = alias_base(base)
    return base is not None


def _gravity(sched: _Schedule, node: Node, cands: list[str]) -> tuple[list[str], str | None]:
    """``cands`` without the host's devices when ``node`` reads a value over
    ``HOST_PULL_BYTES`` that eager keeps on a GPU and a GPU can run it (see the module
    docstring, Constraints), with the reason; else ``cands`` and None."""
    gpus = [d for d in cands if pool(d) != "cpu"]
    if not gpus or len(gpus) == len(cands):
        return cands, None
    for v in sched.ins[node]:
        size = sched.nbytes[v]
        if size > HOST_PULL_BYTES and pool(sched.eager[v] or "cpu") != "cpu":
            return gpus, f"off the host: reads {v!r} ({fmt_bytes(size)}) from {sched.eager[v]}"
    return cands, None


def _choose_heft(sched: _Schedule, node: Node) -> tuple[_Trial, str]:
    forced = sched.forced(node)
    if forced is not None:
        device, why = forced
        t = sched.trial(node, device)
        over = sched.full(t)
        if over:
            raise _NoRoom(node, _room(over))
        return t, f"pinned: {why}"
    cands, kept_off = _gravity(sched, node, sched.candidates(node))
    if len(cands) == 1:
        t = sched.trial(node, cands[0])
        over = sched.full(t)
        if over:
            raise _NoRoom(node, _room(over))
        why = "random op" if kind_of(node.op) == "random" else f"only {t.device} can run it"
        return t, kept_off or f"pinned: {why}"
    # A device cannot finish before its last input is ready plus the op's time: visiting them
    # by that bound, the rest can be skipped once one finishes sooner (same choice, less work).
    # With a lookahead, each device's score adds the least time the op's consumers still take.
    ahead = sched.lookahead[node] if sched.lookahead is not None else None

    def score(t: _Trial) -> float:
        return t.finish + (ahead[t.device] if ahead is not None else 0.0)

    ready = max((sched.ready[v] for v in sched.ins[node]), default=0.0)
    runs = {d: sched.run_time(node, d) for d in cands}
    bounds = sorted((ready + runs[d] + (ahead[d] if ahead is not None else 0.0),
                     sched.preference(node, d), d) for d in cands)
    best: _Trial | None = None
    tried: list[_Trial] = []
    full: list[tuple[str, int]] = []
    for i, (bound, _, d) in enumerate(bounds):
        if best is not None and bound > score(best):
            bounds = bounds[i:]
            break
        t = sched.trial(node, d, runs[d])
        tried.append(t)
        over = sched.full(t)
        if over:
            full += over
        elif best is None or (score(t), sched.preference(node, d)) < (
                score(best), sched.preference(node, best.device)):
            best = t
    else:
        bounds = []
    if best is None:
        raise _NoRoom(node, _room(full))
    others = [(score(t), t.device, "") for t in tried if t is not best]
    others += [(bound, d, "≥ ") for bound, _, d in bounds]
    finish, other, at_least = min(others)
    what = "fastest finish" if ahead is None else "fastest finish with what follows"
    note = (f"{what}: {best.device} {fmt_seconds(score(best))} vs {other} "
            f"{at_least}{fmt_seconds(finish)}")
    if full:
        note += f"; no room: {_room(full)}"
    return best, note


def _room(over: list[tuple[str, int]]) -> str:
    return ", ".join(f"{where} would need {fmt_bytes(need)}" for where, need in over)


def _choose_single(sched: _Schedule, node: Node) -> tuple[_Trial, str]:
    forced = sched.forced(node)
    if forced is not None and (alias_base(node) is not None or node in sched.pins):
        return sched.trial(node, forced[0]), f"pinned: {forced[1]}"
    device = sched.eager[node]
    if device is None:
        ins = sched.ins[node]
        device = sched.device[ins[0]] if ins else "cpu:0"
    return sched.trial(node, device), "eager device"


def _choose_round_robin(sched: _Schedule, node: Node) -> tuple[_Trial, str]:
    forced = sched.forced(node)
    if forced is not None:
        return sched.trial(node, forced[0]), f"pinned: {forced[1]}"
    cands = sched.candidates(node)
    n = len(sched.devices)
    for k in range(n):
        device = sched.devices[(sched.turn + k) % n]
        if device in cands:
            sched.turn = (sched.turn + k + 1) % n
            return sched.trial(node, device), "round robin"
    raise AssertionError("candidates() never returns an empty list")


@dataclass(frozen=True)
class _Policy:
    order: Callable[[_Schedule], list[Node]]
    choose: Callable[[_Schedule, Node], tuple[_Trial, str]]
    insertion: bool
    by_cost: bool  # chooses each op's device by predicted time (what fusion's choice revisits)


_POLICIES: dict[str, _Policy] = {
    "heft": _Policy(_rank_order, _choose_heft, insertion=True, by_cost=True),
    "single": _Policy(_graph_order, _choose_single, insertion=False, by_cost=False),
    "round_robin": _Policy(_graph_order, _choose_round_robin, insertion=False, by_cost=False),
}
POLICIES = tuple(_POLICIES)


def places_by_cost(policy: str) -> bool:
    """Whether ``policy`` chooses each op's device by predicted time, one op at a time (HEFT):
    such a placement is worth revisiting once fusion changes what ops cost
    (:func:`autopar.passes.fusion.prefer_fused`)."""
    return _POLICIES[policy].by_cost


def memory_limits(cost: Any, memory: dict[str, int] | None = None) -> dict[str, int | None]:
    """Memory limit of each pool: the override, else the machine profile's ``memory_bytes``."""
    machine = cost.machine
    out: dict[str, int | None] = {}
    for d in machine.devices:
        where = pool(d.name)
        if memory is not None:
            out[where] = memory.get(where)
            continue
        profile = getattr(machine, "profile", None)
        try:
            out[where] = int(profile.device(d.name).memory_bytes)  # type: ignore[union-attr]
        except (AttributeError, KeyError):
            out[where] = None
    return out


def _eager_floor(sched: _Schedule) -> float:
    """A lower bound of the ``single`` schedule's makespan: the busiest eager device's work
    (views and device moves left out, which only lowers it)."""
    work: dict[str, float] = {}
    for n in sched.graph.ops:
        d = sched.eager[n]
        if d is not None and n not in sched.moves and alias_base(n) is None \
                and not is_collective(n.op):
            work[d] = work.get(d, 0.0) + sched.time(n, d)
    return max(work.values(), default=0.0)


LOOKAHEAD_WORK = 50_000
"""HEFT also plans with a lookahead (:func:`_lookahead`) while ops x devices^2 is at most this:
the table costs that many steps of Python, and the ops are scheduled twice (1,000 ops on 4
devices, 16,000: place 0.13 s on the 2-core VM; 10,000 ops, greedy only: 0.93 s, the goal 1 s)."""


def _runs_where(sched: _Schedule, user: Node, value: Node) -> list[str] | None:
    """Where ``user`` of ``value`` may run, as far as the lookahead tells: None for "where
    ``value`` is" (a view of it, or an op writing it in place), else a list of devices. The
    constraints of :meth:`_Schedule.forced`, asked before any op is placed (``forced`` reads
    where a view's base was put, and words its reasons from where inputs are)."""
    if alias_base(user) is value or (user.writes and user.writes[0] is value):
        return None
    if user in sched.index.host and sched.host is not None:
        return [sched.host]
    if user in sched.moves and not sched.move_is_free(user):
        return [sched.eager[user] or sched.devices[0]]
    fixed = sched.pins.get(user) or sched.shared_outputs.get(user)
    return [fixed] if fixed is not None else sched.candidates(user)


def _lookahead(sched: _Schedule) -> dict[Node, dict[str, float]]:
    """PEFT's optimistic cost table (Arabnejad and Barbosa, 2014): for each op and device, the
    least time the work the op feeds still takes once it ends there. For each consumer, the
    cheapest device for it (the copy of the op's value there, unless it shares the pool; the
    consumer's time there, none for a device move; and the consumer's own entry), and the
    largest of those over the consumers. Choosing by finish plus this entry sees what a choice
    commits the rest to: a chain of host ops with a 4x larger result to copy later, against
    copying the small input now (greedy HEFT kept cpu_preprocess at eager's 30 ms instead of
    2 ms on one 2xH200 instance: benchmarks/NOTES.md, c7eb644)."""
    devices = sched.devices
    table: dict[Node, dict[str, float]] = {}
    for n in reversed(sched.graph.ops):
        row = dict.fromkeys(devices, 0.0)
        nbytes = sched.nbytes[n]
        for u in sched.users[n]:
            after = table.get(u)
            if after is None:
                continue
            where = _runs_where(sched, u, n)
            free = u in sched.moves
            for p in devices:
                options = (p,) if where is None else where
                least = math.inf
                for q in options:
                    t = after.get(q, 0.0) + (0.0 if free else sched.time(u, q))
                    if pool(q) != pool(p):
                        t += sched.transfer(nbytes, p, q)
                    least = min(least, t)
                row[p] = max(row[p], least)
        table[n] = row
    return table


def _run(graph: Graph, cost: Any, policy: str, devices: Sequence[str],
         limits: dict[str, int | None], index: GraphIndex,
         pins: Mapping[Node, str] | None = None, lookahead: bool = False,
         like: _Schedule | None = None) -> _Schedule:
    p = _POLICIES[policy]
    free_moves = policy == "heft" and not pins
    sched = _Schedule(graph, cost, devices, p.insertion, limits, index, pins, free_moves, like)
    if lookahead:
        sched.lookahead = _lookahead(sched)
    for node in p.order(sched):
        trial, note = p.choose(sched, node)
        sched.commit(node, trial, note)
    return sched


def place(graph: Graph, cost: Any, policy: str = "heft", devices: Sequence[str] | None = None,
          memory: dict[str, int] | None = None,
          pins: Mapping[Node, str] | None = None) -> Placement:
    """Place every op of ``graph`` on a device of ``cost.machine`` (see the module docstring).

    ``devices`` restricts the devices ops may be placed on (inputs stay where they are);
    ``memory`` overrides each pool's limit in bytes (keys ``"cpu"``, ``"cuda:N"``); ``pins``
    fixes the device of some ops (every policy obeys it).
    """
    if policy not in _POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; valid policies: "
                         f"{', '.join(_POLICIES)}")
    names = [d.name for d in cost.machine.devices]
    chosen = list(names) if devices is None else \
        list(parse_devices(devices, len(cost.machine.gpus), f"machine {cost.machine.name}"))
    unknown = [d for d in chosen if d not in names]
    if unknown or not chosen:
        raise ValueError(f"devices {chosen} must be a non-empty subset of the devices of "
                         f"machine {cost.machine.name} ({', '.join(names)})")
    stray = sorted({d for d in (pins or {}).values() if d not in names and d != COMM})
    if stray:
        raise ValueError(f"pins name devices {stray} that machine {cost.machine.name!r} "
                         f"does not have (devices: {names})")
    with gc_paused():
        return _place(graph, cost, policy, chosen, memory_limits(cost, memory), pins)


def _host_of(devices: Iterable[str]) -> str | None:
    """The host device among ``devices`` (the first CPU worker), which runs host scalars."""
    return next((d for d in devices if d.startswith("cpu")), None)


def _place(graph: Graph, cost: Any, policy: str, chosen: list[str],
           limits: dict[str, int | None], pins: Mapping[Node, str] | None = None) -> Placement:
    index = GraphIndex.of(graph, host_allowed=_host_of(chosen) is not None)
    if policy != "heft":
        return _run(graph, cost, policy, chosen, limits, index, pins).placement(policy)
    try:
        heft = _run(graph, cost, "heft", chosen, limits, index, pins)
    except _NoRoom as e:
        log.warning("autopar: %s; falling back to the 'single' policy (eager placement)", e)
        return _run(graph, cost, "single", chosen, limits, index, pins).placement("single")
    if len(graph.ops) * len(chosen) ** 2 <= LOOKAHEAD_WORK:
        try:
            ahead = _run(graph, cost, "heft", chosen, limits, index, pins, lookahead=True,
                         like=heft)
        except _NoRoom:
            pass
        else:
            if ahead.makespan() < heft.makespan():
                heft = ahead
    if pins or heft.makespan() <= _eager_floor(heft):
        return heft.placement("heft")  # eager cannot finish sooner: no need to schedule it
    eager = _run(graph, cost, "single", chosen, limits, index, pins, like=heft)
    if eager.makespan() < heft.makespan() and eager.allowed(chosen) and eager.fits():
        kept = eager.placement("heft")
        why = (f"eager placement kept: predicted {fmt_seconds(eager.makespan())} vs HEFT's "
               f"{fmt_seconds(heft.makespan())}")
        notes = {n: (why if not n.is_input else kept.notes[n]) for n in graph.nodes}
        return Placement(graph, kept.device, kept.order, "heft", notes, kept.predicted_s,
                         kept.slots, kept.index)
    return heft.placement("heft")


def merged_order(placement: Placement) -> list[Node]:
    """One topological order of all ops that keeps each device's order (ties: graph order).

    Raises ValueError when the device orders contradict the graph (an op listed before one of
    its inputs, directly or through another device).
    """
    graph = placement.graph
    listed = [n for ops in placement.order.values() for n in ops]
    if sorted(n.id for n in listed) != [n.id for n in graph.ops]:
        raise ValueError(f"placement of {graph.name} must list every op exactly once in order")
    after: dict[Node, Node] = {}  # op -> the next op on its device
    need: dict[Node, int] = {}
    for ops in placement.order.values():
        for a, b in pairwise(ops):
            after[a] = b
        if ops:
            need[ops[0]] = 0
        for b in ops[1:]:
            need[b] = 1
    ix = index_of(placement)
    ins, users = ix.ins, ix.users
    for n in graph.ops:
        need[n] += sum(1 for i in ins[n] if not i.is_input)
    heap = [n.id for n in graph.ops if need[n] == 0]
    heapq.heapify(heap)
    out: list[Node] = []
    while heap:
        n = graph.nodes[heapq.heappop(heap)]
        out.append(n)
        for u in [*users[n], *([after[n]] if n in after else [])]:
            need[u] -= 1
            if need[u] == 0:
                heapq.heappush(heap, u.id)
    if len(out) < len(listed):
        done = set(out)
        stuck = min((n for n in graph.ops if need[n] > 0), key=lambda n: n.id)
        before = [a for a, b in after.items() if b is stuck and a not in done]
        blockers = before + [i for i in ins[stuck] if not i.is_input and i not in done]
        raise ValueError(f"placement order of {graph.name} cannot run: {stuck!r} on "
                         f"{placement.device[stuck]} waits for {blockers}, which wait for it")
    return out


def retime(placement: Placement, cost: Any, memory: dict[str, int] | None = None) -> Placement:
    """The same devices and orders, with times planned under ``cost`` (for hand-made placements).

    Ops are taken in :func:`merged_order`; no gaps are filled, so each device keeps its order.
    """
    names = [d.name for d in cost.machine.devices]
    sched = _Schedule(placement.graph, cost, names, insertion=False,
                      limits=memory_limits(cost, memory))
    for node in merged_order(placement):
        device = placement.device[node]
        sched.commit(node, sched.trial(node, device), placement.notes.get(node, ""))
    return sched.placement(placement.policy)


def lower_bound(graph: Graph, cost: Any) -> float:
    """No schedule on the machine can finish sooner: max(critical path, total work / devices).

    Both take each op's fastest time on any device of the machine and ignore transfers; a device
    move counts as free (its copy may be all it costs).
    """
    names = [d.name for d in cost.machine.devices]
    fastest: dict[Node, float] = {}
    path: dict[Node, float] = {}
    ins = GraphIndex.of(graph).ins
    for n in graph.nodes:
        if n.is_input:
            path[n] = 0.0
            continue
        fastest[n] = 0.0 if is_pure_move(n) else min(float(cost.node_time(n, d)) for d in names)
        path[n] = fastest[n] + max((path[i] for i in ins[n]), default=0.0)
    work = math.fsum(fastest.values())
    return max(max(path.values(), default=0.0), work / len(names))

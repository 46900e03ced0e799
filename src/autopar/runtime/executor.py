"""The executor: runs a Plan's per-device programs at once, ordered only by events.

Policy
- The calling thread runs the host's program and every GPU's, merged into one
  (:mod:`autopar.runtime.interleave`); other CPU workers' programs (and every program, where
  no merged order exists) go to persistent daemon threads, one per device, kept across calls.
- A GPU's compute stream is the caller's current stream on that device, so inputs and outputs
  need no cross-stream bookkeeping with the user's own code. Copies run on per-device side
  streams: ``h2d`` and ``d2h`` on the GPU that owns the transfer, ``peer`` on the source GPU and
  ``peer_in`` on the destination (both of a cross-GPU copy's current streams are dedicated, so
  the copy never queues behind unrelated compute: see ``copy_``'s two-way barrier). Copies
  between the host and a GPU of at most ``SMALL_COPY_BYTES`` go on the GPU's compute stream
  instead, in program order (untraced calls). CUDA events are made once per executor and
  re-recorded each call (:class:`_EventPool`).
- Every cross-program dependency is an event: a ``threading.Event`` says "the producer has issued
  it", and for GPU data a ``torch.cuda.Event`` orders the consuming stream (``wait_event``: no
  host sync). The host blocks only where a CPU worker consumes GPU data, on that copy's event.
- Memory across streams: a tensor read by a copy stream is ``record_stream``-ed on it; a tensor
  a copy stream allocated is ``record_stream``-ed on the compute stream that consumes it. An
  output a copy delivered to a GPU is ordered before the caller's later work the same way
  (``wait_event`` on the caller's stream, no host sync).
  Host-bound copies land in pinned memory from PyTorch's caching host allocator (bounded reuse,
  guarded by the events it records), and are synchronized before the call returns. GPU-bound
  copies of host values are staged in pinned memory first up to ``SMALL_COPY_BYTES`` (queued
  on the compute stream, so the driver's pageable path can't hold the thread behind it) and
  from ``STAGE_MIN_BYTES`` up (the thread goes on while the DMA runs); those in between go to
  the driver as they are, on a side stream.
- Under ``torch.profiler``, each call is a range ``autopar:<graph>``, each device's program
  ``autopar:<graph>:<device>`` on the thread that ran it, each copy ``autopar:copy <value>
  -> <device>``. Whether the profiler is on is read once per call (a Python global, as
  aot_autograd reads it: a few nanoseconds). A CPU worker's ranges, like its ATen ops, are
  recorded where the profiler records every thread (``profile_all_threads``).
- Failures: the first exception in any worker stops the run: every waiter is woken and cancelled,
  and the original error is re-raised, annotated with the op and the user's source line. Waits are
  bounded (``AUTOPAR_WAIT_TIMEOUT`` seconds, default 600) and say what they waited for.

Glossary of per-call state (:class:`_Call`): ``env`` the value slots; ``ready[e]`` the host flag
of event ``e``; ``cuda_events[e]`` its CUDA event when a GPU copy produced it; ``failed`` the first
error; ``pending_host`` the copies to the host that must complete before returning.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..ir.collective import COMM, all_reduce, inline
from ..ir.graph import Node, op_name
from ..ir.routing import index_of, is_free_move, pool, route
from ..schedule.steps import Free, Plan, Run, Send, Wait
from ..schedule.timeline import Span, Timeline
from .callerstate import CallerState
from .codegen import Call, Program, SlotTable, build_program
from .cudagraphs import CudaGraphBackend, GraphSegment, capture_segments
from .fuse import Fused, fuse_program, same_pool
from .interleave import interleave

__all__ = ["Executor", "WorkerError", "graph_devices"]

log = logging.getLogger("autopar.runtime")

_TIMEOUT = float(os.environ.get("AUTOPAR_WAIT_TIMEOUT", "600"))
_profiler = torch.autograd.profiler  # ``_profiler._is_profiler_enabled``: a global's read
_range = torch.autograd.profiler.record_function

SMALL_COPY_BYTES = 64 << 10
"""Copies between the host and a GPU up to this size go on the GPU's compute stream, in program
order, instead of a side stream: they take microseconds on the GPU, so there is nothing to
overlap, while the side stream's events and stream switches cost the host 30-60 us a copy
(2xH200 host). A host value for a GPU is staged in pinned memory and needs no CUDA event: its
consumers come after it on the same stream."""

STAGE_MIN_BYTES = 1 << 20
"""Host values at least this large going to a GPU on a side stream are staged in pinned memory
first, so the DMA runs while the thread goes on; smaller ones are handed to the driver as they
are (it stages pageable memory itself, and a pinned buffer, its fill and ``is_pinned()`` cost
more than that for a few hundred kilobytes). Copies up to ``SMALL_COPY_BYTES`` are staged
either way (see there)."""


class WorkerError(RuntimeError):
    """A worker stopped waiting: another worker failed, or a wait timed out."""


def _is_cpu(device: str) -> bool:
    return device.startswith("cpu")


def _is_gpu(device: str) -> bool:
    """A GPU's program (not a CPU worker's, nor the collectives' lane :data:`COMM`)."""
    return device.startswith("cuda")


class _PerDevice:
    """Base of objects kept one per device for the whole process, made on first use."""

    _instances: ClassVar[dict[str, Any]]
    _lock = threading.Lock()

    def __init_subclass__(cls) -> None:
        cls._instances = {}

    @classmethod
    def of(cls, device: str) -> Any:
        with cls._lock:
            if device not in cls._instances:
                cls._instances[device] = cls(device)
            return cls._instances[device]


class _Streams(_PerDevice):
    """Side streams of one GPU, created once per process."""

    def __init__(self, device: str) -> None:
        dev = torch.device(device)
        self.h2d = torch.cuda.Stream(dev)
        self.d2h = torch.cuda.Stream(dev)
        self.peer = torch.cuda.Stream(dev)
        self.peer_in = torch.cuda.Stream(dev)
        self.comm = torch.cuda.Stream(dev)  # collectives (:meth:`_Call.all_reduce`)


class _Call:
    """The state of one call; also the ``rt`` object the generated programs call into."""

    def __init__(self, n_slots: int, n_events: int, compute: dict[str, Any],
                 trace: bool = False, events: _EventPool | None = None) -> None:
        self.env: list[Any] = [None] * n_slots
        self.ready = [threading.Event() for _ in range(n_events)]
        self.cuda_events: list[Any] = [None] * n_events
        self.compute = compute  # GPU name -> its compute stream for this call
        self.events = events if events is not None else _EventPool(n_events)
        self.caller = threading.get_ident()  # its current streams are ``compute``
        self.failed: BaseException | None = None
        self.pending_host: list[Any] = []
        self.lock = threading.Lock()
        self.trace = trace
        self.profiled = False  # under torch.profiler: programs and copies are named ranges
        self.keep_sums = False  # collectives' sums in the event pool's buffers (CUDA graphs)
        self.names: dict[int, str] = {}  # ...and node id -> the value's name, for copies
        # traced calls: (lane, name, kind, start, end, node, bytes, src, dst); start/end are host
        # clock seconds on CPU lanes and CUDA events on GPU lanes
        self.marks: list[tuple] = []

    # -- tracing (only called by traced programs and traced copies) --------------------------
    def begin(self, device: str, stream: Any = None) -> Any:
        """A start mark: the host clock, or an event on ``stream`` (default: ``device``'s
        compute stream; one thread may launch several GPUs' steps)."""
        if not _is_gpu(device):
            return time.perf_counter()
        stream = self.compute[device] if stream is None else stream
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev, stream

    def end(self, mark: Any, lane: str, name: str, node: int, kind: str = "op",
            nbytes: int = 0, src: str | None = None, dst: str | None = None) -> None:
        if isinstance(mark, float):
            stop: Any = time.perf_counter()
        else:
            mark, stream = mark
            stop = torch.cuda.Event(enable_timing=True)
            stop.record(stream)
        self.marks.append((lane, name, kind, mark, stop, node, nbytes, src, dst))

    def _traced_copy(self, side: Any, lane: str, t: torch.Tensor, src: str, dst: str,
                     node: int, issue: Any) -> Any:
        """Run ``issue()`` (which enqueues a copy on ``side``) between two timing events."""
        if not self.trace:
            return issue()
        with torch.cuda.stream(side):
            mark = self.begin(str(side.device), side)
            out = issue()
            nbytes = t.nbytes
            self.end(mark, lane, f"copy {src}->{dst}", node, "copy", nbytes, src, dst)
        return out

    # -- called from generated code ---------------------------------------------------------
    def send(self, t: Any, src: str, dst: str, event: int, node: int = -1) -> Any:
        """Issue the copy of ``t`` from ``src`` to ``dst`` on a side stream; mark ``event``.
        (No Send joins two CPU workers: they share memory, and the plan orders them by Record.)"""
        if self.profiled:
            with _range(f"autopar:copy {self.names.get(node, node)} -> {dst}"):
                return self._send(t, src, dst, event, node)
        return self._send(t, src, dst, event, node)

    def _send(self, t: Any, src: str, dst: str, event: int, node: int) -> Any:
        t, shape = _unexpanded(t)
        if _is_cpu(dst):
            out = self._to_host(t, src, event, node)
        elif _is_cpu(src):
            out = self._to_gpu(t, dst, event, node)
        else:
            out = self._peer(t, src, dst, event, node)
        if shape is not None:
            out = out.expand(shape)
        self.ready[event].set()
        return out

    def record(self, event: int) -> None:
        self.ready[event].set()

    def wait(self, event: int, env: list, slot: int, device: str) -> None:
        if not self.ready[event].wait(_TIMEOUT):
            raise WorkerError(
                f"{device} waited {_TIMEOUT:.0f} s for event {event} (value in slot {slot}) "
                "and it never came: a producer is stuck (set AUTOPAR_WAIT_TIMEOUT to wait longer)")
        if self.failed is not None:
            raise WorkerError("cancelled: another worker failed")
        cev = self.cuda_events[event]
        if cev is None:
            return
        if isinstance(cev, dict):  # a collective's items: this GPU's, on its comm stream
            ev, item = cev[device]
            stream = self.compute[device]
            stream.wait_event(ev)
            item.record_stream(stream)
            return
        if _is_cpu(device):
            cev.synchronize()  # the host consumes GPU data: wait for that copy only
        else:
            stream = self.compute[device]
            stream.wait_event(cev)
            value = env[slot]
            if isinstance(value, torch.Tensor):
                value.record_stream(stream)  # allocated on a copy stream, used on compute

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, parts: Sequence[Any], node: int = -1) -> tuple[Any, ...]:
        """:func:`autopar.ir.collective.all_reduce` of ``parts`` (one per GPU): on each GPU's
        ``comm`` stream, after everything issued on its compute stream so far (the part's
        producer among it, and every read of the last call's sums: the plan's Wait saw its
        Record), or on the compute streams themselves for a small one
        (:func:`~autopar.ir.collective.inline`), one NCCL all-reduce where torch has NCCL, else
        the parts added in shard order on each GPU. Under CUDA graphs (``keep_sums``) the sums
        land in the same buffers every call (the event pool's, by node id), which graphs then
        read in place. Parts sharing a device (CPU workers) are summed once, here."""
        devices = [str(p.device) for p in parts]
        kept = self.events.sums.get(node) if self.keep_sums else None
        if kept is not None and any(k.shape != p.shape or k.dtype != p.dtype
                                    or k.device != p.device for k, p in zip(kept, parts)):
            kept = None  # (another layout than the last call's: new buffers)
        if not all(map(_is_gpu, devices)) or len(set(devices)) != len(devices):
            got = all_reduce(*parts)
            if kept is not None:
                for k, g in zip(kept, got):
                    if k is not g:
                        k.copy_(g)
                got = kept
        else:
            if inline(parts[0].nbytes):  # on the compute streams: ordered as they are
                streams = [self.compute[d] for d in devices]
            else:
                streams = [_Streams.of(d).comm for d in devices]
                for d, side in zip(devices, streams):
                    side.wait_stream(self.compute[d])
            if self.profiled:
                with _range(f"autopar:all_reduce {len(parts)} x {tuple(parts[0].shape)}"):
                    got = _all_reduce_on(parts, devices, streams, kept)
            else:
                got = _all_reduce_on(parts, devices, streams, kept)
        if self.keep_sums:
            self.events.sums[node] = got
        return got

    def record_items(self, event: int, items: Sequence[Any]) -> None:
        """A collective's value is ready: each GPU item's CUDA event on its comm stream (what
        that GPU's consumers wait on: :meth:`wait`); CPU items, and items made on the compute
        streams (:func:`~autopar.ir.collective.inline`), need the flag only."""
        marks = {}
        for t in items if not inline(items[0].nbytes) else ():
            d = str(t.device)
            if _is_gpu(d) and d not in marks:
                ev = self.events.item(event, d)
                ev.record(_Streams.of(d).comm)
                marks[d] = (ev, t)
        if marks:
            self.cuda_events[event] = marks
        self.ready[event].set()

    # -- copies -----------------------------------------------------------------------------
    def _small(self, t: torch.Tensor) -> bool:
        """A copy small enough to go on the compute stream itself (see ``SMALL_COPY_BYTES``);
        traced calls time every copy on its side stream."""
        return not self.trace and t.nbytes <= SMALL_COPY_BYTES

    def _to_host(self, t: torch.Tensor, src: str, event: int, node: int) -> torch.Tensor:
        out = _pinned_like(t)
        ev = self.events.done(event)
        if self._small(t):  # on the compute stream, right after its producer
            out.copy_(t, non_blocking=True)
            ev.record(self.compute[src])
        else:
            side = _Streams.of(src).d2h
            side.wait_event(self.events.barrier(src, self.compute[src]))

            def issue() -> Any:
                with torch.cuda.stream(side):
                    return out.copy_(t, non_blocking=True)
            self._traced_copy(side, f"{src}/d2h", t, src, "cpu", node, issue)
            t.record_stream(side)
            ev.record(side)
        self.cuda_events[event] = ev
        with self.lock:
            self.pending_host.append(ev)
        return out

    def _to_gpu(self, t: torch.Tensor, dst: str, event: int, node: int) -> torch.Tensor:
        if self._small(t):  # staged, then queued on dst's compute stream: no event needed
            staged = _pinned_like(t).copy_(t)
            if threading.get_ident() == self.caller:
                return _copy_to(staged, dst)
            with torch.cuda.stream(self.compute[dst]):  # a CPU worker's thread
                return _copy_to(staged, dst)
        side = _Streams.of(dst).h2d
        if t.nbytes >= STAGE_MIN_BYTES and not t.is_pinned():
            staged = _pinned_like(t)
            staged.copy_(t)
            t = staged

        def issue() -> Any:
            with torch.cuda.stream(side):
                return _copy_to(t, dst)
        out = self._traced_copy(side, f"{dst}/h2d", t, "cpu", dst, node, issue)
        ev = self.events.done(event)
        ev.record(side)
        self.cuda_events[event] = ev
        return out

    def _peer(self, t: torch.Tensor, src: str, dst: str, event: int, node: int) -> torch.Tensor:
        out_side = _Streams.of(src).peer
        in_side = _Streams.of(dst).peer_in
        out_side.wait_event(self.events.barrier(src, self.compute[src]))

        def issue() -> Any:
            with torch.cuda.stream(in_side), torch.cuda.stream(out_side):
                return _copy_to(t, dst)
        out = self._traced_copy(out_side, f"{src}/peer", t, src, dst, node, issue)
        t.record_stream(out_side)
        ev = self.events.done(event)
        ev.record(out_side)
        self.cuda_events[event] = ev
        return out


def _all_reduce_on(parts: Sequence[Any], devices: Sequence[str], streams: Sequence[Any],
                   into: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """The sum of ``parts`` on each of their GPUs, computed on ``streams`` (each already
    ordered after its part), into ``into`` (else new buffers): NCCL's all-reduce (every item
    the same bits), else each part copied to every other GPU on its own GPU's stream (as the
    executor's peer copies go) and each GPU adding the parts in shard order."""
    outs = list(into) if into is not None else []
    dense = []
    for p, side in zip(parts, streams):
        with torch.cuda.stream(side):
            p.record_stream(side)
            dense.append(p if p.is_contiguous() else p.contiguous())
            if into is None:
                outs.append(torch.empty_like(p, memory_format=torch.contiguous_format))
    parts = dense
    if _nccl_works(parts):
        torch.cuda.nccl.all_reduce(list(parts), outs, streams=list(streams))
        return tuple(outs)
    here: list[list[Any]] = [[None] * len(parts) for _ in parts]  # [dst][src]
    for j, (p, src) in enumerate(zip(parts, streams)):
        for i, (d, dst) in enumerate(zip(devices, streams)):
            if i == j:
                here[i][j] = p
                continue
            with torch.cuda.stream(dst), torch.cuda.stream(src):
                here[i][j] = p.to(d, non_blocking=True)
    landed = []
    for src in streams:
        ev = torch.cuda.Event()
        ev.record(src)
        landed.append(ev)
    for i, dst in enumerate(streams):
        for j, ev in enumerate(landed):
            if j != i:
                dst.wait_event(ev)
        with torch.cuda.stream(dst):
            total = here[i][0]
            for t in here[i][1:]:
                total = total + t
            outs[i].copy_(total)
    return tuple(outs)


_HAS_NCCL = hasattr(torch._C, "_nccl_all_reduce")


def _nccl_works(tensors: Sequence[Any]) -> bool:
    """Can ``torch.cuda.nccl`` reduce these: a build with NCCL, dense contiguous CUDA tensors
    of one dtype and shape on distinct GPUs (``torch.cuda.nccl.is_available``'s test, without
    its warning on every call)?"""
    return _HAS_NCCL and len({t.get_device() for t in tensors}) == len(tensors) and all(
        t.is_cuda and not t.is_sparse and t.is_contiguous() and t.dtype == tensors[0].dtype
        and t.shape == tensors[0].shape for t in tensors)


class _EventPool:
    """CUDA events one executor records in every call, made once (``cudaEventCreate`` costs
    microseconds a call otherwise). Re-recording an event is safe once every wait on its
    earlier record has been enqueued, which a finished call guarantees; a call that overlaps
    another of the same executor gets a pool of its own."""

    def __init__(self, n_events: int) -> None:
        self._done: list[Any] = [None] * n_events
        self._barriers: dict[str, Any] = {}
        self.sums: dict[int, tuple[Any, ...]] = {}  # collective's node id -> its buffers
        self._items: dict[tuple[int, str], Any] = {}  # (plan event, GPU) -> its CUDA event
        self.lock = threading.Lock()  # held by the call using this pool

    def done(self, event: int) -> Any:
        """The event that marks plan event ``event``'s copy as landed."""
        ev = self._done[event]
        if ev is None:
            ev = self._done[event] = torch.cuda.Event()
        return ev

    def item(self, event: int, device: str) -> Any:
        """The event that marks plan event ``event`` (a collective's value) on ``device``."""
        ev = self._items.get((event, device))
        if ev is None:
            ev = self._items[(event, device)] = torch.cuda.Event()
        return ev

    def barrier(self, device: str, stream: Any) -> Any:
        """An event recorded now on ``stream`` (``device``'s compute stream): a copy stream
        that waits on it starts after everything issued there so far. One per device: only
        the thread that runs ``device``'s program records it, and each wait is enqueued
        before the next record."""
        ev = self._barriers.get(device)
        if ev is None:
            ev = self._barriers[device] = torch.cuda.Event()
        ev.record(stream)
        return ev


def _unexpanded(t: Any) -> tuple[Any, torch.Size | None]:
    """``t`` with each broadcast dimension (stride 0, size over 1: an ``expand``) narrowed to
    its one element, and the shape that expands the copy back; ``(t, None)`` where it has
    none. A copy then moves each broadcast row once, and its consumer sees eager's strides
    (0 there): ``.to()`` of an expanded tensor writes every row out, so a ``[4, 1, 11, 11]``
    mask expanded over 4 heads, as SDPA expands its bias, arrived as a contiguous
    ``[4, 4, 11, 11]`` whose head stride (121) the efficient-attention kernel rejects."""
    if not isinstance(t, torch.Tensor):
        return t, None
    dims = [d for d, (st, sz) in enumerate(zip(t.stride(), t.shape)) if st == 0 and sz > 1]
    if not dims:
        return t, None
    compact = t
    for d in dims:
        compact = compact.narrow(d, 0, 1)
    return compact, t.shape


def _kept_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a copy of ``t`` must keep where ``.to()`` would drop them: a view that is
    not dense but overlaps nothing (a slice of a padded buffer, such as the attention bias
    SDPA pads): its consumer sees those strides eagerly, and kernels with alignment rules
    check them. None where ``.to()`` keeps ``t``'s layout already (contiguous, or dense), or
    where ``t`` overlaps itself (an ``expand``: a copy cannot write into such memory)."""
    if t.is_contiguous():
        return None
    span, dense = 1, True
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return None  # overlaps itself
        dense = dense and stride == span
        span = stride * size
    return None if dense else t.stride()


def _empty_like_on(t: torch.Tensor, device: Any, pin: bool = False) -> torch.Tensor:
    """An empty tensor on ``device`` to copy ``t`` into, laid out as eager's consumer of ``t``
    sees it (:func:`_kept_strides`; else as ``.to()`` lays it out)."""
    stride = _kept_strides(t)
    if stride is None:
        return torch.empty_like(t, device=device, pin_memory=pin)
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=device, pin_memory=pin)


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer to copy ``t`` into (:func:`_empty_like_on`)."""
    return _empty_like_on(t, "cpu", pin=True)


def _copy_to(t: torch.Tensor, dst: str) -> torch.Tensor:
    """``t.to(dst, non_blocking=True)``, keeping the strides of a non-dense view."""
    stride = _kept_strides(t)
    if stride is None:
        return t.to(dst, non_blocking=True)
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=dst).copy_(
        t, non_blocking=True)


class _Worker(_PerDevice):
    """A daemon thread that runs programs for one device, one call at a time."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"autopar-{device}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if _is_gpu(self.device):
            torch.cuda.set_device(torch.device(self.device))
        while True:
            fn = self.jobs.get()
            fn()


def _planned_times(slots: dict[Any, Any]) -> Any:
    """``times(step)`` for :func:`~autopar.runtime.interleave.interleave`: the planned
    ``(start, end)`` of a Run, a Send, the copy a Wait waits for, or a fused region, from the
    placement's slots (None for a hand-made placement, which has none)."""
    if not slots:
        return None
    arrivals: dict[tuple[Any, str], Any] = {}  # (value, memory pool) -> its copy's slot
    for key, slot in slots.items():
        if isinstance(key, tuple):
            arrivals[(key[0], pool(key[1]))] = slot

    def times(step: Any) -> tuple[float, float] | None:
        if isinstance(step, Run):
            found = [slots.get(step.node)]
        elif isinstance(step, Send):
            found = [slots.get((step.value, step.dst))]
        elif isinstance(step, Wait):
            found = [arrivals.get((step.value, "cpu"))]
        elif isinstance(step, Fused):
            found = [slots.get(n) for n in step.nodes]
        else:
            return None
        found = [s for s in found if s is not None]
        return (min(s.start for s in found), max(s.end for s in found)) if found else None
    return times


def graph_devices(devices: Sequence[str], cuda_graphs: Callable[[int, int, int], bool] | None
                  ) -> list[str]:
    """The devices whose programs may have segments replayed as CUDA graphs: the GPUs."""
    return [] if cuda_graphs is None else [d for d in devices if _is_gpu(d)]


_GRAPH_BACKEND = CudaGraphBackend()


class Executor:
    """Runs a :class:`~autopar.schedule.plan.Plan`: ``executor(args) -> outputs``.

    ``fuse``: the regions of each program to compile with Inductor (device -> regions, each a
    list of nodes in program order: :func:`autopar.passes.fusion.regions_to_fuse`, see
    :mod:`autopar.runtime.fuse`); none by default here, the :func:`autopar.compile` option
    decides for compiled functions. ``cuda_graphs``: replay GPU segments as CUDA graphs where
    ``cuda_graphs(launches, copies, clones)`` says capturing pays
    (:func:`autopar.passes.cudagraphs.capture_rule`, see :mod:`autopar.runtime.cudagraphs`);
    None: never. Off when tracing, which times every op. ``in_place``: the graph inputs (their
    indices) that stay where they live between calls (a data-parallel step's parameters,
    replicas and optimizer state), which graphs read in place, not copied; ``transient``: the
    graph outputs (indices) the caller consumes before its next call, which graphs hand out
    without a clone. ``interleaved``: the host's program
    and every GPU's run on the calling thread, interleaved (:mod:`autopar.runtime.interleave`);
    ``merged`` names them.
    Worker threads run under the caller's thread-local state
    (:class:`~autopar.runtime.callerstate.CallerState`) and set no thread counts.
    """

    def __init__(self, plan: Plan, trace: bool = False,
                 fuse: Mapping[str, Sequence[Sequence[Node]]] | None = None,
                 cuda_graphs: Callable[[int, int, int], bool] | None = None,
                 interleaved: bool = True, in_place: Collection[int] = (),
                 transient: Collection[int] = ()) -> None:
        self.plan = plan
        self.runs_as = "executor"  # or "eager's sequence" (autopar.schedule.simulate.runs_as_eager)
        self.cuda_graphs = cuda_graphs
        self.trace = trace
        self.last_timeline: Timeline | None = None
        graph = plan.graph
        placement = plan.placement
        self.slots = SlotTable()
        self.inputs = graph.inputs
        self.input_slots = [self.slots(n, placement.device[n]) for n in self.inputs]
        device_of = placement.device
        ix = index_of(placement, graph)  # the routes the plan was made with

        def source_of(value: Node, reader: str) -> str:
            return reader if route(value, device_of[value], reader, ix) != "event" \
                else device_of[value]

        moved = {n for n in graph.ops if is_free_move(n, device_of, ix.passthrough)}
        fusing = fuse or {}
        capturing = [] if trace else graph_devices(list(plan.programs), cuda_graphs)
        #: collectives' sums stay in one set of buffers per event pool, read in place by
        #: graphs (:mod:`autopar.schedule.segments`); the caller then copies out what it keeps
        self.keep_sums = bool(capturing)
        outputs = set(graph.output_nodes)
        read_in_place = {self.inputs[i] for i in in_place}
        kept_outputs = [o for i, (o, _) in enumerate(plan.outputs) if i not in transient]
        consumed = {plan.outputs[i][0] for i in transient} - set(kept_outputs)
        self.programs: dict[str, Program] = {}
        self.fused: list[Fused] = []
        self.segments: list[GraphSegment] = []
        final: dict[str, list[Any]] = {}
        once: set[tuple[Node, str]] = set()  # views made at the first call (segments')
        for device, steps in plan.programs.items():
            if not steps:
                continue
            local = same_pool(device, source_of)
            if device in fusing:
                steps = fuse_program(device, steps, fusing[device], ix, outputs,
                                     label=f"{graph.name}/")
                self.fused += [s for s in steps if isinstance(s, Fused)]
            if device in capturing:
                steps, made_once = capture_segments(
                    device, steps, self.slots, source_of, moved, ix, outputs, local, cuda_graphs,
                    _GRAPH_BACKEND, label=f"{graph.name}/", in_place=read_in_place.__contains__,
                    transient=consumed.__contains__)
                self.segments += [s.fn for s in steps if isinstance(s, Call)]
                once |= {(n, device) for n in made_once}
            final[device] = steps
        # the host's program and every GPU's share the calling thread
        host = min((d for d in final if _is_cpu(d)), default=None)
        # (the collectives' lane with them: its steps only enqueue work on the GPUs' streams)
        gpus = sorted((d for d in final if not _is_cpu(d)),
                      key=lambda d: (d == COMM, d)) if interleaved else []
        lanes = gpus + ([host] if host is not None else [])
        merged = (interleave(final, host, gpus, _planned_times(placement.slots))
                  if gpus and len(lanes) > 1 else None)
        self.merged = tuple(lanes) if merged is not None else None  # the first names it
        for device, steps in final.items():
            if merged is not None and device in lanes:
                continue
            self.programs[device] = build_program(device, steps, self.slots, source_of, moved,
                                                  traced=trace, once=frozenset(once))
        if merged is not None:
            self.programs[gpus[0]] = build_program(
                gpus[0], [s for _, s in merged], self.slots, source_of, moved, traced=trace,
                step_devices=[d for d, _ in merged], once=frozenset(once))
        self.output_slots = [
            ("slot", self.slots(o, dev)) if isinstance(o, Node) else ("const", o)
            for o, dev in plan.outputs
        ]
        copies = plan.copies()
        # outputs a side-stream copy delivered to a GPU: the caller's stream must wait for them
        arrivals = {(s.value.id, s.dst): s.event for s in copies if not _is_cpu(s.dst)}
        self.delivered = sorted({(self.slots(o, dev), dev, arrivals[(o.id, dev)])
                                 for o, dev in plan.outputs
                                 if isinstance(o, Node) and (o.id, dev) in arrivals})
        self.gpus = sorted({d for d in plan.programs if _is_gpu(d)}
                           | {d for s in copies for d in (s.src, s.dst) if not _is_cpu(d)})
        for segment in self.segments:
            segment.peers = tuple(self.gpus)
        # the caller runs the merged program (else the host's alone, else the first one); the
        # rest go to workers
        order = sorted(self.programs, key=lambda d: (
            not (self.merged is not None and d == self.merged[0]), not _is_cpu(d), d))
        self.inline = order[0] if order else None
        self.threaded = order[1:]
        self.n_events = plan.n_events
        self._events = _EventPool(plan.n_events)
        # one program and nothing to order: run it straight, without per-call machinery
        self.solo = self.inline if (len(self.programs) == 1 and not self.n_events
                                    and not trace) else None
        self._solo_gpu = (None if self.solo is None or not _is_gpu(self.solo)
                          else torch.device(self.solo).index or 0)
        self._whole = (_whole_graph_region(final[self.solo], graph.inputs, plan.outputs)
                       if self.solo is not None and merged is None else None)
        #: the first calls of a plan that learns its host ops' times (a
        #: :class:`~autopar.runtime.learn.Learner`, set by the caller; it sets None when done)
        self.learning: Callable[[Sequence[Any]], Any] | None = None
        #: what the solo program's failure becomes instead of the error (``_FallsBack``)
        self.on_failure: Callable[[Sequence[Any], Exception], Any] | None = None
        if self.solo is not None:  # the whole call as one function: args -> outputs
            solo_steps = [s for _, s in merged] if merged is not None else final[self.solo]
            program = self.programs[self.solo] = build_program(
                self.solo, solo_steps, self.slots, source_of, moved,
                entry=(self.input_slots, self.output_slots),
                step_devices=[d for d, _ in merged] if merged is not None else None,
                failed=self._solo_failed, profiled=self._profiled)
            if self._whole is None and self._solo_gpu is None:
                #: a call for callers that pass the right number of inputs (the entries of
                #: :mod:`autopar.capture.direct`): the host's program is all a call does, with
                #: the profiler's ranges and the failure's report inside it
                self.unchecked = program.fn
                self.call_lines = program.call_lines  # (codegen.Inline)

    def __call__(self, args: Sequence[Any], _ranged: bool = False) -> list[Any]:
        if not _ranged and _profiler._is_profiler_enabled:
            return self._profiled(args)
        if len(args) != len(self.inputs):
            raise TypeError(f"graph {self.plan.graph.name} takes {len(self.inputs)} inputs, "
                            f"got {len(args)}")
        if self.solo is not None:  # one program, no events: one generated function, here
            if self._whole is not None and self._whole.compiled is not None:
                try:  # one fused region is the whole graph: Inductor's function is the call
                    return self._whole.eager_strides(self._whole.compiled(list(args)))
                except Exception:  # the program below runs it again, and reports an error
                    pass
            program = self.programs[self.solo]  # (it reports its own failure: _solo_failed)
            ranged = True if _ranged else None
            if self._solo_gpu is None or torch.cuda.current_device() == self._solo_gpu:
                return program.fn(args, ranged)
            with torch.cuda.device(self._solo_gpu):
                return program.fn(args, ranged)
        if self.learning is not None:  # the plan's first calls (autopar.runtime.learn)
            return self.learning(args)
        return self._events_call(args, _ranged)

    def _events_call(self, args: Sequence[Any], _ranged: bool = False) -> list[Any]:
        compute = {g: torch.cuda.current_stream(torch.device(g)) for g in self.gpus}
        pool = self._events if self._events.lock.acquire(blocking=False) else None
        try:
            return self._call(args, compute, pool, _ranged)
        finally:
            if pool is not None:
                pool.lock.release()

    def _solo_failed(self, args: Sequence[Any], error: BaseException) -> Any:
        """The solo program's failure: ``on_failure``'s result where one is set (an
        ``Exception``), else ``error`` raised again with the failing op and source line."""
        if self.on_failure is not None and isinstance(error, Exception):
            return self.on_failure(args, error)
        _annotate(error, self.programs[self.solo])  # type: ignore[index]
        raise error

    def _profiled(self, args: Sequence[Any]) -> list[Any]:
        """A call under ``torch.profiler``: ``autopar:<graph>``, and within it the range of
        each program (a program run straight here: ``autopar:<graph>:<device>``)."""
        name = f"autopar:{self.plan.graph.name}"
        with _range(name):
            if self.solo is None:
                return self(args, True)
            with _range(f"{name}:{self.solo}"):
                return self(args, True)

    def _call(self, args: Sequence[Any], compute: dict[str, Any],
              events: _EventPool | None, profiled: bool = False) -> list[Any]:
        call = _Call(len(self.slots), self.n_events, compute, trace=self.trace, events=events)
        call.keep_sums = self.keep_sums
        if profiled:
            call.profiled = True
            call.names = {n.id: repr(n) for n in self.plan.graph.nodes}
        if self.trace:
            refs = self._trace_start(compute)
        env = call.env
        for slot, value in zip(self.input_slots, args):
            env[slot] = value
        done: list[threading.Event] = []
        state = CallerState.capture() if self.threaded else None
        for device in self.threaded:
            finished = threading.Event()
            done.append(finished)
            _Worker.of(device).jobs.put(self._job(device, call, finished, state))
        if self.inline is not None:
            self._run(self.inline, call)
        for finished in done:
            finished.wait()
        if call.failed is not None:
            raise call.failed
        for ev in call.pending_host:
            ev.synchronize()  # host results are valid when returned
        for slot, device, event in self.delivered:
            if call.cuda_events[event] is None:  # a small copy made on that very stream
                continue
            stream = compute[device]
            stream.wait_event(call.cuda_events[event])
            env[slot].record_stream(stream)  # allocated by a copy stream, used by the caller
        if self.trace:
            self.last_timeline = self._trace_finish(call, refs)
        return [env[v] if kind == "slot" else v for kind, v in self.output_slots]

    def _job(self, device: str, call: _Call, finished: threading.Event, state: CallerState):
        run: Callable[[str, _Call], None] | None = self._run

        def job() -> None:
            nonlocal call, run
            try:
                with state.applied():
                    run(device, call)  # type: ignore[misc]
            finally:
                # dropped before the caller is told: the worker's loop keeps this job until
                # its next one, and with it the call's values and the executor
                # (a learner's traced twin, let go after its last call)
                call = run = None
                finished.set()
        return job

    def _run(self, device: str, call: _Call) -> None:
        if call.profiled:
            with _range(f"autopar:{self.plan.graph.name}:{device}"):
                return self._run_program(device, call)
        return self._run_program(device, call)

    def _run_program(self, device: str, call: _Call) -> None:
        program = self.programs[device]
        try:
            if not _is_gpu(device):
                program.fn(call.env, call)
            else:
                with torch.cuda.device(torch.device(device)), \
                        torch.cuda.stream(call.compute[device]):
                    program.fn(call.env, call)
        except BaseException as e:
            with call.lock:
                first = call.failed is None
                if first:
                    call.failed = e
            for flag in call.ready:
                flag.set()  # wake every waiter: they see `failed` and stop
            if first and not isinstance(e, WorkerError):
                _annotate(e, program)

    def _trace_start(self, compute: dict[str, Any]) -> tuple[float, dict[str, tuple]]:
        """Align clocks: a synchronized host time and a CUDA event per GPU at the call's start."""
        refs: dict[str, tuple] = {}
        for g, stream in compute.items():
            torch.cuda.synchronize(torch.device(g))
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            ev.synchronize()
            refs[g] = (ev, time.perf_counter())
        return time.perf_counter(), refs

    def _trace_finish(self, call: _Call, refs: tuple[float, dict[str, tuple]]) -> Timeline:
        t0, gpu_refs = refs
        for g in gpu_refs:
            torch.cuda.synchronize(torch.device(g))

        def host_time(mark: Any, lane: str) -> float:
            if isinstance(mark, float):
                return mark - t0
            ref, ref_host = gpu_refs[lane.split("/", 1)[0]]
            return ref_host - t0 + ref.elapsed_time(mark) / 1e3

        spans = [Span(lane, name, host_time(a, lane), host_time(b, lane), kind,
                      None if node < 0 else node, nbytes, src, dst)
                 for lane, name, kind, a, b, node, nbytes, src, dst in call.marks]
        return Timeline(sorted(spans, key=lambda s: s.start), source="measured",
                        label=self.plan.graph.name)

    def source(self) -> str:
        """The generated code of every program, for inspection."""
        return "\n".join(f"# {d}\n{p.source}" for d, p in self.programs.items())


def _whole_graph_region(steps: Sequence[Any], inputs: Sequence[Node],
                        outputs: Sequence[tuple[Any, str | None]]) -> Any:
    """The kernel of a program that is one fused region taking the graph's inputs in order and
    giving its outputs in order (each once), or None. Such a call needs nothing from the
    executor: autopar then costs what ``torch.compile``'s default does."""
    body = [s for s in steps if not isinstance(s, Free)]
    if len(body) != 1 or not isinstance(body[0], Fused):
        return None
    region = body[0]
    outs = [o for o, _ in outputs]
    if (list(region.inputs) != list(inputs) or list(region.outputs) != outs
            or len(set(outs)) != len(outs)):
        return None
    return region.kernel


def _annotate(error: BaseException, program: Program) -> None:
    """Add the failing op and the user's source line to ``error``."""
    tb = error.__traceback__
    step = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == program.filename:
            step = program.step_at(tb.tb_lineno)
        tb = tb.tb_next
    if step is None or not hasattr(error, "add_note"):
        return
    node = getattr(step, "node", None) or getattr(step, "value", None)
    where = f" at {node.source}" if getattr(node, "source", None) else ""
    what = op_name(node.op) if isinstance(step, Run) else type(step).__name__.lower()
    error.add_note(f"autopar: {what} ({node!r}) on {program.device} failed{where}")


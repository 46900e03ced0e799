"""CUDA-graph replay of a GPU program's segments.

Policy
- Which segments there are, what can't be captured and what an escaping output is are the
  rules of :mod:`autopar.schedule.segments` (the prediction's too); whether one pays is
  :mod:`autopar.passes.cudagraphs`' policy, handed to the executor as ``pays(launches,
  copies, clones)``.
- Lifecycle of a segment: the first call runs it on streams (warm-up: Inductor compiles, cuBLAS
  initializes); the second captures it: inputs are copied into static buffers (a static
  output of an earlier graph of the same program is used as it is, and an input read *in
  place* is the caller's tensor itself), the segment runs once on a side stream, then once
  under capture (``thread_local`` mode: other devices' workers keep launching), and the graph
  is replayed for that call. Later calls copy inputs whose tensor is not the static buffer
  into it (same layout, else the segment goes back to streams), check that each input read in
  place is at the address captured (else back to streams: a copy would overwrite the caller's
  tensor), replay, and hand out the static outputs.
- Static outputs are overwritten by the next replay, so an output that escapes is cloned after
  each replay; the others are read only by later steps of the same program, on the same
  stream, or consumed by the caller before its next call (``transient``).
- A capture failure never breaks the run: the segment stays on streams for good, and the
  reason is logged once; the device's RNG generator gets back a copy of its state from before
  the capture (a failed capture leaves it flagged as capturing). Peer access between the
  program's GPUs is enabled before any capture.

Glossary: a segment chosen for capture becomes one :class:`~autopar.runtime.codegen.Call`
step of its program, calling its :class:`GraphSegment`, with ``status`` one of ``"warmup"``,
``"pending"``, ``"captured"``, ``"streams"`` (never captured; ``reason`` says why).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..ir.compare import outputs_differ
from ..ir.graph import Node
from ..ir.logs import first_line
from ..ir.routing import GraphIndex
from ..schedule.segments import (
    chosen_segments,
    launches,
    step_ops,
    tuples_unpacked_at_once,
    views_made_once,
)
from ..schedule.steps import Free, Run
from .codegen import Call, Program, SlotTable, build_program

__all__ = ["CudaGraphBackend", "GraphSegment", "GraphedCall", "capture_segments"]

log = logging.getLogger("autopar.runtime")

# -- runtime ----------------------------------------------------------------------------------
class CudaGraphBackend:
    """Captures and replays with ``torch.cuda.CUDAGraph`` (the only CUDA code of this module)."""

    _peers_done: ClassVar[set[tuple[str, str]]] = set()
    _lock = threading.Lock()

    def enable_peer_access(self, gpus: Sequence[str]) -> None:
        """Enable peer access between every pair of ``gpus`` (a first peer copy does), so that
        no capture meets it half-way."""
        with self._lock:
            for a in gpus:
                for b in gpus:
                    if a == b or (a, b) in self._peers_done:
                        continue
                    self._peers_done.add((a, b))
                    ia, ib = torch.device(a).index or 0, torch.device(b).index or 0
                    if torch.cuda.can_device_access_peer(ia, ib):
                        torch.ones(1, device=a).to(b)
            for g in gpus:
                torch.cuda.synchronize(torch.device(g))

    def stream(self, device: str) -> Any:
        """The calling thread's current stream on ``device``."""
        return torch.cuda.current_stream(torch.device(device))

    def order(self, later: Any, earlier: Any) -> None:
        """Work queued on ``later`` from now on waits for what ``earlier`` has queued."""
        later.wait_stream(earlier)

    def capture(self, run: Callable[[list], list], static_in: list,
                device: str) -> tuple[Callable[[], None], list]:
        """Warm ``run`` up on a side stream, capture it on another, both of ``device``; one
        capture at a time in the process (a capture syncs and empties the allocator's cache)."""
        dev = torch.device(device)
        with self._lock, torch.cuda.device(dev):
            stream = torch.cuda.current_stream(dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                run(static_in)  # off the graph: lazy initialization happens here
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # a capture that fails ends before the generator leaves its capturing state, and
            # every later random op of the process would fail: keep a fresh copy to restore
            gen = torch.cuda.default_generators[dev.index or 0]
            fresh = gen.clone_state() if hasattr(gen, "clone_state") else None
            try:
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev),
                                      capture_error_mode="thread_local"):
                    outs = run(static_in)
            except BaseException:
                if fresh is not None:
                    gen.graphsafe_set_state(fresh)
                raise
            finally:
                torch.cuda.set_stream(stream)  # a failing capture_end skips the graph's restore
            return graph.replay, outs


class GraphSegment:
    """A segment's runtime state (see the module docstring for its lifecycle)."""

    def __init__(self, program: Program, slots: SlotTable, input_slots: Sequence[int],
                 output_slots: Sequence[tuple[int, bool]], freed: Sequence[int],
                 statics: dict[int, Any], backend: Any, label: str,
                 reason: str | None = None, in_place: Sequence[int] = ()) -> None:
        self.program = program
        self.slots = slots  # complete by the first call: sizes the scratch slots of a capture
        self.input_slots = list(input_slots)
        self.output_slots = list(output_slots)  # (slot, escapes)
        self.freed = list(freed)
        self.statics = statics  # id -> static output tensor, shared by a program's segments
        self.backend = backend
        self.label = label
        self.status = "warmup" if reason is None else "streams"
        self.reason = reason
        self.in_place = frozenset(in_place)  # positions of the inputs read where they live
        self.peers: tuple[str, ...] = ()  # the GPUs of the plan: peer access before capture
        self._replay: Callable[[], None] | None = None
        self._static_in: list[Any] = []
        self._static_out: list[Any] = []

    def __call__(self, env: list, rt: Any) -> None:
        if self._replay is not None:
            self._run_graph(env, rt)
            return
        if self.status == "pending" and self._capture(env, rt):
            self._run_graph(env, rt)
            return
        if self.status == "warmup":
            self.status = "pending"
        self.program.fn(env, rt)

    def _run_in(self, static_in: list, rt: Any) -> list:
        scratch: list[Any] = [None] * len(self.slots)
        for slot, t in zip(self.input_slots, static_in):
            scratch[slot] = t
        self.program.fn(scratch, rt)
        return [scratch[slot] for slot, _ in self.output_slots]

    def _capture(self, env: list, rt: Any) -> bool:
        if len(self.peers) > 1:
            self.backend.enable_peer_access(self.peers)
        static_in = []
        for k, slot in enumerate(self.input_slots):
            t = env[slot]
            static_in.append(t if k in self.in_place or (id(t) in self.statics
                                                         and self.statics[id(t)] is t)
                             else t.clone(memory_format=torch.preserve_format))
        try:
            replay, outs = self.backend.capture(lambda xs: self._run_in(xs, rt), static_in,
                                                self.program.device)
        except Exception as e:
            self._streams_for_good(f"capture failed: {type(e).__name__}: {first_line(e)}")
            return False
        self._static_in, self._static_out, self._replay = static_in, outs, replay
        # the layout each input had when captured: a clone of an expanded input is dense,
        # and the next call's input is to be compared with the input, not with its buffer
        self._in_strides = [env[slot].stride() for slot in self.input_slots]
        for (_, escapes), t in zip(self.output_slots, outs):
            if not escapes:
                self.statics[id(t)] = t
        self.status = "captured"
        log.info("autopar: %s captured as a CUDA graph", self.label)
        return True

    def _streams_for_good(self, reason: str) -> None:
        self.status, self.reason, self._replay = "streams", reason, None
        log.warning("autopar: %s stays on streams: %s", self.label, reason)

    def _run_graph(self, env: list, rt: Any) -> None:
        for k in self.in_place:
            t, static = env[self.input_slots[k]], self._static_in[k]
            if t is not static and (t.data_ptr() != static.data_ptr() or
                                    t.shape != static.shape or t.stride() != static.stride()):
                self._streams_for_good(f"input in slot {self.input_slots[k]}, read in place, "
                                       "is another tensor than at capture")
                self.program.fn(env, rt)
                return
        misfit = _copy_in([env[slot] if k not in self.in_place else self._static_in[k]
                           for k, slot in enumerate(self.input_slots)], self._static_in,
                          self._in_strides)
        if misfit is not None:
            self._streams_for_good(f"input in slot {self.input_slots[misfit]} changed layout")
            self.program.fn(env, rt)
            return
        self._replay()  # type: ignore[misc]
        for (slot, escapes), t in zip(self.output_slots, self._static_out):
            env[slot] = t.clone(memory_format=torch.preserve_format) if escapes else t
        for slot in self.freed:
            env[slot] = None


def _copy_in(values: Sequence[torch.Tensor], statics: Sequence[torch.Tensor],
             strides: Sequence[tuple[int, ...]] | None = None) -> int | None:
    """Copy each value into its static buffer before a replay (a value that is its buffer is
    not copied); the index of the first value of another layout than at capture (its
    buffer's, or ``strides[k]``: an expanded input's buffer is dense) that the replay can't
    take, or None."""
    for k, (t, static) in enumerate(zip(values, statics)):
        if t is static:
            continue
        stride = static.stride() if strides is None else strides[k]
        if t.shape != static.shape or t.stride() != stride or \
                t.dtype != static.dtype or t.device != static.device:
            return k
        static.copy_(t)
    return None


REPLAY_TOL = 1e-5
"""A first replay's outputs may differ from the function's own on the same arguments by this
relative error in norm (the same kernels: only a nondeterministic reduction's order)."""


class GraphedCall:
    """A compiled graph's whole function (``fn(*args) -> outputs``, Inductor's form of a graph)
    replayed as one CUDA graph: the measured choice's ``cudagraphs`` way, in place of compiling
    the graph again with Inductor's ``triton.cudagraphs`` (its FX-graph cache key differs: a
    second full compile, 7-11 s of first call for the small-config models on one H200).

    Lifecycle: the first call runs ``fn`` (warm-up: Inductor loads its kernels); the second
    captures it: an argument dynamo marked static (a module's parameter or buffer:
    ``_dynamo_static_input_type``) is read in place by the graph, every other one is copied
    into a static buffer of its own, and every other argument (an int: a graph of dynamic
    shapes takes its sizes as dynamo's SymInts) is baked in; later calls copy those in, replay,
    and clone each tensor output out of the graph's memory (the next replay overwrites it; a
    result the caller holds keeps its values). A static argument at another address than at
    capture (a parameter replaced), a copied one of another layout, or another value of a
    baked-in argument (a size changed while every tensor kept its layout: ``x[:, :n]`` of a
    buffer) ends replay for good, as does a failed
    capture or a first replay whose outputs are not the function's own on the same arguments
    (checked once, at capture): ``fn`` runs as it is from then on, logged once.

    One graph, one set of static buffers: calls from several threads (a server's) take turns
    (a lock from copy-in to the clones' launch), and a call on another stream than the last
    one's waits for that stream first (``backend.order``): the last replay's reads of the
    static inputs and its clones are done before they are overwritten."""

    def __init__(self, fn: Callable[..., Any], device: str, label: str,
                 backend: CudaGraphBackend | None = None) -> None:
        self.fn = fn
        self.device = device
        self.label = label
        self.backend = backend or CudaGraphBackend()
        self.status = "warmup"  # then "captured", or "plain" (reason says why)
        self.reason: str | None = None
        self._replay: Callable[[], None] | None = None
        self._static: list[tuple[int, int]] = []  # (argument index, address read in place)
        self._copied: list[int] = []  # the indices of the arguments copied in, and
        self._buffers: list[torch.Tensor] = []  # ...the static buffer of each
        self._baked: list[tuple[int, Any]] = []  # (argument index, value) of the others
        self._outs: list[Any] = []
        self._lock = threading.Lock()
        self._stream: Any = None  # the stream of the latest replay

    def __call__(self, *args: Any) -> Any:
        if self.status == "plain":
            return self.fn(*args)
        with self._lock:
            if self._replay is not None:
                return self._run_graph(args)
            if self.status == "warmup":
                self.status = "pending"
            elif self.status == "pending" and self._capture(args):
                return self._run_graph(args)
        return self.fn(*args)

    def _capture(self, args: tuple) -> bool:
        static_in = list(args)
        self._static, self._copied, self._buffers = [], [], []
        self._baked = [(i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            if getattr(a, "_dynamo_static_input_type", None) is not None:
                self._static.append((i, a.data_ptr()))
            else:
                static_in[i] = a.clone(memory_format=torch.preserve_format)
                self._copied.append(i)
                self._buffers.append(static_in[i])
        try:
            replay, outs = self.backend.capture(lambda xs: list(self.fn(*xs)), static_in,
                                                self.device)
        except Exception as e:
            self._plain(f"capture failed: {type(e).__name__}: {first_line(e)}")
            return False
        self._replay, self._outs = replay, outs
        why = self._differs(args)
        if why is not None:
            self._plain(f"its first replay differs from the function: {why}")
            return False
        self.status = "captured"
        log.info("autopar: %s captured as a CUDA graph", self.label)
        return True

    def _differs(self, args: tuple) -> str | None:
        """How a replay on ``args`` differs from ``fn(*args)``, or None: the same kernels on the
        same inputs, so within ``REPLAY_TOL`` (something baked into the graph, such as a value
        read on the host while capturing, would show here)."""
        want = self.fn(*args)
        return outputs_differ(self._run_graph(args), list(want), REPLAY_TOL)

    def _plain(self, reason: str) -> None:
        self.status, self.reason, self._replay = "plain", reason, None
        log.warning("autopar: %s runs without its CUDA graph: %s", self.label, reason)

    def _run_graph(self, args: tuple) -> Any:
        stream = self.backend.stream(self.device)
        if self._stream is not None and stream != self._stream:
            self.backend.order(stream, self._stream)
        self._stream = stream
        for i, ptr in self._static:
            if args[i].data_ptr() != ptr:
                self._plain(f"argument {i} (a parameter or buffer) moved since the capture")
                return self.fn(*args)
        for i, value in self._baked:
            if type(args[i]) is not type(value) or args[i] != value:
                self._plain(f"argument {i} is {args[i]!r}, captured as {value!r}")
                return self.fn(*args)
        misfit = _copy_in([args[i] for i in self._copied], self._buffers)
        if misfit is not None:
            self._plain(f"argument {self._copied[misfit]} changed layout")
            return self.fn(*args)
        self._replay()  # type: ignore[misc]
        return [o.clone(memory_format=torch.preserve_format) if isinstance(o, torch.Tensor)
                else o for o in self._outs]


# -- building ---------------------------------------------------------------------------------
def capture_segments(device: str, steps: list[Any], slots: SlotTable,
                     source_of: Callable[[Node, str], str], moved: set[Node], ix: GraphIndex,
                     graph_outputs: set[Node], local: Callable[[Node], bool],
                     pays: Callable[[int, int, int], bool], backend: Any,
                     label: str = "", in_place: Callable[[Node], bool] = lambda v: False,
                     transient: Callable[[Node], bool] = lambda v: False
                     ) -> tuple[list[Any], frozenset[Node]]:
    """``steps`` with every segment :func:`~autopar.passes.cudagraphs.chosen_segments` picks
    replaced by one :class:`Call` step; ``statics`` are shared by the program's segments (a
    static output one graph hands the next is not copied). ``in_place``: inputs the graphs
    read where they live (see :class:`GraphSegment`); ``transient``: graph outputs the caller
    consumes before the next call (not cloned). Also the views of the steps left on streams
    that are made once (:func:`~autopar.schedule.segments.views_made_once`)."""
    out: list[Any] = []
    statics: dict[int, Any] = {}
    done = 0
    steps = tuples_unpacked_at_once(steps)
    chosen = chosen_segments(steps, ix, graph_outputs, local, pays,
                             lambda seg: launches(seg, moved), label=f"{label}{device}",
                             transient=transient, in_place=in_place)
    for seg_of in chosen:
        start, end = seg_of.start, seg_of.end
        seg = steps[start:end]
        name = f"segment {label}{device}#{seg_of.index} ({len(seg)} steps)"
        # views read after it are made again from their roots: a root's Free waits for them
        roots = {v.args[0] for v in seg_of.again}
        later = [s for s in seg if isinstance(s, Free) and s.value in roots]
        program = build_program(device, [s for s in seg if s not in later], slots, source_of,
                                moved)
        segment = GraphSegment(
            program, slots,
            [slots(v, source_of(v, device)) for v in seg_of.inputs],
            [(slots(v, device), v in seg_of.escapes) for v in seg_of.outputs],
            [slots(s.value, device) for s in seg if isinstance(s, Free) and s not in later],
            statics, backend, name, in_place=sorted(seg_of.read_in_place))
        out += steps[done:start]
        out.append(Call(segment, name, [n for s in seg for n in step_ops(s)][-1]))
        out += [Run(v) for v in seg_of.again] + later
        done = end
    return out + steps[done:], views_made_once(steps, chosen)

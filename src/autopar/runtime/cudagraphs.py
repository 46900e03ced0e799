"""CUDA-graph replay of a GPU program's segments.

Policy
- A *segment* is a maximal run of a program's capturable Run and Fused steps (Frees inside
  it go with it): it ends at every cross-device point (Send, Record, Wait), which stay on
  streams and events, so replays are ordered across devices by the same events as plain runs,
  and at every op that can't be captured, which runs on the stream between two graphs.
- What can't be captured is decided before trying (a failed capture can leave the CUDA RNG
  state unusable for the process): random ops, ops that write into an input, ops that make no
  tensor or a host tensor, ops that sync with the host or have data-dependent output shapes,
  and ops reading a value from another memory pool (a host scalar would be baked in).
- Where it pays is decided in :mod:`autopar.passes.cudagraphs` and handed to the executor as
  ``pays(launches, copies, clones)``: this module counts a segment's launches (:func:`launches`),
  the inputs to copy into static buffers and the escaping outputs to clone.
- Lifecycle of a segment: the first call runs it on streams (warm-up: Inductor compiles, cuBLAS
  initializes); the second captures it: inputs are copied into static buffers (a static
  output of an earlier graph of the same program is used as it is), the segment runs once on a
  side stream, then once under capture (``thread_local`` mode: other devices' workers keep
  launching), and the graph is replayed for that call. Later calls copy inputs whose tensor
  is not the static buffer into it (same layout, else the segment goes back to streams),
  replay, and hand out the static outputs.
- A graph hands out fresh tensors only: a view (or tuple) that would leave a segment runs
  after it, on the stream, and so does a ``getitem`` of a tuple made before it (found by a
  fixpoint, as for fusion regions).
- Static outputs are overwritten by the next replay, so an output that *escapes* (a graph
  output, read by a later Send or Record, or the base of a later view) is cloned after each
  replay; the others are read only by later steps of the same program, on the same stream.
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
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..ir.compare import outputs_differ
from ..ir.graph import Node, TensorMeta, op_name
from ..ir.logs import first_line
from ..ir.regions import is_view
from ..ir.routing import GraphIndex, kind_of
from ..schedule.steps import Free, Run
from .codegen import Call, Program, SlotTable, build_program
from .fuse import Fused

__all__ = ["CudaGraphBackend", "GraphSegment", "GraphedCall", "capture_segments", "launches",
           "segments", "why_not_capturable"]

log = logging.getLogger("autopar.runtime")

_SYNCING = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
            "aten::is_nonzero", "aten::equal", "aten::_assert_async", "aten::unique",
            "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::bincount",
            "aten::repeat_interleave", "aten::histc", "aten::_assert_scalar"}
_DATA_DEPENDENT = tuple(t for t in (getattr(torch.Tag, "dynamic_output_shape", None),
                                    getattr(torch.Tag, "data_dependent_output", None)) if t)


def segments(steps: Sequence[Any],
             capturable: Callable[[Any], bool] = lambda step: True) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of capturable Run and Fused steps (and Frees)
    holding an op: cross-device steps and ops that can't be captured end a segment."""
    out: list[tuple[int, int]] = []
    start: int | None = None
    for i, step in enumerate([*steps, None]):
        if isinstance(step, Free) or (isinstance(step, Run | Fused) and capturable(step)):
            if start is None:
                start = i
            continue
        if start is not None:
            if any(isinstance(s, Run | Fused) for s in steps[start:i]):
                out.append((start, i))
            start = None
    return out


def _why_not_node(node: Node, local: Callable[[Node], bool]) -> str | None:
    name = op_name(node.op)
    if node.op is operator.getitem:
        return None
    if kind_of(node.op) == "random":
        return f"{name} draws random numbers (a failed capture would spoil the CUDA RNG)"
    if node.writes:
        return f"{name} writes into its input (a graph would write into a static copy)"
    if not node.tensor_metas:
        return f"{name} makes no tensor"
    if any(m.device == "cpu" for m in node.tensor_metas) and "device" in node.kwargs \
            and str(node.kwargs["device"]).startswith("cpu"):
        return f"{name} makes a host tensor"
    op = node.op
    if isinstance(op, torch._ops.OpOverload):
        if op._schema.name in _SYNCING:
            return f"{name} syncs with the host"
        if any(t in op.tags for t in _DATA_DEPENDENT):
            return f"{name} has a data-dependent output shape"
    for v in node.inputs:
        if not local(v):
            return f"{name} reads {v!r} from another memory pool"
    return None


def why_not_capturable(steps: Sequence[Any], local: Callable[[Node], bool]) -> str | None:
    """Why a segment (its steps) can't be captured as a CUDA graph, or None."""
    for step in steps:
        nodes = step.nodes if isinstance(step, Fused) else (
            (step.node,) if isinstance(step, Run) else ())
        for node in nodes:
            why = _why_not_node(node, local)
            if why:
                return why
    return None


def launches(steps: Sequence[Any], moved: set[Node]) -> int:
    """Kernel launches a segment makes on streams: one per op (views and moves launch none),
    one per fused region."""
    n = 0
    for step in steps:
        plain_op = isinstance(step, Run) and step.node not in moved \
            and kind_of(step.node.op) not in ("view", "getitem")
        n += isinstance(step, Fused) or plain_op
    return n


def escaping(seg_steps: Sequence[Any], outputs: Sequence[Node], program: Sequence[Any],
             end: int, ix: GraphIndex, graph_outputs: set[Node]) -> set[Node]:
    """Outputs of the segment that must not stay in static buffers (module docstring)."""
    later_runs = set()
    for step in program[end:]:
        if isinstance(step, Run):
            later_runs.add(step.node)
        elif isinstance(step, Fused):
            later_runs.update(step.nodes)
    inside = {n for s in seg_steps for n in (s.nodes if isinstance(s, Fused) else
                                             (s.node,) if isinstance(s, Run) else ())}
    out = set()
    for v in outputs:
        if v in graph_outputs:
            out.add(v)
            continue
        for u in ix.users[v]:
            if u in inside:
                continue
            if u not in later_runs or v in u.aliases:
                out.add(v)
                break
    return out


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
                 reason: str | None = None) -> None:
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
        for slot in self.input_slots:
            t = env[slot]
            static_in.append(t if id(t) in self.statics and self.statics[id(t)] is t
                             else t.clone(memory_format=torch.preserve_format))
        try:
            replay, outs = self.backend.capture(lambda xs: self._run_in(xs, rt), static_in,
                                                self.program.device)
        except Exception as e:
            self._streams_for_good(f"capture failed: {type(e).__name__}: {first_line(e)}")
            return False
        self._static_in, self._static_out, self._replay = static_in, outs, replay
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
        misfit = _copy_in([env[slot] for slot in self.input_slots], self._static_in)
        if misfit is not None:
            self._streams_for_good(f"input in slot {self.input_slots[misfit]} changed layout")
            self.program.fn(env, rt)
            return
        self._replay()  # type: ignore[misc]
        for (slot, escapes), t in zip(self.output_slots, self._static_out):
            env[slot] = t.clone(memory_format=torch.preserve_format) if escapes else t
        for slot in self.freed:
            env[slot] = None


def _copy_in(values: Sequence[torch.Tensor], statics: Sequence[torch.Tensor]) -> int | None:
    """Copy each value into its static buffer before a replay (a value that is its buffer is
    not copied); the index of the first value of another layout than its buffer's (the
    replay can't take it), or None."""
    for k, (t, static) in enumerate(zip(values, statics)):
        if t is static:
            continue
        if t.shape != static.shape or t.stride() != static.stride() or \
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
def _made(step: Any) -> tuple[Node, ...]:
    """Values a Run or Fused step stores in the program's slots."""
    if isinstance(step, Fused):
        return step.outputs
    return (step.node,) if isinstance(step, Run) else ()


def _ops(step: Any) -> tuple[Node, ...]:
    if isinstance(step, Fused):
        return step.nodes
    return (step.node,) if isinstance(step, Run) else ()


def _boundary(seg: Sequence[Any], ix: GraphIndex,
              graph_outputs: set[Node]) -> tuple[list[Node], list[Node]]:
    """(inputs, outputs) of a segment: values it reads from outside, values read outside."""
    made = [v for s in seg for v in _made(s)]
    inside_values = set(made)
    ops = {n for s in seg for n in _ops(s)}
    reads = [v for s in seg if isinstance(s, Run | Fused)
             for v in (s.inputs if isinstance(s, Fused) else s.node.inputs)]
    inputs = list(dict.fromkeys(v for v in reads if v not in inside_values))
    outputs = [v for v in made
               if v in graph_outputs or any(u not in ops for u in ix.users[v])]
    return inputs, outputs


def _misfit(value: Node) -> bool:
    """A value no graph may hand out: a view (it would alias a static buffer) or something
    other than one tensor."""
    return not isinstance(value.meta, TensorMeta) or is_view(value)


def capture_segments(device: str, steps: list[Any], slots: SlotTable,
                     source_of: Callable[[Node, str], str], moved: set[Node], ix: GraphIndex,
                     graph_outputs: set[Node], local: Callable[[Node], bool],
                     pays: Callable[[int, int, int], bool], backend: Any,
                     label: str = "") -> list[Any]:
    """``steps`` with every segment worth capturing (``pays(launches, copies, clones)``, from
    :mod:`autopar.passes.cudagraphs`) replaced by one :class:`Call` step.

    Segments that can't be captured, or don't pay, are left as they are (logged at debug
    level); ``statics`` are shared by the program's segments (a static output one graph hands
    the next is not copied).
    """
    def capturable(step: Any) -> bool:
        why = why_not_capturable([step], local)
        if why:
            log.debug("autopar: %s runs on streams, between graphs: %s", step, why)
        return why is None

    left_out: set[Node] = set()

    def kept(step: Any) -> bool:
        return not (isinstance(step, Run) and step.node in left_out) and capturable(step)

    while True:  # views and tuples leaving a segment run after it, on the stream
        found = [(start, end, *_boundary(steps[start:end], ix, graph_outputs))
                 for start, end in segments(steps, kept)]
        misfits = {v for *_, outs in found for v in outs if _misfit(v)}
        misfits |= {n for *_, ins, _ in found for v in ins
                    if not isinstance(v.meta, TensorMeta) for n in ix.users[v]}
        if not misfits - left_out:
            break
        left_out |= misfits
    out: list[Any] = []
    statics: dict[int, Any] = {}
    done = 0
    for k, (start, end, inputs, outputs) in enumerate(found):
        seg = steps[start:end]
        name = f"segment {label}{device}#{k} ({len(seg)} steps)"
        escapes = escaping(seg, outputs, steps, end, ix, graph_outputs)
        n_launch = launches(seg, moved)
        if not pays(n_launch, len(inputs), len(escapes)):
            log.debug("autopar: %s not captured: %d launches don't pay for %d copies and %d "
                      "clones", name, n_launch, len(inputs), len(escapes))
            continue
        program = build_program(device, list(seg), slots, source_of, moved)
        segment = GraphSegment(
            program, slots,
            [slots(v, source_of(v, device)) for v in inputs],
            [(slots(v, device), v in escapes) for v in outputs],
            [slots(s.value, device) for s in seg if isinstance(s, Free)],
            statics, backend, name)
        out += steps[done:start]
        out.append(Call(segment, name, [n for s in seg for n in _ops(s)][-1]))
        done = end
    return out + steps[done:]

"""Routing: the vocabulary place, plan, simulate and the runtime share about where values live.

- Memory pools: ``"cpu"`` for every CPU worker (shared host memory), else the GPU's name.
- Lanes: a device's ops run on ``cpu:N`` or ``cuda:N/compute``; copies on ``d2h`` (a GPU to
  the host, the source's), ``peer`` (the source's) or, host to any GPU, the one lane
  ``cpu/h2d``: a host value is pageable memory, which the thread issuing the copy stages
  itself, so copies to two GPUs do not overlap (they run on the destination's ``h2d`` stream).
- Routes: how a consumer on one device gets a value made on another: ``local``, ``event`` (an
  ordering event only: another CPU worker, a value without a tensor, a host 0-dim tensor a GPU
  pointwise kernel takes as a scalar, a collective's part or item: see
  :mod:`autopar.ir.collective`) or ``copy`` (one copy per value and pool).
- The collectives' lane :data:`~autopar.ir.collective.COMM` is a program of its own with a
  pool of its own: its values are tuples of tensors that live on the devices they name.
- A pure device move (``x.cpu()``) whose input arrives by a copy *is* that copy.
- Host scalars (:func:`host_scalars`): Python numbers and 0-dim tensors the host can compute
  from host values, or from a 0-dim value the graph reads to the host anyway. Placement runs
  them on the host; a GPU value among their inputs is copied there once, which is the one sync
  that reading it costs.
- :class:`GraphIndex`: per-node facts looked up by every stage, computed once.

Pure functions of the graph and device names: no CUDA, no costs beyond what callers pass in.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .collective import COMM
from .graph import LOCAL_SCALAR_DENSE, Graph, Node, ScalarMeta, TensorMeta, op_kind
from .ops import is_fused_update

StorageKey = tuple[Any, ...]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (if it runs) for the block.

    Placing, planning and simulating allocate millions of small objects and no reference
    cycles; on big graphs the collector's repeated passes over the whole heap cost as much as
    the work itself (50k ops: place 11.5 s with it, 6.5 s without). Reference counting still
    frees everything; the collector's state is restored on exit.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()



_POOLS: dict[str, str] = {}


def pool(device: str) -> str:
    """Memory pool of a device: ``"cpu"`` for every CPU worker, else the GPU's name."""
    where = _POOLS.get(device)
    if where is None:
        where = _POOLS[device] = "cpu" if device.startswith("cpu") else device
    return where


_COMPUTE_LANES: dict[str, str] = {}


def compute_lane(device: str) -> str:
    """Lane of a device's ops: ``"cpu:1"``, ``"cuda:0/compute"``, or ``"comm"``."""
    lane = _COMPUTE_LANES.get(device)
    if lane is None:
        plain = device.startswith("cpu") or device == COMM
        lane = _COMPUTE_LANES[device] = device if plain else f"{device}/compute"
    return lane


def copy_stream(src: str, dst: str) -> tuple[str, str]:
    """(GPU, stream) that carries a copy: h2d of the destination, d2h or peer of the source."""
    src_cpu, dst_cpu = src.startswith("cpu"), dst.startswith("cpu")
    if src_cpu and dst_cpu:
        raise ValueError(f"no copy from {src} to {dst}: CPU workers share host memory")
    if src_cpu:
        return dst, "h2d"
    if dst_cpu:
        return src, "d2h"
    if src == dst:
        raise ValueError(f"no copy from {src} to itself")
    return src, "peer"


_COPY_LANES: dict[tuple[str, str], str] = {}


HOST_TO_GPU_LANE = "cpu/h2d"


def copy_lane(src: str, dst: str) -> str:
    """Timing lane of a copy: ``"cuda:0/d2h"``, ``"cuda:1/peer"``, or :data:`HOST_TO_GPU_LANE`
    for every copy from the host (see the module docstring; :func:`copy_stream` says which
    stream carries it)."""
    lane = _COPY_LANES.get((src, dst))
    if lane is None:
        gpu, stream = copy_stream(src, dst)
        lane = HOST_TO_GPU_LANE if stream == "h2d" else f"{gpu}/{stream}"
        _COPY_LANES[(src, dst)] = lane
    return lane


def value_bytes(node: Node) -> int:
    """Bytes of a value as a copy moves it (a view's own extent, unlike ``Node.out_bytes``)."""
    return sum(m.nbytes for m in node.tensor_metas)


_KINDS: dict[Any, str] = {}


def kind_of(op: Any) -> str:
    """``op_kind``, remembered per op (it reads the schema and tags every time)."""
    kind = _KINDS.get(op)
    if kind is None:
        kind = _KINDS[op] = op_kind(op)
    return kind


def _inputs(node: Node) -> tuple[Node, ...]:
    """``Node.inputs`` without torch's pytree, which is slow on 100k-node graphs: ATen
    arguments are nodes, constants, or flat lists of them; anything deeper takes the slow way."""
    seen: dict[Node, None] = {}
    for x in (*node.args, *node.kwargs.values()):
        if isinstance(x, Node):
            seen[x] = None
        elif isinstance(x, list | tuple):
            for y in x:
                if isinstance(y, Node):
                    seen[y] = None
                elif isinstance(y, list | tuple | dict):
                    return node.inputs
        elif isinstance(x, dict):
            return node.inputs
    return tuple(seen)


@dataclass(frozen=True)
class GraphIndex:
    """Facts about a graph that place, plan and simulate look up per node, computed once.

    ``ins[n]``: ``n.inputs``; for a random op, also the previous random op that draws from the
    same generator as eager (the host's, which all CPU workers share, or its GPU's): an
    ordering-only input, so that draws happen in eager's order and never two at once.
    ``users[n]``: its consumers (by ``ins``), in graph order. ``nbytes[n]``:
    :func:`value_bytes`. ``tensorless``: values with no tensor (never copied). ``scalars``: the
    0-dim tensors whose every consumer is a host scalar or a binary arithmetic op or comparison
    with an operand of more dimensions (:func:`takes_host_scalar`; with only 0-dim operands the
    op would run on the host), or a fused optimizer kernel's ``lr`` (:func:`reads_host_lr`):
    on the host, a GPU kernel takes them as a scalar argument, so
    they are never copied to a GPU (a property of the value, so one value reaches one pool by
    one mechanism).
    ``host``: :func:`host_scalars`, where ``host_allowed`` (placement may use a host device);
    without one no op is a host scalar, and a host value a GPU op reads is copied unless the
    op takes it as a scalar argument (a host scalar op placed on a GPU, given a host input
    uncopied, made a host tensor the plan held to be the GPU's, as ``lift_fresh_copy`` of
    AdamW's host step increment did under ``devices="cuda:0"``).
    ``passthrough``: :func:`passthrough_moves`.
    """

    ins: dict[Node, tuple[Node, ...]]
    users: dict[Node, list[Node]]
    nbytes: dict[Node, int]
    tensorless: frozenset[Node]
    scalars: frozenset[Node]
    host: frozenset[Node] = frozenset()
    passthrough: frozenset[Node] = frozenset()
    host_allowed: bool = True

    @staticmethod
    def of(graph: Graph, host_allowed: bool = True) -> GraphIndex:
        ins = {n: _inputs(n) for n in graph.nodes}
        last_draw: dict[str, Node] = {}  # generator -> its latest random op
        for n in graph.ops:
            if kind_of(n.op) == "random":
                generator = pool(home_device(n.device or "cpu"))
                before = last_draw.get(generator)
                if before is not None and before not in ins[n]:
                    ins[n] = (*ins[n], before)
                last_draw[generator] = n
        users: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
        for n in graph.nodes:
            for i in ins[n]:
                users[i].append(n)
        metas = {n: n.tensor_metas for n in graph.nodes}
        host = host_scalars(graph, ins, users) if host_allowed else frozenset()

        def scalar_argument(u: Node, n: Node) -> bool:  # u takes the host 0-dim n as a scalar
            return u in host or (takes_host_scalar(u.op) and any(
                m.shape != () for i in ins[u] for m in metas[i])) or reads_host_lr(u, n)

        scalars = frozenset(
            n for n, ms in metas.items()
            if len(ms) == 1 and ms[0].shape == () and users[n]
            and all(scalar_argument(u, n) for u in users[n]))
        return GraphIndex(ins, users, {n: sum(m.nbytes for m in ms) for n, ms in metas.items()},
                          frozenset(n for n, ms in metas.items() if not ms), scalars, host,
                          passthrough_moves(graph), host_allowed)


def index_of(placement: Any, graph: Graph | None = None) -> GraphIndex:
    """The GraphIndex of a placement's graph (or of ``graph``, if another), with the same
    ``host_allowed``: the one placing built (``placement.index``), else made now."""
    index = placement.index
    if index is None or (graph is not None and graph is not placement.graph):
        allowed = index.host_allowed if index is not None else True
        return GraphIndex.of(placement.graph if graph is None else graph, host_allowed=allowed)
    return index  # type: ignore[no-any-return]


def passthrough_moves(graph: Graph) -> frozenset[Node]:
    """Pure device moves (to another device than their input's) that, placed in their input's
    pool, may hand on the input itself instead of copying it (``x.to("cuda")`` that placement
    keeps on the host with ``x``).

    Eager's move makes a new storage; handing on the input makes the move's value share the
    input's. That is unseen only when nothing can tell: no op of the graph writes in place,
    and no graph output would newly share a storage with a graph input or with another output.
    Storage classes are followed through views and every pure move (conservative: a move that
    ends up a real copy still joins its input's class here).
    """
    if any(n.writes for n in graph.ops):
        return frozenset()
    moves = [n for n in graph.ops if is_pure_move(n) and n.device != n.args[0].device]
    if not moves:
        return frozenset()

    def root(n: Node) -> Node:
        while True:
            base = alias_base(n)
            if base is None and is_pure_move(n):
                base = n.args[0]
            if base is None:
                return n
            n = base

    outputs_of: dict[Node, int] = {}
    for o in dict.fromkeys(graph.output_nodes):
        r = root(o)
        outputs_of[r] = outputs_of.get(r, 0) + 1
    safe = set()
    for m in moves:
        r = root(m)
        shared = outputs_of.get(r, 0)
        if shared == 0 or (not r.is_input and shared == 1):
            safe.add(m)
    return frozenset(safe)




def _is_zero_dim(node: Node) -> bool:
    return isinstance(node.meta, TensorMeta) and node.meta.shape == ()


def _scalar_op(node: Node) -> bool:
    """An op that makes one 0-dim tensor, draws no random numbers and mutates nothing."""
    return (not node.is_input and _is_zero_dim(node) and not node.writes
            and kind_of(node.op) != "random")


def host_scalars(graph: Graph, ins: dict[Node, tuple[Node, ...]],
                 users: dict[Node, list[Node]]) -> frozenset[Node]:
    """Values the host computes: a Python number (:class:`~autopar.ir.graph.ScalarMeta`, e.g. a
    ``.item()``), or a 0-dim tensor op, not random, mutating nothing, each of whose inputs is a
    host scalar, a 0-dim host input, or *read* (below), and with no view wider than one
    element (``s.expand(n, m)`` stays with ``s``: the host would copy the whole extent).

    A 0-dim op without inputs (a fill) qualifies only when a consumer reads it, is a 0-dim op
    or takes it as a scalar argument: a fill only GPU kernels read otherwise (the seed gradient
    of backward, read by ``nll_loss_backward``) is made where it is used, not made on the host
    and copied over (pinned staging and a copy on the launching thread, for a 2 us fill kernel).

    A 0-dim value is *read* when every consumer is ``aten._local_scalar_dense`` or a read
    0-dim op: the host needs its value anyway, so copying it there once, early, costs the
    one sync the first read would have, and every later read and the arithmetic on it (a
    slice bound ``r0 + 256``) stay on the host with no further sync.
    """
    read: set[Node] = set()
    for n in reversed(graph.nodes):
        if _is_zero_dim(n) and users[n] and all(
                u.op is LOCAL_SCALAR_DENSE or (u in read and _scalar_op(u)) for u in users[n]):
            read.add(n)
    host: set[Node] = set()

    def on_host(v: Node) -> bool:
        return v in host or v in read or (v.is_input and _is_zero_dim(v) and v.device == "cpu")

    def widened(n: Node) -> bool:  # a view of it wider than one element: it stays with n
        return any(kind_of(u.op) == "view" and not is_tiny(u) for u in users[n])

    def wanted(n: Node) -> bool:  # a fill (no inputs) is made on the host only for a use there
        return bool(ins[n]) or any(
            u in read or u.op is LOCAL_SCALAR_DENSE or _scalar_op(u) or takes_host_scalar(u.op)
            for u in users[n])

    for n in graph.ops:
        if isinstance(n.meta, ScalarMeta) or (
                _scalar_op(n) and all(map(on_host, ins[n])) and not widened(n) and wanted(n)):
            host.add(n)
    return frozenset(host)


# Binary arithmetic and comparisons: TensorIterator reads a host 0-dim operand of a GPU kernel
# as a scalar argument. Other pointwise ops (masked_fill's mask, where's condition, clamp's
# bounds) insist on one device, so their 0-dim inputs are copied like any tensor.
_HOST_SCALAR_OPS = frozenset((
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "pow", "maximum",
    "minimum", "fmod", "remainder", "atan2", "copysign", "hypot", "eq", "ne", "lt", "le", "gt",
    "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_xor"))


def takes_host_scalar(op: Any) -> bool:
    """Can a GPU kernel of ``op`` take a host 0-dim tensor operand as a scalar argument?"""
    packet = getattr(op, "overloadpacket", None)
    return packet is not None and packet.__name__ in _HOST_SCALAR_OPS


def reads_host_lr(user: Node, value: Node) -> bool:
    """Does ``user``, a fused optimizer kernel (``_fused_adamw(..., lr=tensor)``), read
    ``value`` as its ``lr`` only? A GPU kernel reads a host ``lr`` as a number (its
    ``lr.item()``, as eager's scheduled ``lr`` reaches it); an ``lr`` copied to the GPU would
    have to be float32 (CUDA's ``tensor_lr`` kernel refuses a float64 one: "expected scalar
    type Float but found Double"), and no graph may bake a host value in."""
    return is_fused_update(user.op) and user.kwargs.get("lr") is value and \
        value not in user.args


def is_tiny(node: Node) -> bool:
    """At most one element in every output (0-dim scalars), or no tensor at all."""
    return all(m.numel <= 1 for m in node.tensor_metas)


def route(value: Node, src: str, dst: str, ix: GraphIndex) -> str:
    """How a consumer on ``dst`` gets ``value`` produced on ``src``.

    ``"local"``: same device. ``"event"``: an ordering event only (another CPU worker: shared
    memory; a value with no tensor; a host scalar argument, see :class:`GraphIndex`).
    ``"copy"``: a copy into ``dst``'s pool.
    """
    if src == dst:
        return "local"
    if src == COMM or dst == COMM or pool(src) == pool(dst) or value in ix.tensorless:
        return "event"
    if value in ix.scalars and pool(src) == "cpu":
        return "event"
    return "copy"


def copy_time(cost: Any, nbytes: int, src: str, dst: str) -> float:
    """Seconds a copy made by the executor takes: the link's time, plus, between the host and a
    GPU, the executor's fixed cost of crossing (``crossing_s`` of the profile: pinned staging,
    the event, the host's wait and a thread wake-up; 0 for cost models without).

    A copy to a GPU is priced at the pageable link's rate: a host value is a user's tensor or
    an ATen op's output, both in pageable memory, and staging it into pinned memory first
    costs the host a copy of its own (W3/512^3 on 2xH200: two 1 MB inputs took ~100 us each
    where the pinned rate says 26). A copy to the host lands in the executor's pinned memory."""
    pinned = not (pool(src) == "cpu" and pool(dst) != "cpu")
    t = float(cost.transfer_time(nbytes, src, dst, pinned=pinned))
    if t > 0 and (pool(src) == "cpu") != (pool(dst) == "cpu"):
        t += float(getattr(cost, "crossing_s", 0.0))
    return t


def handoff_time(cost: Any) -> float:
    """Seconds between one program marking a value ready (Record) and another, waiting for it,
    going on: a thread wake-up (``event_wait_s`` of the profile; 0 for cost models without)."""
    return float(getattr(cost, "event_wait_s", 0.0))


def hands_off(src: str, dst: str) -> bool:
    """Does a reader on ``dst`` of a value ``src`` marked ready wait a thread hand-off
    (:func:`handoff_time`)? Not where the collectives' lane is either end: the thread that
    launches the GPUs' work runs it, and a stream waits, no thread wakes."""
    return src != COMM and dst != COMM


def delivery_needed(value: Node, src: str, home: str) -> bool:
    """A graph output produced on ``src`` must be copied to its eager device ``home``."""
    return bool(value.tensor_metas) and pool(src) != pool(home)


_TO_COPY = torch.ops.aten._to_copy.default
_MOVE_KWARGS = {"device", "dtype", "layout", "pin_memory", "non_blocking", "memory_format"}


def is_pure_move(node: Node) -> bool:
    """``aten._to_copy`` that changes nothing but the device (``x.cpu()``, ``x.to("cuda:1")``)."""
    if node.op is not _TO_COPY or len(node.args) != 1 or set(node.kwargs) - _MOVE_KWARGS:
        return False
    (src,) = node.args
    if not isinstance(src, Node) or node.kwargs.get("pin_memory"):
        return False
    out, ins = node.tensor_metas, src.tensor_metas
    if len(out) != 1 or len(ins) != 1:
        return False
    return out[0].dtype == ins[0].dtype and out[0].stride == ins[0].stride


def is_free_move(node: Node, device_of: dict[Node, str],
                 passthrough: frozenset[Node] = frozenset()) -> bool:
    """A device move that is no op of its own on ``device_of[node]``: its input sits in another
    pool, and the copy is it; or in the same pool, and the move is in ``passthrough``
    (:attr:`GraphIndex.passthrough`): it hands on its input itself."""
    return node in device_of and free_move_on(node, device_of[node], device_of, passthrough)


def free_move_on(node: Node, device: str, device_of: dict[Node, str],
                 passthrough: frozenset[Node] = frozenset()) -> bool:
    """Would ``node``, placed on ``device``, be a free device move (:func:`is_free_move`)?
    Its input must be placed already."""
    if not is_pure_move(node):
        return False
    return pool(device_of[node.args[0]]) != pool(device) or node in passthrough


def op_time(cost: Any, node: Node, device: str, device_of: dict[Node, str],
            passthrough: frozenset[Node] = frozenset()) -> float:
    """Seconds ``node`` occupies ``device``'s lane, given where its inputs are placed."""
    if is_free_move(node, device_of, passthrough):
        return 0.0
    return float(cost.node_time(node, device))


def alias_base(node: Node) -> Node | None:
    """The node whose storage a view or ``getitem`` shares (None for other ops)."""
    if kind_of(node.op) not in ("view", "getitem"):
        return None
    if node.aliases:
        return node.aliases[0]
    ins = node.inputs
    return ins[0] if ins else None


def owns_storage(node: Node, device_of: dict[Node, str],
                 passthrough: frozenset[Node] = frozenset()) -> bool:
    """Does running ``node`` allocate a storage? Not for views, ``getitem`` and free device
    moves (:func:`is_free_move`): they share another's."""
    return alias_base(node) is None and not is_free_move(node, device_of, passthrough)


def cuda_indices(devices: Iterable[str]) -> frozenset[int]:
    """The CUDA indices among device names (``"cuda"`` is 0; CPU workers have none)."""
    return frozenset(torch.device(d).index or 0 for d in devices if d.startswith("cuda"))


def home_device(torch_device: str) -> str:
    """Machine device name of a torch device string: "cpu" -> cpu:0, "cuda" -> cuda:0."""
    if torch_device.startswith("cpu"):
        return "cpu:0"
    return "cuda:0" if torch_device == "cuda" else torch_device


def storage_of(value: Node, in_pool: str, device_of: dict[Node, str],
               passthrough: frozenset[Node] = frozenset()) -> StorageKey:
    """Key of the storage that holds ``value`` in ``in_pool`` (see Memory in the docstring).

    ``("local", n)``: op or input ``n``'s own output in the pool it was produced in (views and
    moves that hand on their input share their base's); ``("copy", v, pool)``: the copy of
    ``v`` into another pool (a device move done by a copy shares its copy's).
    """
    here = pool(device_of[value]) == in_pool
    if not here:
        return ("copy", value, in_pool)
    base = alias_base(value)
    if base is not None:
        return storage_of(base, in_pool, device_of, passthrough)
    if is_free_move(value, device_of, passthrough):
        src = value.args[0]
        if pool(device_of[src]) == in_pool:  # handed on
            return storage_of(src, in_pool, device_of, passthrough)
        return ("copy", src, in_pool)
    return ("local", value)


def pinned_storage(where: str, devices: Iterable[str]) -> bool:
    """Kept until the run ends: read from another pool (a host scalar a GPU kernel takes as an
    argument), or a host storage several CPU workers use (freeing it needs a cross-worker
    event)."""
    devices = set(devices)
    if any(pool(d) != where for d in devices):
        return True
    return where == "cpu" and len(devices) > 1

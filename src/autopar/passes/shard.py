r"""Data-parallel sharding: a Graph -> Graph pass that splits batch-parallel work over k devices.

Runs between capture and place: :func:`shard` rewrites a functional graph into one whose
batch-parallel region is copied k times, each copy (a *shard*) pinned to one device; place, plan
and the executor then run it like any other graph (the pins go to
:func:`autopar.schedule.place.place`).

Policy and invariants
- Layouts. Every value of the input graph gets one layout in the sharded graph: ``Split(dim,
  parts)``, the value is ``cat(parts, dim)`` with part i on ``devices[i]``, or ``Whole(node)``,
  one node holding the whole value (placed freely). Graph inputs named in ``batch`` start as
  ``Split`` (``aten.slice`` of the input, moved to its shard's device); every other value starts
  ``Whole``.
- Rules. An op with a ``Split`` input is split only by a rule of :data:`RULES` (elementwise
  ops with broadcasting checked, ``mm``/``addmm``, views whose batch dimension is traceable,
  softmax and log-softmax over another dimension, ``nll_loss`` forward and backward, sums).
  Anything else is *left unsplit*: its ``Split`` inputs are gathered (``cat`` on the home
  device) and it runs once on the whole value. Nothing is approximated: batch norm, ``mean``
  over the batch, unknown ops all run unsplit, exactly as eager.
- Partial sums are reduced at once. A rule that contracts the batch dimension (``mm`` of
  activation^T @ gradient, ``sum`` over the batch) makes one partial result per shard; they
  are added on the home device right after they are made (copies into the home device, then a
  chain of ``add``), so gradient reduction overlaps with the rest of backward where the graph
  allows. Summation order differs from eager's (float tolerance, never another formula).
- Gradients are reduced in buckets (as DDP does): a parameter's partial sums smaller than
  ``BUCKET_BYTES`` wait in a bucket of their dtype; once it holds that many bytes (or one of
  its values is read) each shard flattens and concatenates its partials and the bucket is
  reduced once; each gradient is a view of the bucket's sum. Buckets fill in the order
  backward makes gradients, so the first ones are reduced while backward goes on.
- Over more than two GPUs, a big partial sum is reduced scattered: row chunk c is summed on
  device c, and a device that needs the whole sum gathers the chunks from their owners
  (``2 (k-1)/k`` of the sum received per device instead of ``k-1`` copies; every copy has the
  same bits). On two devices, or for small sums, the all-to-all form above.
- Over three or more GPUs (``collectives="auto"``), every reduction is one collective instead
  (:func:`autopar.ir.collective.all_reduce`, pinned to its lane
  :data:`~autopar.ir.collective.COMM`): the partials in, the sum out on every device
  (``take(result, i)`` on device i), every copy the same bits. The copies-and-adds forms below
  cost the thread that issues every GPU's work ``k (k-1)`` copies and adds per sum; over two
  GPUs they stay (measured there: see benchmarks/NOTES.md; the collective is not measured
  yet).
- Big partial sums are made and reduced in row chunks: an ``mm`` partial of more than
  ``REDUCE_CHUNK_BYTES`` is computed as up to ``MAX_REDUCE_CHUNKS`` ``mm``\ s of row slices of
  its left operand, each chunk's partials reduced as above as soon as they are made, and the
  chunk sums concatenated. Each chunk's copy between devices then overlaps the next chunk's
  ``mm``: only the last chunk's copy is left after backward's last matmul (2xH200, W6: dW1's
  128 MB partial crossed NVLink in 350 µs after the last GEMM). Every element is the same sum of
  the same products as without chunks.
- Mean losses: ``nll_loss_forward(reduction=mean)`` becomes per-shard ``reduction=sum`` losses
  and total weights, reduced and divided once: ``sum_i s_i / sum_i w_i``, which is eager's mean
  (also with class weights and ``ignore_index``). ``nll_loss_backward`` then runs per shard with
  the global total weight, which gives eager's gradient rows exactly.
- Replicated inputs. A non-batch graph input used by a shard on another device is read from a
  *replica*: an extra graph input on that device (listed in :attr:`Sharded.replicas`), which the
  caller keeps resident between calls (see :mod:`autopar.dataparallel`).
- Whole values a shard reads are made on the shard's device where no whole value needs a copy
  for it: a reduced sum is added again there from the partials, in the same order as on home
  (an all-reduce: every device gets the same bits); views, elementwise ops, casts and fills of
  such values are repeated there. So a training step's parameter update runs on every device
  and the replicas' next values need no broadcast. Other whole values are copied by the plan.
- A value of no elements (HF attention's empty constant, concatenated with each shard's keys)
  is made on each device that reads it (``empty_strided``), never copied.
- Devices. ``devices[0]`` is the home: where eager runs the graph and where results are
  gathered and reduced. Devices of the same memory (logical CPU workers) share one tensor: no
  replica and no copy, only the pin differs. On a GPU home every op whose value lives there
  and that no rule pinned is pinned to home: what isn't split runs where eager runs it (left
  free, HEFT sent batch norm's ``num_batches_tracked += 1``, a GPU scalar a layer, to the host
  and back while home's lane was the busiest: 106 copies a ResNet-50 step over 8 GPUs).
- The input graph must be functional (no op writes a tensor in place): the pass reorders work
  across devices, and only a functional graph makes that safe without more bookkeeping.
- Uneven shards are allowed: ``sizes`` (default: as even as possible, the first ones larger)
  must sum to the batch size and be positive.

Glossary: *home* ``devices[0]``; *shard i* the nodes pinned to ``devices[i]``; *gather*
``cat`` of a Split value's parts on home; *reduce* ``add`` of partial sums on home.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..ir.collective import COMM, all_reduce, take
from ..ir.graph import INPUT, Graph, GraphError, Node, TensorMeta, op_kind
from ..ir.ops import is_fused_update

__all__ = ["MAX_REDUCE_CHUNKS", "REDUCE_CHUNK_BYTES", "RULES", "SCATTER_BYTES", "NotShardable",
           "Sharded", "Split",
           "Whole", "even_sizes", "shard"]

aten = torch.ops.aten

REDUCE_CHUNK_BYTES = 32 << 20
"""An ``mm`` partial sum larger than this is made and reduced in row chunks of about this size."""
MAX_REDUCE_CHUNKS = 4
"""...in at most this many (each chunk's ``mm`` stays big enough to keep a GPU busy)."""
BUCKET_BYTES = 25 << 20
"""Gradient sums smaller than this are reduced in buckets of about this size (as DDP's
default): one reduction per bucket instead of one per tensor."""
SCATTER_BYTES = 4 << 20
"""A partial sum over more than two devices of their own memory from this size on is reduced
scattered (a reduce-scatter, then an all-gather where the whole sum is read): below it, the
extra hop costs more than the traffic it saves."""


class NotShardable(ValueError):
    """The graph can't be sharded as asked (bad batch inputs, sizes or devices, in-place ops)."""


@dataclass(frozen=True)
class Split:
    """A batch-parallel value: ``cat(parts, dim)``, part i on ``devices[i]``."""

    dim: int
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Whole:
    """A value held whole by one node."""

    node: Any  # a Node, or a tuple-valued Node read through getitem


class _Pending:
    """A gradient sum waiting in a bucket: ``node`` is set when the bucket is reduced (when it
    is full, or when a value it holds is first read); or a view of such a value (``make``
    emits it when it is read: a gradient's ``t()`` doesn't close its bucket)."""

    __slots__ = ("make", "node")

    def __init__(self, make: Callable[[], Node] | None = None) -> None:
        self.node: Node | None = None
        self.make = make


@dataclass(frozen=True)
class Items:
    """A tuple-valued op split per shard: each item's own layout (``getitem`` reads one)."""

    items: tuple[Split | Whole, ...]


Layout = Split | Whole | Items


@dataclass
class Sharded:
    """The sharded graph and what its caller must know to run it.

    ``graph``'s inputs are the original graph's inputs, in order, then one input per entry of
    ``replicas``: ``(original input index, device)``, a copy of that input on that device.
    Its outputs are the original graph's, then the next value of each replica in
    ``replica_outputs`` (same kind of entries), made on the replica's device.
    ``pins`` fixes every shard op to its device. ``unsplit`` names the ops left unsplit and why.
    ``reduced_in_chunks``: how many partial sums are reduced in row chunks.
    """

    graph: Graph
    devices: tuple[str, ...]
    sizes: tuple[int, ...]
    pins: dict[Node, str]
    replicas: list[tuple[int, str]]
    replica_outputs: list[tuple[int, str]] = field(default_factory=list)
    unsplit: dict[str, str] = field(default_factory=dict)
    reduced_in_chunks: int = 0


def even_sizes(n: int, k: int) -> tuple[int, ...]:
    """``k`` shard sizes summing to ``n``, as even as possible (the first ones larger)."""
    if not 1 <= k <= n:
        raise NotShardable(f"cannot split a batch of {n} into {k} non-empty shards")
    q, r = divmod(n, k)
    return tuple(q + (1 if i < r else 0) for i in range(k))


def torch_device(device: str) -> str:
    """The torch device of a machine device name: cpu:1 -> cpu, cuda:1 -> cuda:1."""
    return "cpu" if device.startswith("cpu") else device


# -- the rewriting context -----------------------------------------------------------------------
class _Builder:
    """Emits the sharded graph; holds layouts, replicas, gathers and per-device views."""

    def __init__(self, src: Graph, devices: Sequence[str], sizes: Sequence[int],
                 collectives: bool = False) -> None:
        self.src = src
        self.collectives = collectives
        self.devices = tuple(devices)
        self.sizes = tuple(sizes)
        self.home = torch_device(devices[0])
        self.out = Graph(f"{src.name}_x{len(devices)}" if len(devices) > 1 else src.name)
        self.layout: dict[Node, Layout] = {}
        self.pins: dict[Node, str] = {}
        self.unsplit: dict[str, str] = {}
        self.replicas: list[tuple[int, str]] = []
        self._replica_nodes: dict[tuple[Node, str], Node] = {}  # (src input, device) -> input
        self._local: dict[tuple[Node, int], Node] = {}  # (src node, shard) -> shard-local copy
        self._gathered: dict[Node, Node] = {}
        self._scattered: dict[tuple, Split] = {}
        self._local_new: dict[tuple[Node, int], Node] = {}
        self._owned: set[Node] = set()  # sums reduced scattered (their chunks: _chunks)
        self.bucket_bytes = BUCKET_BYTES
        self._open: dict[Any, list[tuple[_Pending, Sequence[Node]]]] = {}  # dtype -> bucket
        self._bucket_views: dict[Node, tuple[Node, int, int, list[int]]] = {}
        self._partials: dict[Node, tuple[Node, ...]] = {}  # reduced sum -> its partials
        self._collective: dict[Node, Node] = {}  # home's item of an all_reduce -> the op
        self._chunks: dict[Node, tuple[Node, ...]] = {}  # cat of reduced chunks -> the chunks
        self.reduce_chunks: int | None = None  # at most this many chunks (None: the default)
        self.batch_inputs: dict[Node, Node] = {}  # split graph input -> the whole input
        self.source_inputs: dict[Node, Node] = {}  # this graph's input -> the source's
        self._can_local: dict[Node, bool] = {}
        self.users = src.users()

    # -- emitting ------------------------------------------------------------------------------
    def call(self, op: Any, args: tuple, kwargs: dict | None = None, *, shard: int | None = None,
             like: Node | None = None, part: str = "", same: bool = False) -> Node:
        """Append an op; a shard's op is pinned to its device, and its value lives there
        (inputs from elsewhere are copied in by the plan). ``part`` tells apart several
        nodes made for one source node (``_c1``: its second chunk); ``same``: the op makes
        ``like``'s value again (its metadata and FLOPs, on the shard's device)."""
        name = "" if like is None else like.name + part if shard is None \
            else f"{like.name}{part}_s{shard}"
        node = self.out.call(op, args, kwargs or {}, name=name,
                             source=like.source if like is not None else None,
                             meta=like.meta if same and like is not None else None,
                             flops=like.flops if same and like is not None else None)
        if shard is not None:
            self.pins[node] = self.devices[shard]
            node.meta = _on(node.meta, torch_device(self.devices[shard]))
        return node

    def to_device(self, node: Node, shard: int) -> Node:
        """``node`` moved to shard's device (no move between devices of one memory)."""
        dev = torch_device(self.devices[shard])
        if node.device == dev:
            return node
        return self.call(aten._to_copy.default, (node,), {"device": torch.device(dev)},
                         shard=shard)

    def to_home(self, node: Node) -> Node:
        if node.device == self.home:
            return node
        return self.call(aten._to_copy.default, (node,), {"device": torch.device(self.home)})

    def whole(self, src: Node) -> Node:
        """The whole value of ``src`` (gathering a Split value once, on home)."""
        lay = self.layout[src]
        if isinstance(lay, Whole):
            return self._resolve(lay)
        got = self._gathered.get(src)
        if got is None:
            parts = [self.to_home(p) for p in lay.parts]
            got = self._gathered[src] = self.call(aten.cat.default, (parts, lay.dim), like=src)
        return got

    def scatter(self, src: Node, dim: int, rows: Sequence[int]) -> Split:
        """A Whole value of ``src`` cut along ``dim`` into shards of ``rows`` (slices on home,
        each moved to its shard's device): a mask or an expanded parameter made whole meets
        a Split value of the same batch."""
        key = (src, dim, tuple(rows))
        got = self._scattered.get(key)
        if got is None:
            whole, parts, start = self.whole(src), [], 0
            for i, n in enumerate(rows):
                view = self.call(aten.slice.Tensor, (whole, dim, start, start + n), like=src,
                                 part=f"_cut{i}")
                parts.append(self.to_device(view, i) if i else view)
                start += n
            got = self._scattered[key] = Split(dim, tuple(parts))
        return got

    def _resolve(self, lay: Whole) -> Any:
        """A Whole layout's node; a gradient sum still in its bucket is reduced now."""
        node = lay.node
        if isinstance(node, _Pending):
            if node.node is None:
                if node.make is not None:
                    node.node = node.make()
                else:
                    self.flush()
            return node.node
        return node

    def reduce_later(self, parts: Sequence[Node]) -> Node | _Pending:
        """:meth:`reduce` for a gradient sum, which may wait in a bucket (see the module
        docstring): small sums of one dtype are flattened and reduced together once the
        bucket holds ``bucket_bytes`` or one of its values is read."""
        m = parts[0].meta
        if (not self.bucket_bytes or len(parts) < 2 or not isinstance(m, TensorMeta)
                or m.nbytes >= self.bucket_bytes):
            return self.reduce(parts)
        pending = _Pending()
        bucket = self._open.setdefault(m.dtype, [])
        bucket.append((pending, parts))
        if sum(ps[0].meta.nbytes for _, ps in bucket) >= self.bucket_bytes:
            self._flush(m.dtype)
        return pending

    def flush(self) -> None:
        """Reduce every open bucket."""
        for dtype in list(self._open):
            self._flush(dtype)

    def _flush(self, dtype: Any) -> None:
        members = self._open.pop(dtype)
        if len(members) == 1:
            pending, parts = members[0]
            pending.node = self.reduce(parts)
            return
        flats = []
        for i in range(len(self.devices)):
            views = [self.call(aten.reshape.default, (parts[i], [-1]), shard=i)  # any strides
                     for _, parts in members]
            flats.append(self.call(aten.cat.default, (views, 0), shard=i))
        total, start = self.reduce(flats), 0
        for pending, parts in members:
            shape = list(parts[0].meta.shape)
            n = math.prod(shape)
            piece = self.call(aten.slice.Tensor, (total, 0, start, start + n), shard=0)
            pending.node = self.call(aten.view.default, (piece, shape), shard=0)
            self._bucket_views[pending.node] = (total, start, n, shape)
            start += n

    def item(self, tuple_node: Node, k: int, shard: int) -> Node:
        """Item ``k`` of a tuple-valued shard node, on the shard."""
        got = self.call(operator.getitem, (tuple_node, k), shard=shard)
        got.meta = tuple_node.meta[k]
        return got

    def reduce(self, parts: Sequence[Node], pin: bool = False) -> Node:
        """Sum of per-shard partial results, on home (remembered: :meth:`local` adds them
        again on a shard that needs the sum, in the same order, so every copy is identical);
        ``pin``: the adds pinned to home (small sums a rule goes on computing with there).
        A big sum over more than two devices of their own memory is reduced scattered
        (:meth:`_reduce_scattered`)."""
        m = parts[0].meta
        if self.collectives and len(parts) > 1:
            return self._all_reduce(parts)
        if (len(parts) > 2 and isinstance(m, TensorMeta) and m.nbytes >= SCATTER_BYTES
                and m.shape and m.shape[0] >= len(parts)
                and len({torch_device(d) for d in self.devices}) == len(self.devices)):
            return self._reduce_scattered(parts)
        total = self.to_home(parts[0])
        for p in parts[1:]:
            total = self.call(aten.add.Tensor, (total, self.to_home(p)),
                              shard=0 if pin else None)
        self._partials[total] = tuple(parts)
        return total

    def _all_reduce(self, parts: Sequence[Node]) -> Node:
        """The partials' sum as one collective on its lane; home's item (shard 0's device)."""
        op = self.out.call(all_reduce, tuple(parts), meta=tuple(p.meta for p in parts),
                           flops=0, name=f"{parts[0].name}_all_reduce")
        self.pins[op] = COMM
        total = self._take(op, 0)
        self._partials[total] = tuple(parts)
        self._collective[total] = op
        return total

    def _take(self, op: Node, shard: int) -> Node:
        """Item ``shard`` of a collective's value, on that shard's device."""
        got = self.out.call(take, (op, shard), meta=op.meta[shard], flops=0,
                            name=f"{op.name}_{shard}")
        self.pins[got] = self.devices[shard]
        return got

    def local(self, src: Node, shard: int) -> Node:
        """A Whole value of ``src`` as shard ``shard`` reads it, made on the shard's device
        where that needs no copy of a whole value (see :meth:`_localizable`), else the whole
        node itself (the plan copies it)."""
        lay = self.layout[src]
        assert isinstance(lay, Whole)
        dev = torch_device(self.devices[shard])
        node = lay.node
        if isinstance(node, Node) and isinstance(node.meta, TensorMeta) \
                and node.meta.numel == 0 and node.device != dev:
            key = (src, shard)  # no elements: made where it is read, nothing to copy
            if key not in self._local:
                m = node.meta
                self._local[key] = self.call(
                    aten.empty_strided.default, (list(m.shape), list(m.stride)),
                    {"dtype": m.dtype, "device": torch.device(dev)}, shard=shard, like=src,
                    part="_empty")
            return self._local[key]
        if shard == 0 or dev == self.home:
            return self._resolve(lay)
        key = (src, shard)
        got = self._local.get(key)
        if got is None:
            got = self._local[key] = self._make_local(src, shard)
        return got

    def _make_local(self, src: Node, shard: int) -> Node:
        node = self._resolve(self.layout[src])
        dev = torch_device(self.devices[shard])
        if node in self._bucket_views:  # a gradient reduced in a bucket: the bucket's sum here
            total, start, n, shape = self._bucket_views[node]
            here = self.call(aten.slice.Tensor, (self.local_value(total, shard), 0, start,
                                                 start + n), shard=shard)
            return self.call(aten.view.default, (here, shape), shard=shard, like=src)
        if self._read_as_is(node):  # a host number: every GPU reads it as it is
            return node
        if src.is_input:
            return self._replica(src, self.devices[shard])
        if isinstance(node, Node) and self.rule_item(src):
            return self.local_value(node, shard)  # a rule's item (batch norm's mean, invstd)
        if not self._localizable(src):
            return node
        # the home copy runs on home's device too: the same kernels on the same kind of device
        # give every copy the same bits (the host's could differ in the last place)
        self.pins.setdefault(node, self.devices[0])
        if node in self._partials:  # a reduced sum: add the partials again here (an all-reduce)
            return self._sum_here(node, shard)
        if node in self._owned:  # reduced scattered: the chunks from their owners
            return self._gathered_here(node, shard)
        chunks = self._chunks.get(node)
        if chunks is not None:  # reduced in chunks: each chunk's sum again here, then the cat
            self.pins.update(dict.fromkeys(chunks, self.devices[0]))
            return self.call(aten.cat.default, ([self._sum_here(c, shard) for c in chunks], 0),
                             shard=shard, like=src)
        if _is_fill(node):  # the value is known without its source's inputs
            return self.call(node.op, node.args, {**node.kwargs, "device": torch.device(dev)},
                             shard=shard, like=src)
        args, kwargs = map_nodes(lambda x: self.local(x, shard), (src.args, src.kwargs))
        if isinstance(kwargs.get("device"), torch.device):
            kwargs["device"] = torch.device(dev)
        return self.call(src.op, args, kwargs, shard=shard, like=src, same=True)

    def _reduce_scattered(self, parts: Sequence[Node]) -> Node:
        """As a reduce-scatter then an all-gather: row chunk c of the sum is added on device
        c from the shards' slices (in shard order), and every device that needs the whole sum
        concatenates the chunks copied from their owners. Each device receives ``2 (k-1)/k``
        of the sum, not ``k-1`` copies of it; every copy has the same bits (one addition per
        chunk, then copies)."""
        k, rows = len(parts), parts[0].meta.shape[0]
        totals, start = [], 0
        for c, n in enumerate(even_sizes(rows, k)):
            pieces = [self.call(aten.slice.Tensor, (p, 0, start, start + n), shard=i)
                      for i, p in enumerate(parts)]
            total = self.to_device(pieces[0], c)
            for i in range(1, k):
                total = self.call(aten.add.Tensor, (total, self.to_device(pieces[i], c)),
                                  shard=c)
            totals.append(total)
            start += n
        whole = self.call(aten.cat.default, ([self.to_home(t) for t in totals], 0), shard=0)
        self._chunks[whole] = tuple(totals)
        self._owned.add(whole)
        return whole

    def _gathered_here(self, whole: Node, shard: int) -> Node:
        """A scattered sum on ``shard``: its chunks copied from their owners, concatenated."""
        return self.call(aten.cat.default, ([self.to_device(t, shard)
                                             for t in self._chunks[whole]], 0), shard=shard)

    def local_value(self, node: Node, shard: int) -> Node:
        """A value as shard ``shard`` reads it: a source node's by :meth:`local`; a node a
        rule made (a reduced sum, arithmetic on such sums on home) made again on the shard's
        device from the same partials, else the node itself (the plan copies it)."""
        if node in self.layout:
            return self.local(node, shard)
        if shard == 0 or torch_device(self.devices[shard]) == self.home:
            return node
        source = self.source_inputs.get(node)
        if source is not None and isinstance(self.layout.get(source), Whole):
            return self.local(source, shard)  # a graph input read whole: its replica
        key = (node, shard)
        got = self._local_new.get(key)
        if got is None:
            if node in self._partials:
                got = self._sum_here(node, shard)
            elif node in self._owned:
                got = self._gathered_here(node, shard)
            elif node.op in _REMADE and node.inputs:
                args = tuple(self.local_value(a, shard) if isinstance(a, Node) else a
                             for a in node.args)
                got = self.call(node.op, args, node.kwargs, shard=shard)
            else:
                got = node
            self._local_new[key] = got
        return got

    def _sum_here(self, total: Node, shard: int) -> Node:
        """The reduced sum ``total`` added again on shard's device, from the same partials in
        the same order: the same bits as home's."""
        op = self._collective.get(total)
        if op is not None:
            return self._take(op, shard)
        parts = self._partials[total]
        here = self.to_device(parts[0], shard)
        for p in parts[1:]:
            here = self.call(aten.add.Tensor, (here, self.to_device(p, shard)), shard=shard)
        return here

    def _localizable(self, src: Node) -> bool:
        """Can every shard make ``src`` itself from values it has (replicas, reduced sums, other
        such values) rather than receive a copy? Only for views, elementwise ops, casts and
        fills (no random ops, no FLOPs): the same op on the same values gives the same result
        on every device of a kind, and costs less than copying it."""
        got = self._can_local.get(src)
        if got is None:
            lay = self.layout.get(src)
            node = self._resolve(lay) if isinstance(lay, Whole) else None
            if node is None:
                got = False
            elif self._read_as_is(node):
                got = True
            elif self.rule_item(src):
                got = True  # a rule's item (batch norm's reduced sums): see _make_local
            elif _is_foreach(src.op) and not src.writes:
                # an optimizer's update runs on every shard: an input no shard can make
                # (GPT-2's position-embedding gradient, from embedding_dense_backward) is
                # copied to it, one tensor, not the update's every output broadcast
                got = True
            elif node in self._partials or node in self._chunks or node in self._bucket_views \
                    or (src.is_input and src.device == self.home) \
                    or _is_fill(node):  # _fill's ones_like: made on each device
                got = True
            else:
                kind = op_kind(src.op)
                got = (not src.is_input and src.flops == 0 and not src.writes
                       and (kind in ("view", "pointwise", "copy", "getitem")
                            or _is_foreach(src.op)  # an optimizer's update, per list
                            or (kind == "other" and not src.inputs))  # a fill
                       and all(self._localizable(i) for i in src.inputs))
            self._can_local[src] = got
        return got

    def rule_item(self, src: Node) -> bool:
        """Is source node ``src`` an item of a tuple a rule laid out as :class:`Items`?"""
        return src.op is operator.getitem and isinstance(self.layout.get(src.args[0]), Items)

    def _read_as_is(self, node: Node) -> bool:
        """A value on the host of at most one element (a Python number, a step count) that
        shards on GPUs read from there (an argument, or a copy of a few bytes): an optimizer's
        bias corrections, computed on the host from its step counts, are not made again per
        GPU, and the update that reads them is (not broadcast)."""
        return self.home != "cpu" and node.device in (None, "cpu") and all(
            m.numel <= 1 for m in node.tensor_metas)

    def _replica(self, src: Node, device: str) -> Node:
        key = (src, device)
        got = self._replica_nodes.get(key)
        if got is None:
            # graph inputs precede ops: shard() moves replicas among the inputs at the end
            meta = _on(src.meta, torch_device(device))
            got = self._replica_nodes[key] = Node(-1, INPUT, meta=meta, name=f"{src.name}@{device}")
            self.replicas.append((src.id, device))
        return got


def _is_foreach(op: Any) -> bool:
    """``torch._foreach_*`` ops: pointwise over lists of tensors (norms: per tensor); and a
    fused optimizer's update (``_fused_adamw``: one kernel over the same lists)."""
    return is_fused_update(op) or (isinstance(op, torch._ops.OpOverload)
                                   and op._schema.name.startswith("aten::_foreach_"))


_REMADE = frozenset({aten.div.Tensor, aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor,
                     aten.neg.default, aten.rsqrt.default, aten._to_copy.default,
                     aten.slice.Tensor})
"""Ops :meth:`_Builder.local_value` makes again on a shard from values it has (a rule's
arithmetic on reduced sums): the same op on the same values gives the same bits there."""


def _on(meta: Any, device: str) -> Any:
    if isinstance(meta, TensorMeta):
        return replace(meta, device=device)
    if isinstance(meta, tuple):
        return tuple(_on(m, device) for m in meta)
    return meta


# -- rules ---------------------------------------------------------------------------------------
Rule = Callable[[_Builder, Node], "Layout | None"]
"""A rule splits one op across the shards, or returns None (the op is then left unsplit)."""


def _ndim(n: Any) -> int:
    return len(n.meta.shape) if isinstance(n, Node) and isinstance(n.meta, TensorMeta) else 0


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _rows(s: Split) -> list[int]:
    """Each shard's size along a Split value's dim."""
    return [p.meta.shape[s.dim] for p in s.parts]


def _split_of(b: _Builder, x: Any) -> Split | None:
    if isinstance(x, Node):
        lay = b.layout.get(x)
        if isinstance(lay, Split):
            return lay
    return None


def map_nodes(fn: Callable[[Node], Any], x: Any) -> Any:
    """``x`` with each node in it replaced by ``fn(node)``, through lists, tuples and dicts
    (an op's arguments: what pytree's ``tree_map`` does for them; sharding GPT-2 small's step
    over 2, 4 and 8 GPUs took 2.31 s with it, 1.82 s with this, on the 2-core VM)."""
    if isinstance(x, Node):
        return fn(x)
    if type(x) is list or type(x) is tuple:
        return type(x)(map_nodes(fn, v) for v in x)
    if type(x) is dict:
        return {k: map_nodes(fn, v) for k, v in x.items()}
    return x


def _map_args(b: _Builder, node: Node, shard: int,
              replace: dict[int, Any] | None = None) -> tuple[tuple, dict]:
    """``node``'s arguments for shard ``shard``: Split values by their part, Whole by ``local``."""
    def one(x: Any) -> Any:
        if not isinstance(x, Node):
            return x
        lay = b.layout[x]
        return lay.parts[shard] if isinstance(lay, Split) else b.local(x, shard)

    args = tuple(map_nodes(one, a) if i not in (replace or {}) else replace[i]
                 for i, a in enumerate(node.args))
    return args, map_nodes(one, node.kwargs)


def _per_shard(b: _Builder, node: Node, dim: int,
               replace: Callable[[int], dict] | None = None) -> Split:
    """``node`` once per shard on its part of each Split input (``replace(i)``: arguments to
    change for shard i, by position); the result is Split along ``dim``."""
    parts = []
    for i in range(len(b.devices)):
        args, kwargs = _map_args(b, node, i, replace(i) if replace else None)
        parts.append(b.call(node.op, args, kwargs, shard=i, like=node))
    return Split(dim, tuple(parts))


def _reduced(b: _Builder, node: Node) -> Whole:
    """Per-shard partial results of ``node``, summed on home (in a bucket, maybe)."""
    return Whole(b.reduce_later(_per_shard(b, node, 0).parts))


def _elementwise(b: _Builder, node: Node) -> Layout | None:
    """Broadcasting elementwise op: every Split input on the same output dim, full size there;
    every other tensor input broadcast (size 1 or absent) along it."""
    out = node.meta
    if not isinstance(out, TensorMeta):
        return None
    nd = len(out.shape)
    out_dim = None
    for x in node.inputs:
        s = _split_of(b, x)
        if s is None:
            continue
        d = s.dim + nd - _ndim(x)
        if (out_dim is not None and d != out_dim) or x.meta.shape[s.dim] != out.shape[d]:
            return None
        out_dim = d
    if out_dim is None:
        return None
    rows = next(_rows(s) for x in node.inputs if (s := _split_of(b, x)) is not None)
    cut: dict[int, Node] = {}
    for k, x in enumerate(node.args):
        if isinstance(x, Node) and _split_of(b, x) is None and isinstance(x.meta, TensorMeta):
            d = out_dim - (nd - _ndim(x))
            if d >= 0 and x.meta.shape[d] == out.shape[out_dim]:  # the whole batch: cut it
                cut[k] = b.scatter(x, d, rows)
            elif d >= 0 and x.meta.shape[d] != 1:
                return None
    if not cut:
        return _per_shard(b, node, out_dim)
    return _per_shard(b, node, out_dim, replace=lambda i: {k: c.parts[i] for k, c in cut.items()})


def _same(b: _Builder, node: Node) -> Layout | None:
    """Unary ops that keep the layout (detach, clone, alias, *_like)."""
    s = _split_of(b, node.args[0])
    return _per_shard(b, node, s.dim) if s is not None and len(node.inputs) == 1 else None


def _transpose2d(b: _Builder, node: Node) -> Layout | None:
    s = _split_of(b, node.args[0])
    return _per_shard(b, node, 1 - s.dim) if s is not None and _ndim(node.args[0]) == 2 else None


def _transpose(b: _Builder, node: Node) -> Layout | None:
    x, d0, d1 = node.args[:3]
    s = _split_of(b, x)
    if s is None:
        return None
    nd = _ndim(x)
    d0, d1 = _dim(d0, nd), _dim(d1, nd)
    dim = {d0: d1, d1: d0}.get(s.dim, s.dim)
    return _per_shard(b, node, dim)


def _reshape(b: _Builder, node: Node) -> Layout | None:
    """A view/reshape keeps the batch split where every shard boundary (a row of the batch dim)
    falls on an index boundary of one output dim with the same dims before it: the batch dim
    kept, merged with the dims after it (``(B, H, L) -> (B*H, L)``) or split back."""
    x = node.args[0]
    s = _split_of(b, x)
    if s is None or not isinstance(node.meta, TensorMeta):
        return None
    ins, outs = list(x.meta.shape), list(node.meta.shape)
    before = math.prod(ins[:s.dim])
    inner = math.prod(ins[s.dim + 1:])
    rows = _rows(s)
    for d in range(len(outs)):
        if math.prod(outs[:d]) != before:
            continue
        out_inner = math.prod(outs[d + 1:])
        if out_inner == 0 or any(r * inner % out_inner for r in rows):
            continue
        if sum(r * inner // out_inner for r in rows) != outs[d]:
            continue

        def shard_shape(i: int, d: int = d, out_inner: int = out_inner) -> dict:
            return {1: [*outs[:d], rows[i] * inner // out_inner, *outs[d + 1:]]}
        return _per_shard(b, node, d, replace=shard_shape)
    return None


def _mm(b: _Builder, node: Node) -> Layout | None:
    a, w = node.args[:2]
    sa, sw = _split_of(b, a), _split_of(b, w)
    if sa is not None and sw is None and sa.dim == 0:
        return _per_shard(b, node, 0)
    if sa is None and sw is not None and sw.dim == 1:
        return _per_shard(b, node, 1)
    if sa is not None and sw is not None and sa.dim == 1 and sw.dim == 0:
        return _reduced_in_chunks(b, node)  # activation^T @ gradient: a sum over the batch
    return None


def _reduced_in_chunks(b: _Builder, node: Node) -> Whole:
    """``mm``'s per-shard partial sums reduced in row chunks where they are big (see the
    module docstring), else at once."""
    rows = node.meta.shape[0]
    most = MAX_REDUCE_CHUNKS if b.reduce_chunks is None else b.reduce_chunks
    n = min(most, rows, -(-node.meta.nbytes // REDUCE_CHUNK_BYTES))
    if n <= 1 or len(b.devices) == 1:
        return _reduced(b, node)
    bounds = even_sizes(rows, n)
    totals, start = [], 0
    for c, size in enumerate(bounds):
        parts = []
        for i in range(len(b.devices)):
            (a, w), _ = _map_args(b, node, i)
            rows_c = b.call(aten.slice.Tensor, (a, 0, start, start + size), shard=i, like=node,
                            part=f"_rows{c}")
            parts.append(b.call(aten.mm.default, (rows_c, w), shard=i, like=node,
                                part=f"_c{c}"))
        totals.append(b.reduce(parts))
        start += size
    whole = b.call(aten.cat.default, (totals, 0), like=node)
    b._chunks[whole] = tuple(totals)
    return Whole(whole)


def _addmm(b: _Builder, node: Node) -> Layout | None:
    bias, a, w = node.args[:3]
    if node.kwargs or _split_of(b, bias) is not None or _split_of(b, w) is not None:
        return None
    sa = _split_of(b, a)
    if sa is None or sa.dim != 0 or (_ndim(bias) == 2 and bias.meta.shape[0] != 1):
        return None
    return _per_shard(b, node, 0)


def _softmax(b: _Builder, node: Node) -> Layout | None:
    x, dim = node.args[:2]
    s = _split_of(b, x)
    return _per_shard(b, node, s.dim) if s is not None and _dim(dim, _ndim(x)) != s.dim else None


def _softmax_backward(b: _Builder, node: Node) -> Layout | None:
    g, out, dim = node.args[:3]
    sg, so = _split_of(b, g), _split_of(b, out)
    if sg is None or so is None or sg.dim != so.dim or _dim(dim, _ndim(g)) == sg.dim:
        return None
    return _per_shard(b, node, sg.dim)


def _sum_dims(b: _Builder, node: Node) -> Layout | None:
    x = node.args[0]
    s = _split_of(b, x)
    if s is None or node.kwargs.get("dtype") is not None:
        return None
    nd = _ndim(x)
    dims = node.args[1] if len(node.args) > 1 else None
    keep = bool(node.args[2]) if len(node.args) > 2 else False
    dims = list(range(nd)) if not dims else [_dim(d, nd) for d in dims]
    if s.dim in dims:
        return _reduced(b, node)
    return _per_shard(b, node, s.dim if keep else s.dim - sum(d < s.dim for d in dims))


def _sum_all(b: _Builder, node: Node) -> Layout | None:
    return _reduced(b, node) if _split_of(b, node.args[0]) is not None else None


_MEAN, _SUM = 1, 2


@dataclass
class _NllParts:
    """``nll_loss_forward`` split: per-shard (sum, total weight), the original reduction, and
    the reduced totals once made (index 0: loss sum, 1: total weight)."""

    parts: tuple[Node, ...]
    reduction: int
    totals: dict[int, Node] = field(default_factory=dict)


def _nll_forward(b: _Builder, node: Node) -> Any:
    x, target, weight, reduction, ignore_index = node.args[:5]
    sx, st = _split_of(b, x), _split_of(b, target)
    if (sx is None or st is None or sx.dim != 0 or st.dim != 0 or _ndim(x) != 2
            or reduction not in (_MEAN, _SUM) or _split_of(b, weight) is not None
            or any(u.op is not operator.getitem for u in b.users[node])):
        return None
    split = _per_shard(b, node, 0, replace=lambda i: {3: _SUM})
    nll = _NllParts(split.parts, reduction)
    if weight is None:
        # the total weight is the count of targets not ignored: known from the targets alone,
        # so backward need not wait for every shard's forward (from the whole targets when
        # they are a graph input, ready at once). Pinned where the targets are: counted on the
        # host, it needs a blocking copy of them on the thread that launches the GPUs' work
        # (2xH200, W6: both first GEMMs ~1 ms later)
        whole = b.batch_inputs.get(target)
        counts = []
        for i, t in enumerate(st.parts) if whole is None else [(0, whole)]:
            kept = b.call(aten.ne.Scalar, (t, ignore_index), shard=i)
            n = b.call(aten.sum.default, (kept,), shard=i)
            counts.append(b.call(aten._to_copy.default, (n,), {"dtype": x.meta.dtype}, shard=i))
        nll.totals[1] = b.reduce(counts) if len(counts) > 1 else counts[0]
    return nll


def _nll_getitem(b: _Builder, node: Node, nll: _NllParts) -> Layout:
    def total(k: int) -> Node:
        if k not in nll.totals:
            items = [b.call(operator.getitem, (p, k), shard=i) for i, p in enumerate(nll.parts)]
            nll.totals[k] = b.reduce(items)
        return nll.totals[k]

    if node.args[1] == 1 or nll.reduction == _SUM:
        return Whole(total(node.args[1]))
    return Whole(b.call(aten.div.Tensor, (total(0), total(1)), like=node))


def _nll_backward(b: _Builder, node: Node) -> Layout | None:
    g, x, target, weight, reduction = node.args[:5]
    sx, st = _split_of(b, x), _split_of(b, target)
    if (sx is None or st is None or sx.dim != 0 or st.dim != 0 or _ndim(x) != 2
            or reduction not in (_MEAN, _SUM) or _split_of(b, g) is not None
            or _split_of(b, weight) is not None or _split_of(b, node.args[6]) is not None):
        return None
    return _per_shard(b, node, 0)  # the global total weight makes each row eager's


def _dims_kept(b: _Builder, node: Node, dim_of: Callable[[int], int | None],
               replace: Callable[[int], dict] | None = None) -> Layout | None:
    """A view or reshuffle of one Split input whose batch dim ``s.dim`` lands on
    ``dim_of(s.dim)`` (None: the op touches the batch dim, left unsplit)."""
    s = _split_of(b, node.args[0])
    if s is None or any(_split_of(b, x) is not None for x in node.inputs[1:]):
        return None
    d = dim_of(s.dim)
    return None if d is None else _per_shard(b, node, d, replace)


def _unsqueeze(b: _Builder, node: Node) -> Layout | None:
    d = _dim(node.args[1], _ndim(node.args[0]) + 1)
    return _dims_kept(b, node, lambda s: s + 1 if d <= s else s)


def _squeeze(b: _Builder, node: Node) -> Layout | None:
    dims = node.args[1] if len(node.args) > 1 else None
    nd = _ndim(node.args[0])
    dims = [dims] if isinstance(dims, int) else list(dims or range(nd))
    dims = [_dim(d, nd) for d in dims if node.args[0].meta.shape[_dim(d, nd)] == 1]
    return _dims_kept(b, node, lambda s: None if s in dims else s - sum(d < s for d in dims))


def _permute(b: _Builder, node: Node) -> Layout | None:
    order = [_dim(d, _ndim(node.args[0])) for d in node.args[1]]
    return _dims_kept(b, node, lambda s: order.index(s))


def _expand(b: _Builder, node: Node) -> Layout | None:
    x, size = node.args[:2]
    lead = len(size) - _ndim(x)

    def dim_of(s: int) -> int | None:
        return s + lead if size[s + lead] in (-1, x.meta.shape[s]) else None

    def rows(i: int) -> dict:
        s = _split_of(b, x)
        new = list(size)
        new[s.dim + lead] = s.parts[i].meta.shape[s.dim]
        return {1: new}
    return _dims_kept(b, node, dim_of, rows)


def _slice(b: _Builder, node: Node) -> Layout | None:
    d = _dim(node.args[1] if len(node.args) > 1 else 0, _ndim(node.args[0]))
    return _dims_kept(b, node, lambda s: None if s == d else s)


def _select(b: _Builder, node: Node) -> Layout | None:
    d = _dim(node.args[1], _ndim(node.args[0]))
    return _dims_kept(b, node, lambda s: None if s == d else s - (d < s))


def _pad(b: _Builder, node: Node) -> Layout | None:
    pad = node.args[1]
    nd = _ndim(node.args[0])
    padded = {nd - 1 - k // 2 for k, p in enumerate(pad) if p}  # pairs from the last dim
    return _dims_kept(b, node, lambda s: None if s in padded else s)


def _split_tuple(b: _Builder, node: Node) -> Layout | None:
    """``split``/``chunk`` along another dim: each piece keeps the batch dim."""
    x = node.args[0]
    s = _split_of(b, x)
    d = _dim(node.args[2] if len(node.args) > 2 else 0, _ndim(x))
    if s is None or s.dim == d or not isinstance(node.meta, tuple):
        return None
    return _items(b, node, ["split"] * len(node.meta), s.dim)


def _backward_of_view(b: _Builder, node: Node) -> Layout | None:
    """``slice_backward``/``select_backward``(grad, input_sizes, dim, ...): the batch dim of
    the input, not the viewed one; sizes made the shard's."""
    g, sizes, d = node.args[:3]
    s = _split_of(b, g)
    nd = len(sizes)
    d = _dim(d, nd)
    if s is None:
        return None
    out = s.dim + (node.op is aten.select_backward.default and d <= s.dim)
    if out == d:
        return None

    def rows(i: int) -> dict:
        new = list(sizes)
        new[out] = s.parts[i].meta.shape[s.dim]
        return {1: new}
    return _per_shard(b, node, out, rows)


def _cat(b: _Builder, node: Node) -> Layout | None:
    """``cat`` of Split values along another dim; a Whole value of the whole batch among them
    (an expanded class token) is cut per shard; an empty 1-d value (a cache begun as
    ``torch.tensor([])``, which ``cat`` skips) goes to every shard as it is."""
    xs, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
    real = [x for x in xs if not (isinstance(x, Node) and x.meta.shape == (0,))]
    splits = [s for x in real if (s := _split_of(b, x)) is not None]
    if not splits or len({s.dim for s in splits}) != 1:
        return None
    dim, rows = splits[0].dim, _rows(splits[0])
    if _dim(d, _ndim(real[0])) == dim:
        return None
    full = sum(rows)
    pieces = []
    for x in xs:
        if x in real and _split_of(b, x) is None:
            if x.meta.shape[dim] != full:
                return None
            pieces.append(b.scatter(x, dim, rows))
        else:
            pieces.append(_split_of(b, x) or x)
    parts = []
    for i in range(len(b.devices)):
        here = [p.parts[i] if isinstance(p, Split) else b.local(p, i) for p in pieces]
        parts.append(b.call(node.op, (here, *node.args[1:]), node.kwargs, shard=i, like=node))
    return Split(dim, tuple(parts))


def _cast(b: _Builder, node: Node) -> Layout | None:
    """``_to_copy`` that changes the dtype (or nothing) on the value's own device: per shard,
    each on its shard's device; a move to another device is left to the plan (unsplit)."""
    x = node.args[0]
    s = _split_of(b, x)
    if s is None or len(node.inputs) != 1 or ("device" in node.kwargs and
                                             str(node.kwargs["device"]) != x.device):
        return None
    parts = []
    for i, part in enumerate(s.parts):
        kwargs = dict(node.kwargs)
        if "device" in kwargs:
            kwargs["device"] = torch.device(torch_device(b.devices[i]))
        parts.append(b.call(node.op, (part, *node.args[1:]), kwargs, shard=i, like=node))
    return Split(s.dim, tuple(parts))


def _mean_dims(b: _Builder, node: Node) -> Layout | None:
    """``mean`` over dims other than the batch dim (a pooled image) per shard; over the batch
    (a loss): the shards' sums reduced, divided by the count (eager's mean up to summation
    order)."""
    x = node.args[0]
    s = _split_of(b, x)
    if s is None or node.kwargs.get("dtype") is not None:
        return None
    nd = _ndim(x)
    dims = [_dim(d, nd) for d in node.args[1]] if len(node.args) > 1 and node.args[1] \
        else list(range(nd))
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
    if s.dim not in dims:
        return _per_shard(b, node, s.dim if keep else s.dim - sum(d < s.dim for d in dims))
    count = math.prod([x.meta.shape[d] for d in dims])
    sums = []
    for i, part in enumerate(s.parts):
        sums.append(b.call(aten.sum.dim_IntList, (part, dims, keep), shard=i, like=node,
                           part="_sum"))
    return Whole(b.call(aten.div.Tensor, (b.reduce(sums), count), like=node))


def _items(b: _Builder, node: Node, kinds: Sequence[str], dim: int = 0) -> Items:
    """``node`` once per shard; item k of its result is ``Split(dim)`` (``"split"``), the sum
    of the shards' items (``"sum"``: a parameter's gradient), or each shard's own value read
    only by the matching backward op (``"own"``: an RNG seed), or absent (``"none"``)."""
    return _items_of(b, _per_shard(b, node, dim).parts, kinds, dim)


def _items_of(b: _Builder, parts: tuple[Node, ...], kinds: Sequence[str],
              dim: int = 0) -> Items:
    items: list[Split | Whole] = []
    for k, kind in enumerate(kinds):
        if kind == "none":
            items.append(Whole(None))
            continue
        got = tuple(b.item(p, k, i) for i, p in enumerate(parts))
        items.append(Whole(b.reduce_later(got)) if kind == "sum" else Split(dim, got))
    return Items(tuple(items))


def _arg(node: Node, key: int | str, default: Any = None) -> Any:
    """``node``'s argument at a position or of a keyword name, else ``default``."""
    if isinstance(key, str):
        return node.kwargs.get(key, default)
    return node.args[key] if key < len(node.args) else default


def _batched(batch_args: Sequence[int], outs: Sequence[str] | None = None,
             broadcast: Sequence[int | str] = ()) -> Rule:
    """A rule for an op whose work is independent per batch row: the tensor arguments at
    ``batch_args`` (positions) must be Split along dim 0, those at ``broadcast`` (positions or
    keyword names: an attention mask) Split along dim 0 or of size 1 there or absent, every
    other tensor argument Whole; ``outs``: the kinds of its tuple items (see :func:`_items`),
    None for a single tensor Split along dim 0."""
    def rule(b: _Builder, node: Node) -> Layout | None:
        args = list(node.args)
        for i in batch_args:
            s = _split_of(b, args[i]) if i < len(args) else None
            if s is None or s.dim != 0:
                return None
        checked = set(batch_args)
        rows = _rows(_split_of(b, args[batch_args[0]]))
        full = args[batch_args[0]].meta.shape[0]
        cut: dict[int | str, Node] = {}
        for key in broadcast:
            x = _arg(node, key)
            if isinstance(key, int):
                checked.add(key)
            if isinstance(x, Node):
                s = _split_of(b, x)
                if s is None and x.meta.shape and x.meta.shape[0] == full and full != 1:
                    cut[key] = b.scatter(x, 0, rows)  # a mask made whole: cut per shard
                elif (s is None and x.meta.shape and x.meta.shape[0] != 1) or \
                        (s is not None and s.dim != 0):
                    return None
        for i, x in enumerate(args):
            if i not in checked and isinstance(x, Node) and _split_of(b, x) is not None:
                return None
        return _per_row(b, node, cut, outs)
    return rule


def _per_row(b: _Builder, node: Node, cut: dict[int | str, Split],
             outs: Sequence[str] | None) -> Layout:
    """:func:`_batched`'s op once per shard, the Whole arguments in ``cut`` read by their
    shard's part: Split along dim 0 (``outs`` None), summed over the shards (one tensor with
    ``outs``), or :class:`Items` of ``outs``' kinds."""
    parts = []
    for i in range(len(b.devices)):
        args, kwargs = _map_args(b, node, i)
        args = tuple(cut[k].parts[i] if k in cut else a for k, a in enumerate(args))
        kwargs = {k: cut[k].parts[i] if k in cut else v for k, v in kwargs.items()}
        parts.append(b.call(node.op, args, kwargs, shard=i, like=node))
    if outs is None:
        return Split(0, tuple(parts))
    if not isinstance(node.meta, tuple):  # one tensor, summed over the shards
        return Whole(b.reduce_later(parts))
    return _items_of(b, tuple(parts), outs)


def _dropout_free(rule: Rule, p_at: int | str) -> Rule:
    """``rule`` for attention only without dropout (each shard would draw its own mask)."""
    def checked(b: _Builder, node: Node) -> Layout | None:
        return rule(b, node) if _arg(node, p_at, 0.0) == 0.0 else None
    return checked


def _layer_norm(b: _Builder, node: Node) -> Layout | None:
    x, shape = node.args[:2]
    if len(shape) >= _ndim(x):
        return None
    return _batched((0,), ("split", "split", "split"))(b, node)


def _input_weight_bias(mask: Sequence[bool]) -> list[str]:
    """The kinds of a layer's backward items (grad input, weight, bias) its output mask asks:
    the input's gradient per row, the parameters' summed over the shards."""
    return [kind if asked else "none" for kind, asked in zip(("split", "sum", "sum"), mask)]


def _layer_norm_backward(b: _Builder, node: Node) -> Layout | None:
    return _batched((0, 1, 3, 4), _input_weight_bias(node.args[7]))(b, node)


def _conv_backward(b: _Builder, node: Node) -> Layout | None:
    if node.args[7]:  # transposed
        return None
    return _batched((0, 1), _input_weight_bias(node.args[10]))(b, node)


def _conv(b: _Builder, node: Node) -> Layout | None:
    return None if node.args[6] else _batched((0,))(b, node)  # not transposed


def _sdpa_efficient_backward(b: _Builder, node: Node) -> Layout | None:
    mask = node.args[10]
    bias = node.args[4]
    bias_kind = "none" if not mask[3] else "split" if _split_of(b, bias) is not None else "sum"
    kinds = ["split" if m else "none" for m in mask[:3]] + [bias_kind]
    return _batched((0, 1, 2, 3, 5, 6, 7, 8), kinds, broadcast=(4,))(b, node)


def _batch_norm(b: _Builder, node: Node) -> Layout | None:
    """Training batch norm split exactly (as SyncBatchNorm): each shard takes its rows' mean
    and variance in one kernel (``var_mean``); the shards' ``n_i mean_i`` and
    ``n_i (var_i + mean_i^2)`` are reduced in float64 (one hop) to the whole batch's mean and
    variance; every shard normalizes with those (``native_batch_norm`` in eval form, one
    kernel). The running statistics (which the kernel updates in place) are updated once, on
    home, from the same statistics, as eager does (unbiased variance). Eval form (a module's
    ``eval()``: the running statistics read, not updated): per row, each shard normalizes its
    rows with the whole running statistics.
    The functionalized forms a whole-step trace makes (:func:`_bn_args`) are split alike:
    ``_native_batch_norm_legit_functional`` returns the new running statistics (made on home)
    instead of writing them."""
    x, w, bias, rm, rv, training, momentum, eps = _bn_args(node)
    functional = node.op is aten._native_batch_norm_legit_functional.default
    if not training:
        return None if functional else _batched((0,), ("split", "own", "own"))(b, node)
    s = _split_of(b, x)
    if (s is None or s.dim != 0 or not training or _ndim(x) < 2
            or any(_split_of(b, a) is not None for a in (w, bias, rm, rv))):
        return None
    nd, shape = _ndim(x), x.meta.shape
    dims = [0, *range(2, nd)]
    count = shape[0] * math.prod(shape[2:])
    per_row = count // shape[0]
    f64 = {"dtype": torch.float64}
    sums, squares = [], []
    for i, p in enumerate(s.parts):
        vm = b.call(aten.var_mean.correction, (p, dims), {"correction": 0}, shard=i,
                    like=node, part="_vm")
        var_i, mean_i = (b.item(vm, k, i) for k in (0, 1))
        n_i = p.meta.shape[0] * per_row
        m64 = b.call(aten._to_copy.default, (mean_i,), f64, shard=i, like=node, part="_m64")
        v64 = b.call(aten._to_copy.default, (var_i,), f64, shard=i, like=node, part="_v64")
        sums.append(b.call(aten.mul.Tensor, (m64, n_i), shard=i, like=node, part="_sum"))
        sq = b.call(aten.addcmul.default, (v64, m64, m64), shard=i, like=node, part="_ex2")
        squares.append(b.call(aten.mul.Tensor, (sq, n_i), shard=i, like=node, part="_sq"))
    home = 0
    total_sum, total_sq = _reduced_together(b, node, sums, squares, "_moments")
    mean64 = b.call(aten.div.Tensor, (total_sum, count), shard=home, like=node, part="_mean64")
    ex2 = b.call(aten.div.Tensor, (total_sq, count), shard=home, like=node, part="_ex2all")
    var64 = b.call(aten.sub.Tensor, (ex2, b.call(aten.mul.Tensor, (mean64, mean64),
                                                 shard=home, like=node, part="_m2")),
                   shard=home, like=node, part="_var64")
    dtype = {"dtype": x.meta.dtype}
    mean = b.call(aten._to_copy.default, (mean64,), dtype, shard=home, like=node, part="_mean")
    var = b.call(aten._to_copy.default, (var64,), dtype, shard=home, like=node, part="_var")
    invstd = b.call(aten.rsqrt.default, (b.call(aten.add.Tensor, (var, eps), shard=home,
                                                like=node, part="_veps"),),
                    shard=home, like=node, part="_invstd")
    outs = []
    for i, p in enumerate(s.parts):
        here = [b.local(a, i) if isinstance(a, Node) else a for a in (w, bias)]
        normed = b.call(aten.native_batch_norm.default,
                        (p, *here, b.local_value(mean, i), b.local_value(var, i), False, 0.0,
                         eps), shard=i, like=node, part="_norm")
        outs.append(b.item(normed, 0, i))
    running: list[Split | Whole] = []
    for stat, new in ((rm, mean), (rv, b.call(aten.mul.Tensor, (var, count / max(count - 1, 1)),
                                               shard=home, like=node, part="_unbiased"))):
        if isinstance(stat, Node):  # running = (1 - momentum) * running + momentum * new
            old = b.whole(stat)
            kept = b.call(aten.mul.Tensor, (old, 1 - momentum), shard=home, like=node,
                          part="_keep")
            moved = b.call(aten.add.Tensor, (kept, new), {"alpha": momentum}, shard=home,
                           like=node, part="_run")
            if functional:
                running.append(Whole(moved))
            else:
                b.call(aten.copy_.default, (old, moved), shard=home, like=node, part="_update")
    if functional and len(running) != 2:
        return None
    return Items((Split(0, tuple(outs)), Whole(mean), Whole(invstd), *running))


def _reduced_together(b: _Builder, node: Node, firsts: Sequence[Node], seconds: Sequence[Node],
                      part: str) -> tuple[Node, Node]:
    """The sums of two per-channel partials of each shard (one vector each, one dtype), reduced
    as one: each shard's pair concatenated, one reduction (one collective, or one copy and add
    a GPU), the two sums sliced out on home (made again where a shard reads them). Batch
    norm reduces two such sums a layer in each direction."""
    n = firsts[0].meta.shape[0]
    both = [b.call(aten.cat.default, ([f, s], 0), shard=i, like=node, part=f"{part}_{i}")
            for i, (f, s) in enumerate(zip(firsts, seconds, strict=True))]
    total = b.reduce(both, pin=True)
    return (b.call(aten.slice.Tensor, (total, 0, 0, n), shard=0, like=node, part=f"{part}_a"),
            b.call(aten.slice.Tensor, (total, 0, n, 2 * n), shard=0, like=node,
                   part=f"{part}_b"))


def _bn_args(node: Node) -> tuple:
    """``native_batch_norm``'s arguments (input, weight, bias, running mean, running variance,
    training, momentum, eps) of a node of it or of its functionalized forms:
    ``_native_batch_norm_legit.no_stats`` (no running statistics: ``F.batch_norm(x, None,
    None, ...)``), ``_native_batch_norm_legit_functional`` (training) and
    ``_native_batch_norm_legit_no_training`` (a module in ``eval()``)."""
    a = node.args
    if node.op is aten._native_batch_norm_legit.no_stats:
        return (a[0], a[1], a[2], None, None, a[3], a[4], a[5])
    if node.op is aten._native_batch_norm_legit_functional.default:
        return (a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7])
    if node.op is aten._native_batch_norm_legit_no_training.default:
        return (a[0], a[1], a[2], a[3], a[4], False, a[5], a[6])
    return tuple(a[:8])


def _batch_norm_backward(b: _Builder, node: Node) -> Layout | None:
    """Training batch norm's backward split exactly: each shard's ``Σdy`` and ``Σdy x_hat``
    from ``native_batch_norm_backward`` (its weight and bias gradients, one kernel), reduced
    (they are ``grad_bias`` and ``grad_weight``); every shard makes its rows of
    ``grad_input = w invstd (dy - Σdy/N - x_hat Σ(dy x_hat)/N)`` as ``dy A + x B + C`` with
    per-channel A, B, C (two kernels)."""
    g, x, w, _rm, _rv, mean, invstd, training, eps, mask = node.args[:10]
    sg, sx = _split_of(b, g), _split_of(b, x)
    if (sg is None or sx is None or sg.dim != 0 or sx.dim != 0 or not training
            or any(_split_of(b, a) is not None for a in (w, mean, invstd))
            or not isinstance(mean, Node) or not isinstance(invstd, Node)):
        return None
    nd, shape = _ndim(x), x.meta.shape
    count = shape[0] * math.prod(shape[2:])
    bcast = [1, shape[1], *[1] * (nd - 2)]
    sum_gx, sum_g = [], []
    for i, (gp, xp) in enumerate(zip(sg.parts, sx.parts)):
        here = [b.local(a, i) if isinstance(a, Node) else a for a in (w, mean, invstd)]
        r = b.call(aten.native_batch_norm_backward.default,
                   (gp, xp, here[0], None, None, here[1], here[2], True, eps,
                    [False, True, True]), shard=i, like=node, part="_sums")
        sum_gx.append(b.item(r, 1, i))
        sum_g.append(b.item(r, 2, i))
    total_gx, total_g = _reduced_together(b, node, sum_gx, sum_g, "_dsums")
    items: list[Split | Whole] = [Whole(None), Whole(total_gx if mask[1] else None),
                                  Whole(total_g if mask[2] else None)]
    if not mask[0]:
        return Items(tuple(items))
    home = 0

    def on_home(op: Any, *args: Any, part: str) -> Node:
        return b.call(op, args, shard=home, like=node, part=part)

    inv = b.whole(invstd)
    a = inv if not isinstance(w, Node) else on_home(aten.mul.Tensor, inv, b.whole(w),
                                                    part="_a")
    k = on_home(aten.mul.Tensor, on_home(aten.mul.Tensor, a, inv, part="_ai"),
                on_home(aten.div.Tensor, total_gx, count, part="_mgx"), part="_k")
    coef_x = on_home(aten.neg.default, k, part="_bx")
    coef_c = on_home(aten.sub.Tensor, on_home(aten.mul.Tensor, k, b.whole(mean), part="_km"),
                     on_home(aten.mul.Tensor, a, on_home(aten.div.Tensor, total_g, count,
                                                         part="_mg"), part="_am"),
                     part="_c")
    parts = []
    for i, (gp, xp) in enumerate(zip(sg.parts, sx.parts)):
        def along(v: Node, i: int = i) -> Node:
            return b.call(aten.view.default, (b.local_value(v, i), bcast), shard=i, like=node,
                          part="_v")
        lin = b.call(aten.addcmul.default, (along(coef_c), xp, along(coef_x)), shard=i,
                     like=node, part="_lin")
        parts.append(b.call(aten.addcmul.default, (lin, gp, along(a)), shard=i, like=node,
                            part="_gi"))
    items[0] = Split(0, tuple(parts))
    return Items(tuple(items))


def _table() -> dict[Any, Rule]:
    t: dict[Any, Rule] = {
        aten.mm.default: _mm,
        aten.addmm.default: _addmm,
        aten.t.default: _transpose2d,
        aten.transpose.int: _transpose,
        aten.view.default: _reshape,
        aten._unsafe_view.default: _reshape,
        aten.reshape.default: _reshape,
        aten._softmax.default: _softmax,
        aten._log_softmax.default: _softmax,
        aten._softmax_backward_data.default: _softmax_backward,
        aten._log_softmax_backward_data.default: _softmax_backward,
        aten.sum.dim_IntList: _sum_dims,
        aten.sum.default: _sum_all,
        aten.nll_loss_forward.default: _nll_forward,
        aten.nll_loss_backward.default: _nll_backward,
        # views and reshuffles that keep the batch dim
        aten.unsqueeze.default: _unsqueeze,
        aten.squeeze.dim: _squeeze,
        aten.squeeze.dims: _squeeze,
        aten.squeeze.default: _squeeze,
        aten.permute.default: _permute,
        aten.expand.default: _expand,
        aten.slice.Tensor: _slice,
        aten.select.int: _select,
        aten.constant_pad_nd.default: _pad,
        aten.split.Tensor: _split_tuple,
        aten.split_with_sizes.default: _split_tuple,
        aten.slice_backward.default: _backward_of_view,
        aten.select_backward.default: _backward_of_view,
        aten.cat.default: _cat,
        aten.native_batch_norm.default: _batch_norm,
        aten._native_batch_norm_legit.no_stats: _batch_norm,
        aten._native_batch_norm_legit_functional.default: _batch_norm,
        aten._native_batch_norm_legit_no_training.default: _batch_norm,
        aten.native_batch_norm_backward.default: _batch_norm_backward,
        aten.mean.dim: _mean_dims,
        aten.mean.default: _mean_dims,
        # per-row work: real models' layers and their backward ops
        aten.bmm.default: _batched((0, 1)),
        aten.embedding.default: _batched((1,)),
        aten.embedding_dense_backward.default: _batched((0,), ("sum",), broadcast=(1,)),
        aten.native_layer_norm.default: _layer_norm,
        aten.native_layer_norm_backward.default: _layer_norm_backward,
        aten.convolution.default: _conv,
        aten.convolution_backward.default: _conv_backward,
        aten.max_pool2d_with_indices.default: _batched((0,), ("split", "split")),
        aten.max_pool2d_with_indices_backward.default: _batched((0, 1, 7)),
        aten.avg_pool2d.default: _batched((0,)),
        aten.avg_pool2d_backward.default: _batched((0, 1)),
        aten._adaptive_avg_pool2d.default: _batched((0,)),
        aten._adaptive_avg_pool2d_backward.default: _batched((0, 1)),
        aten._scaled_dot_product_flash_attention_for_cpu.default: _dropout_free(
            _batched((0, 1, 2), ("split", "split"), broadcast=("attn_mask",)), 3),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _dropout_free(
            _batched((0, 1, 2, 3, 4, 5), ("split", "split", "split"),
                     broadcast=("attn_mask", 8)), 6),
        aten._scaled_dot_product_efficient_attention.default: _dropout_free(
            _batched((0, 1, 2), ("split", "split", "own", "own"), broadcast=(3,)), 5),
        aten._scaled_dot_product_efficient_attention_backward.default: _dropout_free(
            _sdpa_efficient_backward, 9),
        aten._scaled_dot_product_flash_attention.default: _dropout_free(
            _batched((0, 1, 2), ("split", "split", "none", "none", "own", "own", "own",
                                 "own", "none")), 3),
        aten._scaled_dot_product_flash_attention_backward.default: _dropout_free(
            _batched((0, 1, 2, 3, 4, 5, 12, 13), ("split", "split", "split")), 10),
    }
    for op in (aten.detach.default, aten.alias.default, aten.clone.default,
               aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
               aten.full_like.default, aten.lift_fresh_copy.default):
        t[op] = _same
    t[aten._to_copy.default] = _cast
    return t


RULES: dict[Any, Rule] = _table()
"""How each op is split when an input is batch-parallel; ops not here (and not pointwise) run
unsplit."""


def _rule(op: Any) -> Rule | None:
    rule = RULES.get(op)
    if rule is not None:
        return rule
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags \
            and op_kind(op) == "pointwise":
        return _elementwise
    return None


# -- the pass -----------------------------------------------------------------------------------
def shard(graph: Graph, batch: dict[Node, int], devices: Sequence[str],
          sizes: Sequence[int] | None = None, updates: dict[Node, Node] | None = None,
          reduce_chunks: int | None = None, bucket_bytes: int = BUCKET_BYTES,
          collectives: bool | str = "auto") -> Sharded:
    """Split ``graph``'s batch-parallel work over ``devices`` (see the module docstring).

    ``batch`` maps graph inputs to their batch dimension; they must agree on the batch size.
    ``devices[0]`` must be where eager puts those inputs. ``updates`` maps graph inputs to the
    node holding their next value (a training step's updated parameters): each replica of such
    an input gets its next value as an extra output (:attr:`Sharded.replica_outputs`).
    ``reduce_chunks``: the most row chunks a partial sum is reduced in (None:
    ``MAX_REDUCE_CHUNKS``; 1: every partial sum at once). ``bucket_bytes``: the gradient
    buckets' size (0: each sum reduced alone). ``collectives``: reduce sums by one
    collective each (True), by copies and adds (False), or ``"auto"``: collectives over three
    or more GPUs of their own memory (see the module docstring).
    """
    if len(devices) < 1 or len(set(devices)) != len(devices):
        raise NotShardable(f"devices {list(devices)} must be distinct and non-empty")
    if not batch:
        raise NotShardable("no batch inputs: name the inputs to split and their batch dim")
    writers = [n for n in graph.ops if n.writes]
    if writers:
        raise NotShardable(f"{writers[0]!r} writes {writers[0].writes[0]!r} in place: the "
                           "sharding pass takes functional graphs only")
    n = _batch_size(graph, batch, devices)
    sizes = even_sizes(n, len(devices)) if sizes is None else tuple(sizes)
    if sum(sizes) != n or any(s <= 0 for s in sizes) or len(sizes) != len(devices):
        raise NotShardable(f"shard sizes {list(sizes)} must be {len(devices)} positive numbers "
                           f"summing to the batch size {n}")
    if collectives == "auto":
        gpus = {torch_device(d) for d in devices if not d.startswith("cpu")}
        collectives = len(gpus) == len(devices) >= 3
    b = _Builder(graph, devices, sizes, bool(collectives))
    b.reduce_chunks = reduce_chunks
    b.bucket_bytes = bucket_bytes
    inputs = {x: b.out.input(x.meta, x.name) for x in graph.inputs}
    b.source_inputs = {new: x for x, new in inputs.items()}
    for x in graph.inputs:
        b.layout[x] = Whole(inputs[x])
    for x, dim in batch.items():
        b.layout[x] = _split_input(b, inputs[x], dim)
        b.batch_inputs[x] = inputs[x]
    nll: dict[Node, _NllParts] = {}
    for node in graph.ops:
        b.layout[node] = _rewrite(b, node, nll)
    b.flush()
    outs = [b.whole(o) if isinstance(o, Node) else o for o in graph.outputs]
    shard_of = {d: i for i, d in enumerate(devices)}
    nexts = []
    for j, device in list(b.replicas):
        value = (updates or {}).get(graph.nodes[j])
        if value is not None:
            outs.append(b.local(value, shard_of[device]))
            nexts.append((j, device))
    b.out.set_outputs(outs)
    if not devices[0].startswith("cpu"):  # what isn't split runs on home (see above)
        for node in b.out.ops:
            if node not in b.pins and node.device == b.home:
                b.pins[node] = devices[0]
    _move_replicas_to_inputs(b)
    b.out.verify()
    return Sharded(b.out, tuple(devices), sizes, b.pins, b.replicas, nexts, b.unsplit,
                   len(b._chunks))


def _batch_size(graph: Graph, batch: dict[Node, int], devices: Sequence[str]) -> int:
    sizes: set[int] = set()
    for x, dim in batch.items():
        if not x.is_input or not isinstance(x.meta, TensorMeta) or x not in graph.inputs:
            raise NotShardable(f"batch value {x!r} is not a tensor input of {graph.name}")
        if not 0 <= dim < len(x.meta.shape):
            raise NotShardable(f"batch dim {dim} of {x!r} is out of range for shape "
                               f"{x.meta.shape}")
        if x.device != torch_device(devices[0]):
            raise NotShardable(f"batch input {x!r} is on {x.device}, but the home device "
                               f"(devices[0]) is {devices[0]}")
        sizes.add(x.meta.shape[dim])
    if len(sizes) != 1:
        raise NotShardable(f"batch inputs disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def _split_input(b: _Builder, x: Node, dim: int) -> Split:
    parts, start = [], 0
    for i, size in enumerate(b.sizes):
        view = b.call(aten.slice.Tensor, (x, dim, start, start + size), shard=0)
        view.name = f"{x.name}_s{i}"
        parts.append(b.to_device(view, i) if i else view)
        start += size
    return Split(dim, tuple(parts))


_FILLS = {aten.ones_like.default: 1, aten.zeros_like.default: 0}


def _is_fill(node: Node) -> bool:
    return node.op is aten.full.default and not node.inputs


def _fill(b: _Builder, node: Node) -> Node | None:
    """``ones_like(x)`` of a whole ``x`` as ``full(shape, 1)``: the same value without waiting
    for ``x`` (the seed gradient of backward would otherwise wait for the reduced loss)."""
    m = node.meta
    if (set(node.kwargs) - {"pin_memory", "memory_format", "dtype", "device", "layout"}
            or not isinstance(m, TensorMeta)
            or m.stride != TensorMeta.make(m.shape, m.dtype).stride):
        return None
    return b.out.call(aten.full.default, (list(m.shape), _FILLS[node.op]),
                      {"dtype": m.dtype, "layout": torch.strided,
                       "device": torch.device(m.device), "pin_memory": False},
                      meta=m, name=node.name, source=node.source)


def _rewrite(b: _Builder, node: Node, nll: dict[Node, _NllParts]) -> Layout:
    """``node``'s layout in the sharded graph, emitting its nodes."""
    if node.op is operator.getitem and node.args[0] in nll:
        return _nll_getitem(b, node, nll[node.args[0]])
    if b.rule_item(node):
        return b.layout[node.args[0]].items[node.args[1]]
    if node.op in _FILLS and _split_of(b, node.args[0]) is None:
        filled = _fill(b, node)
        if filled is not None:
            return Whole(filled)
    if any(_split_of(b, x) is not None for x in node.inputs):
        rule = _rule(node.op)
        got = None
        if rule is not None:
            try:
                got = rule(b, node)
            except (GraphError, RuntimeError, TypeError, ValueError, IndexError) as e:
                b.unsplit[node.name] = f"rule failed: {type(e).__name__}: {e}"
        if isinstance(got, _NllParts):
            nll[node] = got
            return Whole(None)
        if got is not None:
            return got
        b.unsplit.setdefault(node.name, "no rule splits it" if rule is None
                             else "its rule does not apply to these layouts")
    def emit() -> Node:
        args, kwargs = map_nodes(b.whole, (node.args, node.kwargs))
        return b.out.call(node.op, args, kwargs, meta=node.meta, name=node.name,
                          source=node.source, flops=node.flops)

    if op_kind(node.op) == "view" and any(
            isinstance(lay := b.layout.get(x), Whole) and isinstance(lay.node, _Pending)
            for x in node.inputs):
        return Whole(_Pending(emit))  # a view of a gradient in a bucket: made when read
    return Whole(emit())


def _move_replicas_to_inputs(b: _Builder) -> None:
    """Put the replica inputs after the original inputs and renumber every node."""
    g = b.out
    n_in = len(g.inputs)
    g.nodes[n_in:n_in] = [b._replica_nodes[(b.src.nodes[i], d)] for i, d in b.replicas]
    for i, node in enumerate(g.nodes):
        node.id = i

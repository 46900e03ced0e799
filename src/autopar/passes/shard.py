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
- Devices. ``devices[0]`` is the home: where eager runs the graph and where results are
  gathered and reduced. Devices of the same memory (logical CPU workers) share one tensor: no
  replica and no copy, only the pin differs.
- The input graph must be functional (no op writes a tensor in place): the pass reorders work
  across devices, and only a functional graph makes that safe without more bookkeeping.
- Uneven shards are allowed: ``sizes`` (default: as even as possible, the first ones larger)
  must sum to the batch size and be positive.

Glossary: *home* ``devices[0]``; *shard i* the nodes pinned to ``devices[i]``; *gather*
``cat`` of a Split value's parts on home; *reduce* ``add`` of partial sums on home.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..ir.graph import INPUT, Graph, GraphError, Node, TensorMeta, op_kind

__all__ = ["MAX_REDUCE_CHUNKS", "REDUCE_CHUNK_BYTES", "RULES", "NotShardable", "Sharded", "Split",
           "Whole", "even_sizes", "shard"]

aten = torch.ops.aten

REDUCE_CHUNK_BYTES = 32 << 20
"""An ``mm`` partial sum larger than this is made and reduced in row chunks of about this size."""
MAX_REDUCE_CHUNKS = 4
"""...in at most this many (each chunk's ``mm`` stays big enough to keep a GPU busy)."""


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


Layout = Split | Whole


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

    def __init__(self, src: Graph, devices: Sequence[str], sizes: Sequence[int]) -> None:
        self.src = src
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
        self._partials: dict[Node, tuple[Node, ...]] = {}  # reduced sum -> its partials
        self._chunks: dict[Node, tuple[Node, ...]] = {}  # cat of reduced chunks -> the chunks
        self.reduce_chunks: int | None = None  # at most this many chunks (None: the default)
        self.batch_inputs: dict[Node, Node] = {}  # split graph input -> the whole input
        self._can_local: dict[Node, bool] = {}
        self.users = src.users()

    # -- emitting ------------------------------------------------------------------------------
    def call(self, op: Any, args: tuple, kwargs: dict | None = None, *, shard: int | None = None,
             like: Node | None = None, part: str = "") -> Node:
        """Append an op; a shard's op is pinned to its device, and its value lives there
        (inputs from elsewhere are copied in by the plan). ``part`` tells apart several
        nodes made for one source node (``_c1``: its second chunk)."""
        name = "" if like is None else like.name + part if shard is None \
            else f"{like.name}{part}_s{shard}"
        node = self.out.call(op, args, kwargs or {}, name=name,
                             source=like.source if like is not None else None)
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
            return lay.node
        got = self._gathered.get(src)
        if got is None:
            parts = [self.to_home(p) for p in lay.parts]
            got = self._gathered[src] = self.call(aten.cat.default, (parts, lay.dim), like=src)
        return got

    def reduce(self, parts: Sequence[Node]) -> Node:
        """Sum of per-shard partial results, on home (remembered: :meth:`local` adds them
        again on a shard that needs the sum, in the same order, so every copy is identical)."""
        total = self.to_home(parts[0])
        for p in parts[1:]:
            total = self.call(aten.add.Tensor, (total, self.to_home(p)))
        self._partials[total] = tuple(parts)
        return total

    def local(self, src: Node, shard: int) -> Node:
        """A Whole value of ``src`` as shard ``shard`` reads it, made on the shard's device
        where that needs no copy of a whole value (see :meth:`_localizable`), else the whole
        node itself (the plan copies it)."""
        lay = self.layout[src]
        assert isinstance(lay, Whole)
        if shard == 0 or torch_device(self.devices[shard]) == self.home:
            return lay.node
        key = (src, shard)
        got = self._local.get(key)
        if got is None:
            got = self._local[key] = self._make_local(src, shard)
        return got

    def _make_local(self, src: Node, shard: int) -> Node:
        node = self.layout[src].node
        dev = torch_device(self.devices[shard])
        if src.is_input:
            return self._replica(src, self.devices[shard])
        if not self._localizable(src):
            return node
        # the home copy runs on home's device too: the same kernels on the same kind of device
        # give every copy the same bits (the host's could differ in the last place)
        self.pins.setdefault(node, self.devices[0])
        if node in self._partials:  # a reduced sum: add the partials again here (an all-reduce)
            return self._sum_here(node, shard)
        chunks = self._chunks.get(node)
        if chunks is not None:  # reduced in chunks: each chunk's sum again here, then the cat
            self.pins.update(dict.fromkeys(chunks, self.devices[0]))
            return self.call(aten.cat.default, ([self._sum_here(c, shard) for c in chunks], 0),
                             shard=shard, like=src)
        if _is_fill(node):  # the value is known without its source's inputs
            return self.call(node.op, node.args, {**node.kwargs, "device": torch.device(dev)},
                             shard=shard, like=src)
        args, kwargs = tree_map(lambda x: self.local(x, shard) if isinstance(x, Node) else x,
                                (src.args, src.kwargs))
        if isinstance(kwargs.get("device"), torch.device):
            kwargs["device"] = torch.device(dev)
        return self.call(src.op, args, kwargs, shard=shard, like=src)

    def _sum_here(self, total: Node, shard: int) -> Node:
        """The reduced sum ``total`` added again on shard's device, from the same partials in
        the same order: the same bits as home's."""
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
            if not isinstance(lay, Whole) or lay.node is None:
                got = False
            elif lay.node in self._partials or lay.node in self._chunks \
                    or (src.is_input and src.device == self.home) \
                    or _is_fill(lay.node):  # _fill's ones_like: made on each device
                got = True
            else:
                kind = op_kind(src.op)
                got = (not src.is_input and src.flops == 0 and not src.writes
                       and (kind in ("view", "pointwise", "copy")
                            or (kind == "other" and not src.inputs))  # a fill
                       and all(self._localizable(i) for i in src.inputs))
            self._can_local[src] = got
        return got

    def _replica(self, src: Node, device: str) -> Node:
        key = (src, device)
        got = self._replica_nodes.get(key)
        if got is None:
            # graph inputs precede ops: shard() moves replicas among the inputs at the end
            meta = _on(src.meta, torch_device(device))
            got = self._replica_nodes[key] = Node(-1, INPUT, meta=meta, name=f"{src.name}@{device}")
            self.replicas.append((src.id, device))
        return got


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


def _split_of(b: _Builder, x: Any) -> Split | None:
    if isinstance(x, Node):
        lay = b.layout.get(x)
        if isinstance(lay, Split):
            return lay
    return None


def _map_args(b: _Builder, node: Node, shard: int,
              replace: dict[int, Any] | None = None) -> tuple[tuple, dict]:
    """``node``'s arguments for shard ``shard``: Split values by their part, Whole by ``local``."""
    def one(x: Any) -> Any:
        if not isinstance(x, Node):
            return x
        lay = b.layout[x]
        return lay.parts[shard] if isinstance(lay, Split) else b.local(x, shard)

    args = tuple(tree_map(one, a) if i not in (replace or {}) else replace[i]
                 for i, a in enumerate(node.args))
    return args, tree_map(one, node.kwargs)


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
    """Per-shard partial results of ``node``, summed on home."""
    return Whole(b.reduce(_per_shard(b, node, 0).parts))


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
    for x in node.inputs:
        if _split_of(b, x) is None and isinstance(x.meta, TensorMeta):
            d = out_dim - (nd - _ndim(x))
            if d >= 0 and x.meta.shape[d] != 1:
                return None
    return _per_shard(b, node, out_dim)


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
    """A view/reshape keeps the batch dim when the dims before it and the dim itself map."""
    x = node.args[0]
    s = _split_of(b, x)
    if s is None or not isinstance(node.meta, TensorMeta):
        return None
    ins, outs = list(x.meta.shape), list(node.meta.shape)
    before = 1
    for d in range(s.dim):
        before *= ins[d]
    acc = 1
    for d, size in enumerate(outs):
        if acc == before and size == ins[s.dim]:
            def shard_shape(i: int, d: int = d) -> dict:
                return {1: [*outs[:d], b.sizes[i], *outs[d + 1:]]}
            return _per_shard(b, node, d, replace=shard_shape)
        acc *= size
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
    }
    for op in (aten.detach.default, aten.alias.default, aten.clone.default,
               aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
               aten.full_like.default):
        t[op] = _same
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
          reduce_chunks: int | None = None) -> Sharded:
    """Split ``graph``'s batch-parallel work over ``devices`` (see the module docstring).

    ``batch`` maps graph inputs to their batch dimension; they must agree on the batch size.
    ``devices[0]`` must be where eager puts those inputs. ``updates`` maps graph inputs to the
    node holding their next value (a training step's updated parameters): each replica of such
    an input gets its next value as an extra output (:attr:`Sharded.replica_outputs`).
    ``reduce_chunks``: the most row chunks a partial sum is reduced in (None:
    ``MAX_REDUCE_CHUNKS``; 1: every partial sum at once).
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
    b = _Builder(graph, devices, sizes)
    b.reduce_chunks = reduce_chunks
    inputs = {x: b.out.input(x.meta, x.name) for x in graph.inputs}
    for x in graph.inputs:
        b.layout[x] = Whole(inputs[x])
    for x, dim in batch.items():
        b.layout[x] = _split_input(b, inputs[x], dim)
        b.batch_inputs[x] = inputs[x]
    nll: dict[Node, _NllParts] = {}
    for node in graph.ops:
        b.layout[node] = _rewrite(b, node, nll)
    outs = [b.whole(o) if isinstance(o, Node) else o for o in graph.outputs]
    shard_of = {d: i for i, d in enumerate(devices)}
    nexts = []
    for j, device in list(b.replicas):
        value = (updates or {}).get(graph.nodes[j])
        if value is not None:
            outs.append(b.local(value, shard_of[device]))
            nexts.append((j, device))
    b.out.set_outputs(outs)
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
    args, kwargs = tree_map(lambda x: b.whole(x) if isinstance(x, Node) else x,
                            (node.args, node.kwargs))
    return Whole(b.out.call(node.op, args, kwargs, meta=node.meta, name=node.name,
                            source=node.source, flops=node.flops))


def _move_replicas_to_inputs(b: _Builder) -> None:
    """Put the replica inputs after the original inputs and renumber every node."""
    g = b.out
    n_in = len(g.inputs)
    g.nodes[n_in:n_in] = [b._replica_nodes[(b.src.nodes[i], d)] for i, d in b.replicas]
    for i, node in enumerate(g.nodes):
        node.id = i

"""The IR: a dataflow graph of ATen ops, in topological order.

Every later stage (cost, place, plan, simulate, runtime, views) reads this and nothing else.

Policy and invariants
- A :class:`Graph` is a list of :class:`Node` in topological order: graph inputs (``op is INPUT``)
  come first, in call order; every op node refers only to nodes before it. ``outputs`` is a flat
  tuple of nodes or Python constants, in the order the compiled function returns them.
- A node's inputs are the nodes found (via pytree) in its ``args`` and ``kwargs``; users are derived
  from the node list (:meth:`Graph.users`), never stored, so they cannot drift.
- A node's ``meta`` describes its output: one :class:`TensorMeta`, a tuple of them for ops that
  return several tensors (read through ``operator.getitem`` nodes), a :class:`ScalarMeta` for a
  Python number (``aten._local_scalar_dense``: ``.item()`` and tensor slice bounds; arithmetic on
  such numbers; runtime asserts), or ``None`` for ``getitem`` of a non-tensor. ``meta.device`` is
  the torch device string eager PyTorch produces the value on; a Python number lives on the host.
- ``reads``, ``writes`` and ``aliases`` come from the op schema's alias annotations, never from
  guesses, computed once when the node is made: ``writes`` are inputs the op mutates
  (``Tensor(a!)``), ``aliases`` are inputs the output is a view of (``Tensor(a)``), ``reads`` are
  all node inputs (``Node.inputs``).
- ``flops`` come from ``torch.utils.flop_counter``'s formulas (0 where it has none: such ops are
  costed by bytes).
- Nothing here imports CUDA-only code or knows how fast a device is.
"""

from __future__ import annotations

import contextlib
import math
import operator
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

__all__ = [
    "INPUT",
    "LOCAL_SCALAR_DENSE",
    "Annotation",
    "Graph",
    "GraphError",
    "GraphTotals",
    "Node",
    "ScalarMeta",
    "TensorMeta",
    "annotated_args",
    "op_kind",
    "op_name",
]

INPUT = "input"
"""The ``op`` of a graph-input node."""

LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
"""The op that reads a tensor's value to the host (``.item()``, a tensor slice bound)."""


class GraphError(ValueError):
    """A graph violates one of the invariants in this module's docstring."""


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype, strides and eager device of one tensor value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: str
    nbytes: int

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        """Metadata of a real, fake or meta tensor (shapes must be concrete)."""
        shape = tuple(int(s) for s in t.shape)
        numel = 1
        for s in shape:
            numel *= s
        return TensorMeta(
            shape=shape,
            dtype=t.dtype,
            stride=tuple(int(s) for s in t.stride()),
            device=str(t.device),
            nbytes=numel * t.element_size(),
        )

    @staticmethod
    def make(
        shape: Sequence[int], dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> TensorMeta:
        """Metadata of a contiguous tensor: for graphs built by hand (tests, benchmarks)."""
        shape = tuple(shape)
        stride, acc = [], 1
        for s in reversed(shape):
            stride.append(acc)
            acc *= max(s, 1)
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return TensorMeta(shape, dtype, tuple(reversed(stride)), device, numel * itemsize)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def as_meta_tensor(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                 "int64": "i64", "int32": "i32", "bool": "b8"}.get(dt, dt)
        return f"{short}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class ScalarMeta:
    """A Python number (or ``None``, for an assert) that the host computes: no tensor, no copies.

    ``type``: ``"int"``, ``"float"``, ``"bool"`` or ``"none"``.
    """

    type: str

    @staticmethod
    def of(value: Any) -> ScalarMeta:
        """Metadata of a traced value: an int, float or bool (symbolic or not), or None."""
        for kinds, name in (((bool, torch.SymBool), "bool"), ((int, torch.SymInt), "int"),
                            ((float, torch.SymFloat), "float")):
            if isinstance(value, kinds):
                return ScalarMeta(name)
        if value is None:
            return ScalarMeta("none")
        raise TypeError(f"not a Python scalar: {type(value).__name__}")

    def __str__(self) -> str:
        return self.type


Meta = TensorMeta | tuple[TensorMeta | None, ...] | ScalarMeta | None


@dataclass(eq=False, slots=True)
class Node:
    """One value of the graph: a graph input, or one ATen op applied to earlier nodes.

    Nodes hash and compare by identity. ``id`` is the node's position in its graph.
    """

    id: int
    op: Any  # INPUT, a torch OpOverload, or operator.getitem
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    meta: Meta = None
    flops: int = 0
    name: str = ""
    source: str | None = None  # "file.py:123" of the user's line, when known
    reads: tuple[Node, ...] = ()
    writes: tuple[Node, ...] = ()
    aliases: tuple[Node, ...] = ()

    def __post_init__(self) -> None:
        if not self.reads and self.op is not INPUT:
            self.reads, self.writes, self.aliases = _schema_effects(self.op, self.args,
                                                                    self.kwargs)

    @property
    def inputs(self) -> tuple[Node, ...]:
        """Distinct nodes this node consumes, in argument order (its ``reads``)."""
        return self.reads

    @property
    def is_input(self) -> bool:
        return self.op is INPUT

    @property
    def tensor_metas(self) -> tuple[TensorMeta, ...]:
        return _flat_metas(self.meta)

    @property
    def out_bytes(self) -> int:
        """Bytes this node writes (0 for views: they write nothing)."""
        if self.aliases or self.op is operator.getitem:
            return 0
        return sum(m.nbytes for m in self.tensor_metas)

    @property
    def in_bytes(self) -> int:
        return sum(m.nbytes for n in self.inputs for m in n.tensor_metas)

    @property
    def device(self) -> str | None:
        """The device eager PyTorch produces this value on (the first output's)."""
        metas = self.tensor_metas
        return metas[0].device if metas else None

    @property
    def kind(self) -> str:
        return "input" if self.is_input else op_kind(self.op)

    def __repr__(self) -> str:
        return f"%{self.name or self.id}"


def _flat_metas(meta: Any) -> tuple[TensorMeta, ...]:
    """The tensors of a node's result, in order (a fused optimizer's result is a tuple of
    lists: nested)."""
    if isinstance(meta, TensorMeta):
        return (meta,)
    if isinstance(meta, tuple):
        return tuple(m for x in meta for m in _flat_metas(x))
    return ()


def op_name(op: Any) -> str:
    """Short printable name: ``aten.mm``, ``getitem``, ``input``."""
    if op is INPUT:
        return "input"
    if isinstance(op, torch._ops.OpOverload):
        name = f"{op.namespace}.{op._schema.name.split('::')[-1]}"
        return name if op._overloadname == "default" else f"{name}.{op._overloadname}"
    return getattr(op, "__name__", str(op))


_VIEW_LIKE = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::t",
              "aten::permute", "aten::transpose", "aten::slice", "aten::select", "aten::squeeze",
              "aten::unsqueeze", "aten::alias", "aten::detach", "aten::as_strided"}


def op_kind(op: Any) -> str:
    """A coarse family used for totals, pictures and the cost model's fallbacks.

    One of: input, getitem, view, matmul (has a FLOP formula), random, pointwise, reduction,
    copy, other. (Memoized per op: placement asks it for every op on every device.)
    """
    try:
        return _KINDS[op]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    kind = _op_kind(op)
    with contextlib.suppress(TypeError):
        _KINDS[op] = kind
    return kind


_KINDS: dict[Any, str] = {}


def _op_kind(op: Any) -> str:
    if op is INPUT:
        return "input"
    if op is operator.getitem:
        return "getitem"
    if not isinstance(op, torch._ops.OpOverload):
        return "other"
    schema = op._schema
    if schema.name in _VIEW_LIKE or any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    ):
        return "view"
    if op.overloadpacket in flop_registry or op.overloadpacket in _LINALG_FLOPS:
        return "matmul"
    tags = op.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if torch.Tag.pointwise in tags:
        return "pointwise"
    if torch.Tag.reduction in tags:
        return "reduction"
    if schema.name in {"aten::_to_copy", "aten::copy", "aten::copy_", "aten::clone"}:
        return "copy"
    return "other"


UNDECLARED_WRITES = {"aten::cudnn_batch_norm": (3, 4), "aten::miopen_batch_norm": (3, 4)}
"""Ops whose kernels write inputs their schema says they only read, by argument position:
cuDNN's and MIOpen's batch norm update the running statistics in training (argument 5 true;
seen on torch 2.11). A trace meets them only where torch's decompositions
above autograd were off (:mod:`autopar.capture.step` traces with them on); a graph that
still holds one has its writes seen, so nothing replays or moves them unawares."""


def _schema_effects(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, tuple, tuple]:
    """(reads, writes, aliases) of an op call, from its schema's alias annotations."""
    reads = tuple(dict.fromkeys(_nodes_in((args, kwargs), [])))
    if op is operator.getitem:
        return reads, (), reads
    if not isinstance(op, torch._ops.OpOverload):
        return reads, (), ()
    writes: list[Node] = []
    aliases: list[Node] = []
    for note, value in annotated_args(op, args, kwargs):
        found = _nodes_in(value, [])
        if note.is_write:
            writes += found
        if note.aliased:
            aliases += found
    if op._schema.name in UNDECLARED_WRITES and len(args) > 5 and args[5] is True:
        writes += _nodes_in([args[i] for i in UNDECLARED_WRITES[op._schema.name]], [])
    return reads, tuple(dict.fromkeys(writes)), tuple(dict.fromkeys(aliases))


def _nodes_in(x: Any, out: list[Node]) -> list[Node]:
    """The Nodes in ``x`` (nested tuples, lists and dict values), in order."""
    if isinstance(x, Node):
        out.append(x)
    elif isinstance(x, tuple | list):
        for item in x:
            _nodes_in(item, out)
    elif isinstance(x, dict):
        for item in x.values():
            _nodes_in(item, out)
    return out


@dataclass(frozen=True, slots=True)
class Annotation:
    """An ATen argument its schema annotates: ``position``, ``name``, ``kwarg_only``, whether
    the op writes it in place (``is_write``) and whether an output aliases it (``aliased``)."""

    position: int
    name: str
    kwarg_only: bool
    is_write: bool
    aliased: bool


# op -> its annotated arguments: the schema read once per op, not once per node (a graph of
# 8,000 nodes is built in the shard pass several times a step)
_ANNOTATIONS: dict[Any, tuple[Annotation, ...]] = {}


def annotated_args(op: Any, args: tuple, kwargs: dict) -> Iterator[tuple[Annotation, Any]]:
    """``(annotation, value)`` of each argument of an ATen op call that its schema annotates
    (written in place, or aliased by an output), whatever kind of node ``args`` hold."""
    notes = _ANNOTATIONS.get(op)
    if notes is None:
        schema = op._schema
        out_sets = {s for r in schema.returns if r.alias_info is not None
                    for s in r.alias_info.after_set}
        notes = _ANNOTATIONS[op] = tuple(
            Annotation(i, a.name, a.kwarg_only, a.alias_info.is_write,
                       bool(out_sets & set(a.alias_info.before_set)))
            for i, a in enumerate(schema.arguments) if a.alias_info is not None)
    for note in notes:
        yield note, (kwargs.get(note.name) if note.kwarg_only or note.position >= len(args)
                     else args[note.position])


def _cholesky_flops(a: tuple[int, ...], b: tuple[int, ...] | None) -> float:
    n = a[-1]
    return math.prod(a[:-2]) * n**3 / 3


def _solve_triangular_flops(a: tuple[int, ...], b: tuple[int, ...] | None) -> float:
    return a[-1] * math.prod(b or ())  # n^2 per right-hand side of length n


_LINALG_FLOPS: dict[Any, Callable[[tuple[int, ...], tuple[int, ...] | None], float]] = {
    torch.ops.aten.linalg_cholesky_ex: _cholesky_flops,
    torch.ops.aten.linalg_solve_triangular: _solve_triangular_flops,
}
"""Formulas torch.utils.flop_counter lacks: LAPACK-style factorizations and solves (n^3/3 for
Cholesky; n^2 per right-hand side for a triangular solve)."""


def _flops(op: Any, args: tuple, kwargs: dict, meta: Meta) -> int:
    """FLOPs by torch.utils.flop_counter's formula for ``op`` (or :data:`_LINALG_FLOPS`'), 0
    when it has none."""
    if not isinstance(op, torch._ops.OpOverload):
        return 0
    if op.overloadpacket in _LINALG_FLOPS:
        shapes = [x.meta.shape if isinstance(x, Node) and isinstance(x.meta, TensorMeta)
                  else None for x in args[:2]]
        if not shapes or shapes[0] is None:
            return 0
        b = shapes[1] if len(shapes) > 1 else None
        return int(_LINALG_FLOPS[op.overloadpacket](shapes[0], b))
    if op.overloadpacket not in flop_registry:
        return 0

    def as_tensor(x: Any) -> Any:
        if isinstance(x, Node):
            m = x.meta
            return m.as_meta_tensor() if isinstance(m, TensorMeta) else x
        return x

    def out_tensor(m: Any) -> Any:
        return m.as_meta_tensor() if isinstance(m, TensorMeta) else m

    out = tree_map(out_tensor, meta) if isinstance(meta, tuple) else out_tensor(meta)
    try:
        return int(flop_registry[op.overloadpacket](
            *tree_map(as_tensor, args), **tree_map(as_tensor, kwargs), out_val=out))
    except Exception:  # a formula that can't take these shapes: cost by bytes instead
        return 0


@dataclass(frozen=True)
class GraphTotals:
    nodes: int
    flops: int
    bytes: int
    ops_by_kind: dict[str, int]

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.ops_by_kind.items()))
        return (f"{self.nodes} ops, {self.flops / 1e9:.3g} GFLOP, "
                f"{self.bytes / 1e6:.3g} MB written ({kinds})")


class Graph:
    """Inputs, nodes in topological order, and outputs. Build with :meth:`input` / :meth:`call`."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.outputs: tuple[Any, ...] = ()
        # capture computed some of the function's ops already (autopar.capture.fold)
        self.folded = False
        # a call writes into its inputs outside the graph's ops (aot_autograd's epilogue
        # copies a functional graph's new values back: autopar.capture.dynamo)
        self.writes_inputs = False

    # -- building ---------------------------------------------------------------------------
    def input(self, meta: Meta, name: str = "") -> Node:
        """Append a graph input (all inputs must come before any op)."""
        if self.nodes and not self.nodes[-1].is_input:
            raise GraphError(f"input {name!r} added after op nodes: add all inputs first")
        node = Node(len(self.nodes), INPUT, meta=meta, name=name or f"in{len(self.nodes)}")
        self.nodes.append(node)
        return node

    def call(
        self,
        op: Any,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        meta: Meta = None,
        *,
        name: str = "",
        source: str | None = None,
        flops: int | None = None,
    ) -> Node:
        """Append ``op(*args, **kwargs)``; ``meta`` is inferred on the meta device when omitted."""
        kwargs = dict(kwargs or {})
        if meta is None or flops is None:
            meta, flops = _meta_and_flops(op, args, kwargs, meta, flops)
        node = Node(
            id=len(self.nodes), op=op, args=tuple(args), kwargs=kwargs, meta=meta,
            flops=flops, name=name or str(len(self.nodes)), source=source,
        )
        self.nodes.append(node)
        return node

    def set_outputs(self, outputs: Sequence[Any]) -> None:
        self.outputs = tuple(outputs)

    # -- derived views ----------------------------------------------------------------------
    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.is_input]

    @property
    def ops(self) -> list[Node]:
        return [n for n in self.nodes if not n.is_input]

    @property
    def output_nodes(self) -> list[Node]:
        return list(dict.fromkeys(o for o in self.outputs if isinstance(o, Node)))

    @property
    def draws_random(self) -> bool:
        """Whether any op draws random numbers: a second call gives other values."""
        return any(n.kind == "random" for n in self.nodes)

    def users(self) -> dict[Node, list[Node]]:
        """Consumers of each node, in topological order."""
        users: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                users[i].append(n)
        return users

    def last_uses(self) -> dict[Node, Node | None]:
        """For each node, the last node that reads it (None: only an output, or unused).

        One reverse pass. A view keeps its base alive: the base's last use is the view's.
        """
        last: dict[Node, Node | None] = {}
        for n in reversed(self.nodes):
            for i in n.inputs:
                if i not in last:
                    last[i] = n
        # a base lives as long as the views of it: propagate from views to bases
        for n in reversed(self.nodes):
            end = last.get(n)
            for base in n.aliases:
                if end is not None and (last.get(base) is None or last[base].id < end.id):
                    last[base] = end
        outs = set(self.output_nodes)
        for n in self.nodes:
            if n in outs:
                last[n] = None
            else:
                last.setdefault(n, None)
        return last

    # -- checks and reports -----------------------------------------------------------------
    def verify(self) -> None:
        """Raise :class:`GraphError` unless every invariant of this module holds."""
        seen: set[Node] = set()
        inputs_done = False
        for pos, n in enumerate(self.nodes):
            if n.id != pos:
                raise GraphError(f"node {n!r} has id {n.id} but stands at position {pos}")
            if n.is_input:
                if inputs_done:
                    raise GraphError(f"input {n!r} stands after op nodes")
            else:
                inputs_done = True
                for i in n.inputs:
                    if i not in seen:
                        raise GraphError(
                            f"node {n!r} ({op_name(n.op)}) uses {i!r} before it is defined "
                            "(not topologically ordered, or a cycle)")
                if n.meta is None and n.op is not operator.getitem:
                    raise GraphError(f"node {n!r} ({op_name(n.op)}) has no output metadata")
            seen.add(n)
        for o in self.outputs:
            if isinstance(o, Node) and o not in seen:
                raise GraphError(f"output {o!r} is not a node of this graph")

    def totals(self) -> GraphTotals:
        ops = self.ops
        return GraphTotals(
            nodes=len(ops),
            flops=sum(n.flops for n in ops),
            bytes=sum(n.out_bytes for n in ops),
            ops_by_kind=dict(Counter(n.kind for n in ops)),
        )

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        return self.format()

    def format(self, annotate: Callable[[Node], str] | None = None) -> str:
        """Readable listing; ``annotate(node)`` may add a column (e.g. a placement)."""
        def arg(a: Any) -> str:
            if isinstance(a, Node):
                return repr(a)
            if isinstance(a, (list, tuple)):
                return "[" + ", ".join(arg(x) for x in a) + "]"
            return repr(a)

        def meta_str(m: Meta) -> str:
            if isinstance(m, TensorMeta):
                return f"{m}@{m.device}"
            if isinstance(m, ScalarMeta):
                return f"{m}@host"
            if isinstance(m, tuple):
                return "(" + ", ".join(meta_str(x) for x in m) + ")"
            return "-"

        ins = ", ".join(f"{n!r}: {meta_str(n.meta)}" for n in self.inputs)
        lines = [f"graph {self.name}({ins}):"]
        for n in self.ops:
            call = f"{op_name(n.op)}(" + ", ".join(
                [arg(a) for a in n.args] + [f"{k}={arg(v)}" for k, v in n.kwargs.items()]) + ")"
            cols = [f"  {n!r} = {call}", meta_str(n.meta)]
            if n.flops:
                cols.append(f"{n.flops / 1e9:.3g} GFLOP")
            if annotate is not None:
                cols.append(annotate(n))
            if n.source:
                cols.append(f"# {n.source}")
            lines.append("  ".join(cols))
        lines += textwrap.wrap(f"return ({', '.join(arg(o) for o in self.outputs)})", width=96,
                               initial_indent="  ", subsequent_indent="          ")
        lines.append(f"  # {self.totals()}")
        return "\n".join(lines)


_MEMO: dict[Any, tuple[Meta, int]] = {}
_MEMO_MAX = 1 << 16


def _meta_and_flops(op: Any, args: tuple, kwargs: dict, meta: Meta,
                    flops: int | None) -> tuple[Meta, int]:
    """``meta`` (inferred where None) and ``flops`` (counted where None) of a new node, from a
    memo keyed by the op, its arguments' metadata and its plain arguments (each with its
    type: ``1`` and ``1.0`` promote differently): a pass that emits the same op on the same
    shapes many times (a layer per block, a shard per device) runs the meta kernel and the FLOP
    formula once. Unhashable arguments are not memoized."""
    key = _memo_key((op, args, kwargs, meta))
    got = _MEMO.get(key) if key is not None else None
    if got is None:
        m = _infer_meta(op, args, kwargs) if meta is None else meta
        got = (m, _flops(op, args, kwargs, m))
        if key is not None:
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            _MEMO[key] = got
    return got[0], got[1] if flops is None else flops


def _memo_key(x: Any) -> Any:
    """A hashable stand-in for ``x`` (a node by its tensor metadata), or None."""
    if isinstance(x, Node):
        return ("node", x.meta) if isinstance(x.meta, TensorMeta) else None
    if isinstance(x, (list, tuple)):
        items = [_memo_key(v) for v in x]
        return None if any(i is None and v is not None for i, v in zip(items, x)) else \
            (type(x).__name__, tuple(items))
    if isinstance(x, dict):
        items = {k: _memo_key(v) for k, v in x.items()}
        return None if any(i is None and x[k] is not None for k, i in items.items()) else \
            ("dict", tuple(sorted(items.items(), key=lambda kv: str(kv[0]))))
    try:
        hash(x)
    except TypeError:
        return None
    return (type(x), x)


def _infer_meta(op: Any, args: tuple, kwargs: dict) -> Meta:
    """Run ``op`` on meta tensors to learn its output metadata (keeping eager devices)."""
    if op is operator.getitem:
        base, idx = args
        return base.meta[idx] if isinstance(base.meta, tuple) else None

    metas = [leaf.meta for leaf in tree_flatten((args, kwargs))[0]
             if isinstance(leaf, Node) and isinstance(leaf.meta, TensorMeta)]
    # as in eager: a 0-dim CPU tensor is a scalar argument; the other tensors decide the device
    devices = [m.device for m in metas if not (m.shape == () and m.device == "cpu")] or [
        m.device for m in metas]

    def to_meta(x: Any) -> Any:
        if isinstance(x, Node):
            if not isinstance(x.meta, TensorMeta):
                raise GraphError(f"cannot infer metadata: input {x!r} is not a single tensor")
            return x.meta.as_meta_tensor()
        if isinstance(x, torch.device):
            return torch.device("meta")
        return x

    out = op(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    device = str(kwargs.get("device") or (devices[0] if devices else "cpu"))

    def to_info(t: Any) -> TensorMeta | None:
        if not isinstance(t, torch.Tensor):
            return None
        m = TensorMeta.of(t)
        return TensorMeta(m.shape, m.dtype, m.stride, device, m.nbytes)

    if isinstance(out, (tuple, list)):
        return tuple(to_info(t) for t in out)
    return to_info(out)


def plain(x: Any, leaf: Callable[[Any], Any] = lambda v: v) -> Any:
    """``x`` with every list, tuple and dict in it rebuilt as a plain one (fx's immutable
    containers become lists and dicts: ops take lists), each other value mapped by ``leaf``.

    ``torch.utils._pytree.tree_map`` and ``torch.fx.node.map_aggregate`` keep fx's immutable
    containers (and namedtuples), so they would not do here."""
    if isinstance(x, list):
        return [plain(v, leaf) for v in x]
    if isinstance(x, tuple):
        return tuple(plain(v, leaf) for v in x)
    if isinstance(x, dict):
        return {k: plain(v, leaf) for k, v in x.items()}
    return leaf(x)

"""Fold: tensor constants made inside the function become Python numbers at capture time.

``torch.tensor(10.0, device=A.device)`` in user code reaches :func:`autopar.capture.fx.from_fx` as a
``get_attr`` (``_tensor_constant0``, a real tensor) copied by ``aten.lift_fresh_copy`` and perhaps
moved and cast (``_to_copy``, ``clone``, ``detach``...), then used by arithmetic (``a1 * A``,
``a1 ** 2``) or read to the host (``_local_scalar_dense``: ``.item()``, a tensor slice bound).
Kept as they are, each call moves the constant to the GPU, launches kernels on it or reads it
back. :func:`fold_constants` rewrites the fx graph before conversion, the way Inductor folds such
constants into its kernels.

Policy
- Known values: a ``get_attr`` tensor whose every user is ``aten.lift_fresh_copy`` (or
  ``lift_fresh``): the ``torch.tensor(literal)`` pattern, a fresh copy of a value the graph
  owns. A bare ``get_attr`` is not known: ``make_fx`` (trace_fake, data_parallel) records a
  tensor the traced code closes over that way, by reference, and the user may change it
  between calls. Then the result of an ATen op all of whose tensor arguments are known and whose
  other arguments are plain Python values (factory ops such as ``full([], 1.0)`` have none):
  deterministic (not ``nondeterministic_seeded`` or ``nondeterministic_bitwise``, no ``empty``),
  not mutating, with a static result of at most ``MAX_NUMEL`` elements whose dtype and shape
  are the fx node's. It is computed now, on CPU copies, with the op itself (``device=`` kwargs
  become the host).
- Where eager computes a value on another device than the host (a GPU), the host computes it
  bit for bit the same only for ops that are exact in IEEE arithmetic on both: moves, casts
  (but float to integer), views, ``neg``, ``abs``, comparisons, ``add``/``sub`` without
  ``alpha``, ``mul``, true ``div``, ``pow`` by 2, fills. Anything else (``exp``, ``sqrt``,
  ``pow`` by 0.5...) is left to run as before.
- Rewrites, only these:
  1. ``aten._local_scalar_dense(c)`` of a known ``c`` becomes the number ``.item()`` gives;
     its users take that number. The metadata downstream, which dynamo recorded with unbacked
     symbols for the read (``u0``), is then computed again with a fresh fake-tensor pass over
     the whole graph; every value that was static must come out the same, else these reads
     are not folded (e.g. the graph also reads an input to the host: a fake pass without
     dynamo's shape environment can't follow it).
  2. Size queries (``sym_size``...) whose value is now a known int, and Python arithmetic on
     numbers (``operator.add``, ``torch.sym_max``...) all of whose arguments are numbers,
     become numbers; ``_assert_scalar`` of a true number and ``sym_constrain_range(_for_size)``
     that passes for a number are dropped. A check that fails is left in place.
  3. ``aten.add/sub/mul/div.Tensor(x, c)`` with ``x`` a tensor of at least one dimension, ``c``
     a known 0-dim constant, no ``alpha`` or ``rounding_mode``: ``c`` becomes a Python number
     (``bool``/``int``/``float`` by its dtype; complex is left alone); ``add``/``mul`` with
     ``c`` first are swapped (``x * c``). Only where the op gives the same dtype, shape and
     strides with the number (0-dim tensors and Python numbers promote differently: an int
     ``x`` times a float64 0-dim tensor is float64, times a float is float32), and ``c`` is
     exactly representable in the result's dtype where it is an integer, eager has it on a
     GPU, or it comes first: there eager rounds the 0-dim tensor to the result's dtype before
     the op (``c * x`` of a float16 ``x`` on the host too), while a number second is taken at
     the op's compute precision (float for float16).
- Nodes left without users by these rewrites (the constant's chain, folded reads and sizes)
  are removed; nothing else is. A known constant that is a graph output, or feeds anything
  not rewritten, keeps its chain: it is produced as today, on eager's device, in eager's dtype.

Invariants
- Results bit for bit eager's; no new syncs (fewer: a read of a constant needs none).
- Nothing that depends on an input is folded; random and mutating ops are never evaluated, and
  if any op writes into a known value nothing is folded (``copy_(input, c)`` only reads ``c``).
- The caller's GraphModule is never modified: a folded graph is a new GraphModule. Anything
  unexpected (an exception anywhere in the pass) is logged at debug level and the original is
  returned: folding can only lose an optimization, never change a result or fail a capture.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.node import map_aggregate, map_arg

from ..ir.graph import LOCAL_SCALAR_DENSE, annotated_args, plain
from ..ir.ops import SCALAR_FUNCTIONS, SIZE_OPS, known_number

log = logging.getLogger("autopar.capture")

__all__ = ["MAX_NUMEL", "fold_constants"]

MAX_NUMEL = 64
"""The largest constant (in elements) whose value the pass computes: the constants it folds are
0-dim, but they may be read from a small one (``torch.tensor([2, 6])[0]``)."""

_aten = torch.ops.aten
_LIFTS = frozenset({_aten.lift_fresh_copy.default, _aten.lift_fresh.default})
_ASSERT = _aten._assert_scalar.default
_CONSTRAINTS = frozenset({_aten.sym_constrain_range.default,
                          _aten.sym_constrain_range_for_size.default})
_BINARY = frozenset({_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor})
_COMMUTATIVE = frozenset({_aten.add.Tensor, _aten.mul.Tensor})


def _overloads(*packets: Any) -> frozenset:
    return frozenset(getattr(p, name) for p in packets for name in p.overloads())


_EXACT = _overloads(
    _aten.lift_fresh_copy, _aten.lift_fresh, _aten._to_copy, _aten.clone, _aten.detach,
    _aten.alias, _aten.view, _aten._unsafe_view, _aten.reshape, _aten.squeeze, _aten.unsqueeze,
    _aten.select, _aten.expand, _aten.permute, _aten.t, _aten.neg, _aten.abs,
    _aten.add, _aten.sub, _aten.mul, _aten.div, _aten.pow, _aten.eq, _aten.ne, _aten.lt,
    _aten.le, _aten.gt, _aten.ge, _aten.logical_not, _aten.full, _aten.scalar_tensor,
    _aten.ones, _aten.zeros, _aten.full_like, _aten.ones_like, _aten.zeros_like, _aten.fill)
"""Ops whose result is the same bit for bit on the host and on a GPU (with the conditions
:func:`_exact_everywhere` adds)."""

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.layout, torch.memory_format)


def fold_constants(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its constants folded (see the module docstring), or ``gm`` itself when there
    is nothing to fold or anything goes wrong."""
    try:
        with unset_fake_temporarily():  # the backend runs inside fake tensor tracing
            folded = _Fold(gm, fold_reads=True).run()
            if folded is _RETRY:
                folded = _Fold(gm, fold_reads=False).run()
    except Exception as e:
        log.debug("autopar: constant folding left the graph unchanged: %s: %s",
                  type(e).__name__, e, exc_info=True)
        return gm
    return gm if folded is None or folded is _RETRY else folded


_RETRY = object()
"""What a pass that folded reads returns when the metadata after them can't be recomputed."""


class _Fold:
    """One folding pass over a copy of ``gm``'s graph."""

    def __init__(self, gm: torch.fx.GraphModule, fold_reads: bool) -> None:
        self.gm = gm
        self.fold_reads = fold_reads
        self.values: dict[torch.fx.Node, torch.Tensor] = {}  # known tensors, on the host
        self.remote: set[torch.fx.Node] = set()  # ...of them, those eager has off the host

    # -- analysis, on the caller's graph (read only) ---------------------------------------
    def run(self) -> Any:
        for node in self.gm.graph.nodes:
            self._learn(node)
        if not self.values:
            return None
        for node in self.gm.graph.nodes:
            if any(a in self.values for a in _written(node)):
                log.debug("autopar: %s writes into a constant: not folding", node.name)
                return None
        return self._rewrite()

    def _learn(self, node: torch.fx.Node) -> None:
        if node.op == "get_attr":
            value = getattr(self.gm, node.target, None)  # type: ignore[arg-type]
            if (isinstance(value, torch.Tensor) and value.layout == torch.strided
                    and not value.is_complex() and value.numel() <= MAX_NUMEL and node.users
                    and all(u.op == "call_function" and u.target in _LIFTS
                            for u in node.users)):
                self.values[node] = value.detach().cpu()
                if value.device.type != "cpu":
                    self.remote.add(node)
            return
        if node.op != "call_function":
            return
        inputs = node.all_input_nodes
        if any(n not in self.values for n in inputs) or not _evaluable(node.target):
            return
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.layout == torch.strided
                and not val.is_complex()):
            return
        shape = [known_number(s) for s in val.shape]
        if any(s is None for s in shape) or val.numel() > MAX_NUMEL:
            return
        remote = val.device.type != "cpu" or any(n in self.remote for n in inputs)
        if remote and not _exact_everywhere(node):
            return
        host = self._host_args(node.args, dict(node.kwargs))
        if host is None:
            return
        args, kwargs = host
        try:
            out = node.target(*args, **kwargs)
        except Exception as e:  # the op raises here as it will when it runs: leave it
            log.debug("autopar: not folding %s: %s: %s", node.name, type(e).__name__, e)
            return
        if (isinstance(out, torch.Tensor) and out.dtype == val.dtype
                and tuple(out.shape) == tuple(shape) and out.device.type == "cpu"):
            self.values[node] = out
            if remote:
                self.remote.add(node)

    def _host_args(self, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict] | None:
        """``args`` and ``kwargs`` with known nodes replaced by their host values, and a
        ``device`` kwarg by the host; None if any other leaf is not a plain Python value."""
        ok = [True]

        def leaf(x: Any) -> Any:
            if isinstance(x, torch.fx.Node):
                return self.values[x]
            if not isinstance(x, _PLAIN):
                ok[0] = False
            return x

        device = kwargs.pop("device", None)
        args, kwargs = plain(map_aggregate((args, kwargs), leaf))
        if not ok[0] or not (device is None or isinstance(device, torch.device)):
            return None
        if device is not None:
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return args, kwargs

    # -- rewriting, on a copy ------------------------------------------------------------------
    def _rewrite(self) -> Any:
        graph = torch.fx.Graph()
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        graph._codegen = self.gm.graph._codegen
        graph.output(graph.graph_copy(self.gm.graph, copies))  # node_copy copies each meta
        values = {copies[n]: v for n, v in self.values.items()}
        remote = {copies[n] for n in self.remote}
        owned = set(values)  # nodes this pass may remove once nothing uses them
        changed = 0

        numbers: dict[torch.fx.Node, Any] = {}
        if self.fold_reads:
            for node in graph.nodes:
                if node.op == "call_function" and node.target is LOCAL_SCALAR_DENSE:
                    value = values.get(node.args[0])
                    number = _read(value, node.meta.get("val")) if value is not None else None
                    if number is not None:
                        numbers[node] = number
            if numbers:
                changed += sum(_substitute(node, number) for node, number in numbers.items())
                owned |= set(numbers)
                if not _propagate(graph, self.gm, values, numbers):
                    log.debug("autopar: the metadata after folding %d reads can't be computed "
                              "again: the reads stay", len(numbers))
                    return _RETRY

        for node in list(graph.nodes):
            done = _fold_scalar(node)
            if done is _DROPPED:
                graph.erase_node(node)
                changed += 1
            elif done is not None:
                changed += _substitute(node, done)
                owned.add(node)

        for node in graph.nodes:
            changed += _fold_operand(node, values, remote)

        for node in reversed(list(graph.nodes)):
            if node in owned and not node.users:
                graph.erase_node(node)
        if not changed:
            return None
        graph.lint()
        try:  # its Python code is generated when it first runs: from_fx only reads the graph
            from torch.fx._lazy_graph_module import _LazyGraphModule as Module  # private
        except ImportError:
            Module = torch.fx.GraphModule
        folded = Module(self.gm, graph, class_name=type(self.gm).__name__)
        folded.meta = dict(getattr(self.gm, "meta", {}))
        log.debug("autopar: folded constants (%d rewrites):\n%s", changed, graph)
        return folded


# -- pieces ----------------------------------------------------------------------------------

def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` may write into: its mutable arguments (``copy_(input, c)`` writes
    the input, not ``c``); every input of a callable that is not an ATen op or arithmetic."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem or target in SCALAR_FUNCTIONS:
        return []
    if not isinstance(target, torch._ops.OpOverload):
        return node.all_input_nodes
    if not target._schema.is_mutable:
        return []
    written: list[torch.fx.Node] = []
    for info, value in annotated_args(target, node.args, node.kwargs):
        if info.is_write:
            map_arg(value, written.append)
    return written


def _evaluable(target: Any) -> bool:
    """A deterministic, non-mutating ATen op whose value the host may compute at capture."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    tags = target.tags
    return not (target._schema.is_mutable or "empty" in target._schema.name
                or torch.Tag.nondeterministic_seeded in tags
                or torch.Tag.nondeterministic_bitwise in tags
                or torch.Tag.dynamic_output_shape in tags
                or target is LOCAL_SCALAR_DENSE or target in SIZE_OPS)


def _exact_everywhere(node: torch.fx.Node) -> bool:
    """Whether the host computes ``node`` bit for bit as a GPU does (see :data:`_EXACT`)."""
    target = node.target
    if target not in _EXACT:
        return False
    name = target._schema.name  # type: ignore[union-attr]
    if name in ("aten::add", "aten::sub") and node.kwargs.get("alpha", 1) != 1:
        return False  # a + alpha * b may or may not be one fused multiply-add
    if name == "aten::div" and node.kwargs.get("rounding_mode") is not None:
        return False
    if name == "aten::pow":
        val = node.meta["val"]
        if target is not _aten.pow.Tensor_Scalar or node.args[1] != 2 or val.dtype not in (
                torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                torch.int64, torch.uint8):
            return False
    if name == "aten::_to_copy":
        src = node.args[0].meta.get("val")  # type: ignore[union-attr]
        dtype = node.meta["val"].dtype
        if isinstance(src, torch.Tensor) and src.is_floating_point() and not (
                dtype.is_floating_point or dtype == torch.bool):
            return False  # float -> int of a value out of range is undefined behaviour
    return True


def _read(value: torch.Tensor, val: Any) -> Any:
    """The number ``.item()`` gives for ``value``, if it agrees with the traced ``val``."""
    if value.numel() != 1 or value.is_complex():
        return None
    number = LOCAL_SCALAR_DENSE(value)
    kinds = ((bool, torch.SymBool), (int, torch.SymInt), (float, torch.SymFloat))
    if not any(type(number) is kind and isinstance(val, (kind, sym)) for kind, sym in kinds):
        return None
    known = known_number(val)
    if known is not None and known != number:
        return None
    return number


def _substitute(node: torch.fx.Node, number: Any) -> int:
    """Give ``number`` to the users of ``node`` (the graph's output keeps the node itself)."""
    done = 0
    for user in list(node.users):
        if user.op == "output":
            continue
        user.args = map_arg(user.args, lambda n: number if n is node else n)
        user.kwargs = map_arg(user.kwargs, lambda n: number if n is node else n)
        done += 1
    return done


_DROPPED = object()


def _fold_scalar(node: torch.fx.Node) -> Any:
    """The number a size query or scalar arithmetic now is (None: not known), or _DROPPED for
    a check that passes for numbers."""
    if node.op != "call_function":
        return None
    target = node.target
    if target in SIZE_OPS:
        return known_number(node.meta.get("val"))
    if node.all_input_nodes:
        return None
    args, kwargs = plain(node.args), plain(dict(node.kwargs))
    if not all(isinstance(a, _PLAIN) for a in (*args, *kwargs.values())):
        return None
    if target is _ASSERT:
        return _DROPPED if args and args[0] is not None and bool(args[0]) else None
    if target in _CONSTRAINTS:
        try:
            target(*args, **kwargs)  # type: ignore[operator]
        except Exception:
            return None  # fails as eager would: left to fail when it runs
        return _DROPPED
    if target in SCALAR_FUNCTIONS:
        number = target(*args, **kwargs)  # type: ignore[operator]
        known = known_number(node.meta.get("val"))
        if not isinstance(number, bool | int | float) or (known is not None and known != number):
            return None
        return number
    return None


def _number_of(c: torch.Tensor) -> bool | int | float | None:
    if c.dtype == torch.bool:
        return bool(c.item())
    if c.is_floating_point():
        return float(c.item())
    if c.is_complex():
        return None
    return int(c.item())


def _fold_operand(node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor],
                  remote: set[torch.fx.Node]) -> int:
    """Rewrite 3 of the module docstring on ``node``; 1 if it was rewritten."""
    if node.op != "call_function" or node.target not in _BINARY or node.kwargs:
        return 0
    if len(node.args) != 2:
        return 0
    a, b = node.args
    if isinstance(b, torch.fx.Node) and b in values and values[b].dim() == 0:
        x, c = a, b
    elif (node.target in _COMMUTATIVE and isinstance(a, torch.fx.Node) and a in values
          and values[a].dim() == 0):
        x, c = b, a
    else:
        return 0
    x_val, out = (x.meta.get("val") if isinstance(x, torch.fx.Node) else None), node.meta.get("val")
    if not (isinstance(x_val, torch.Tensor) and x_val.dim() > 0 and isinstance(out, torch.Tensor)):
        return 0
    value = values[c]
    number = _number_of(value)
    if number is None:
        return 0
    if (not value.is_floating_point() or c in remote or c is not b) and not torch.equal(
            value.to(out.dtype).to(value.dtype), value):
        return 0  # eager rounds such a constant to the result's dtype first (see the policy)
    if not _same_result(node.target, x_val, number, out):
        return 0
    node.args = (x, number)
    return 1


def _static_ints(xs: Any) -> tuple[int, ...] | None:
    out = tuple(known_number(x) for x in xs)
    return None if any(not isinstance(v, int) for v in out) else out  # type: ignore[return-value]


def _same_result(target: Callable, x: torch.Tensor, number: Any, out: torch.Tensor) -> bool:
    """Whether ``target(x, number)`` has ``out``'s dtype, shape and strides (on meta tensors)."""
    shape, stride = _static_ints(x.shape), _static_ints(x.stride())
    want = (_static_ints(out.shape), _static_ints(out.stride()))
    if shape is None or stride is None or None in want:
        return False
    meta = torch.empty_strided(shape, stride, dtype=x.dtype, device="meta")
    try:
        got = target(meta, number)
    except Exception:
        return False
    return (got.dtype == out.dtype and tuple(got.shape) == want[0]
            and tuple(got.stride()) == want[1])


def _signature(v: Any) -> Any:
    """A comparable summary of a static traced value; None where anything is symbolic."""
    if isinstance(v, torch.Tensor):
        shape, stride = _static_ints(v.shape), _static_ints(v.stride())
        offset = known_number(v.storage_offset())
        if shape is None or stride is None or not isinstance(offset, int):
            return None
        return ("tensor", shape, stride, offset, v.dtype, v.device)
    if isinstance(v, (tuple, list)):
        parts = [_signature(x) for x in v]
        return None if any(p is None for p in parts) else ("seq", *parts)
    if v is None:
        return ("none",)
    number = known_number(v)
    if number is None:
        return None
    return (type(number).__name__, number)


def _fake_like(mode: Any, v: torch.Tensor) -> torch.Tensor | None:
    shape, stride = _static_ints(v.shape), _static_ints(v.stride())
    offset = known_number(v.storage_offset())
    if shape is None or stride is None or not isinstance(offset, int):
        return None
    with mode:
        if offset == 0:
            return torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
        size = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(
            shape) else offset
        base = torch.empty((size,), dtype=v.dtype, device=v.device)
        return base.as_strided(shape, stride, offset)


def _propagate(graph: torch.fx.Graph, gm: torch.fx.GraphModule,
               values: dict[torch.fx.Node, torch.Tensor],
               numbers: dict[torch.fx.Node, Any]) -> bool:
    """Compute every node's traced value again with the folded numbers, in a fake tensor mode
    without symbols; check the static ones, update the symbolic ones. False if it can't."""
    mode = FakeTensorMode()
    env: dict[torch.fx.Node, Any] = {}
    updates: dict[torch.fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        old = node.meta.get("val")
        if node in numbers:
            new: Any = numbers[node]
        elif node.op == "placeholder" or (node in values and isinstance(old, torch.Tensor)):
            if not isinstance(old, torch.Tensor):
                return False
            new = _fake_like(mode, old)
            if new is None:
                return False
        elif node.op == "get_attr":
            new = mode.from_tensor(getattr(gm, node.target))  # type: ignore[arg-type]
        elif node.op == "call_function":
            args = map_arg(node.args, lambda n: env[n])
            kwargs = map_arg(node.kwargs, lambda n: env[n])
            with mode:
                new = node.target(*plain(args), **plain(dict(kwargs)))  # type: ignore[operator]
        else:
            return False
        env[node] = new
        if old is None and node.op == "get_attr":
            continue
        before, after = _signature(old), _signature(new)
        if after is None:
            return False
        if before is None:
            updates[node] = new
        elif before != after:
            log.debug("autopar: %s is %s again, was %s", node.name, after, before)
            return False
    for node, new in updates.items():
        node.meta["val"] = new
    return True

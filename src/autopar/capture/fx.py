"""Capture: an fx GraphModule of ATen ops turned into an autopar Graph.

Policy
- The graphs come from the dynamo backend of :mod:`autopar.capture.dynamo` (functional ATen,
  through ``aot_autograd``) or from fake tracing (:mod:`autopar.capture.fake`).
- :func:`from_fx` converts one aot_autograd ``GraphModule`` into a :class:`~autopar.ir.graph.Graph`:
  placeholders (then tensor constants from ``get_attr``) become graph inputs, ``call_function``
  nodes become op nodes with metadata read from the fake values dynamo recorded.
- Scalar reads stay in the graph (with ``torch._dynamo.config.capture_scalar_outputs``, which
  :func:`autopar.compile` turns on): ``aten._local_scalar_dense`` (``.item()``, a tensor used as
  a slice bound) becomes a node whose value is a Python number (:class:`ScalarMeta`), read once
  per input tensor however often dynamo asked for it; arithmetic on such numbers
  (``operator.add``, ``torch.sym_max``...) and runtime asserts on them are nodes too, and the
  tensor ops that take them as arguments refer to them. ``aten.sym_size`` and friends whose
  value is a known int become that int, as does a known number among an op's outputs (cuDNN's
  and flash attention's ``max_q`` and ``max_k``, the sequence lengths): its ``getitem`` is
  that number, the op's metadata has None in its place.
- Tensor constants made inside the function (``torch.tensor(10.0, device=A.device)``) are
  folded first (:func:`autopar.capture.fold.fold_constants`): arithmetic on them is computed at
  capture time, ``a1 * A`` takes a Python number, ``.item()`` of one is that number; only where the
  result stays bit for bit eager's.
- A 0-dim tensor constant on a GPU that is left after folding is kept on the host and moved
  where eager has it by an ``aten._to_copy`` node: placement may run that move, and the
  arithmetic after it, on the host (see :func:`autopar.ir.routing.host_scalars`).
- Anything the Graph can't represent exactly (symbolic shapes, as when a slice bound read from
  a tensor decides an output's shape; dynamic-shape inputs; other non-ATen callables; other ops
  on non-tensor values; missing metadata) raises :class:`Unsupported`; the backend then runs
  that fx graph eagerly and logs one reason on the ``autopar`` logger. Never a wrong result.
  A graph dynamo made dynamic (new shapes at a later call, or ``mark_dynamic``) is the
  exception: it gets one static graph per concrete signature at call time
  (:class:`autopar.capture.shapes.PerShape`).
- Capture decides nothing about devices: :mod:`autopar.api` hands the Graph to the stages
  after it (place, plan, run).
"""

from __future__ import annotations

import logging
import operator
import os
import re
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ir.graph import LOCAL_SCALAR_DENSE, Graph, Node, ScalarMeta, TensorMeta, plain
from ..ir.ops import SCALAR_FUNCTIONS, SCALAR_OPS, SIZE_OPS, known_number
from .fold import fold_constants

log = logging.getLogger("autopar.capture")

__all__ = ["Unsupported", "from_fx", "kept_unused", "source_of"]


class Unsupported(Exception):
    """This fx graph can't be represented exactly; it will run eagerly instead."""


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_LIBRARY_PATHS = (f"{os.sep}torch{os.sep}", f"{os.sep}autopar{os.sep}")


def source_of(fx_node: torch.fx.Node) -> str | None:
    """``file.py:line`` of the innermost user frame that produced this fx node."""
    frames = _FRAME.findall(fx_node.meta.get("stack_trace") or "")
    user = [f for f in frames if not any(part in f[0] for part in _LIBRARY_PATHS)]
    if not (user or frames):
        return None
    path, line = (user or frames)[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _meta_of(value: Any, what: str) -> Any:
    """TensorMeta (or a tuple of them) for a fake value; raise Unsupported otherwise."""
    if isinstance(value, torch.Tensor):
        if any(known_number(s) is None for s in (*value.shape, *value.stride())):
            raise Unsupported(f"{what} has a symbolic shape {tuple(value.shape)}")
        if value.layout != torch.strided:
            raise Unsupported(f"{what} has layout {value.layout}")
        return TensorMeta.of(value)
    if isinstance(value, (tuple, list)):  # a number among them is no value of the graph's
        return tuple(None if v is None or _known_element(v) else _meta_of(v, what)
                     for v in value)
    if value is None:
        return None
    raise Unsupported(f"{what} produces {type(value).__name__} {value!r}, not a tensor")


def _known_element(value: Any) -> bool:
    """Whether an element of an op's tuple of outputs is a number known at capture time
    (cuDNN's and flash attention's ``max_q``, ``max_k``: the sequence lengths): a ``getitem``
    of it becomes that number, as a known size does."""
    return not isinstance(value, torch.Tensor) and known_number(value) is not None


def _check_constant(x: Any, what: str) -> Any:
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Unsupported(f"{what} takes a symbolic value {x}")
    if isinstance(x, torch.Tensor):
        raise Unsupported(f"{what} takes a tensor that is not a graph value")
    return x


_aten = torch.ops.aten
_TO_COPY = _aten._to_copy.default


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A real copy of a constant on the host (the backend runs inside fake tensor tracing)."""
    with unset_fake_temporarily():
        return t.detach().cpu()


def from_fx(gm: torch.fx.GraphModule, name: str = "graph") -> tuple[Graph, list[torch.Tensor]]:
    """Convert an aot_autograd GraphModule into a Graph.

    Returns the graph and the constant tensors (``get_attr``) to append to the call's arguments:
    the graph's inputs are the placeholders followed by those constants. Constants made inside
    the function are folded first (:func:`autopar.capture.fold.fold_constants`; ``gm`` is not
    changed).
    """
    folded = fold_constants(gm)
    graph = Graph(name)
    graph.folded, gm = folded is not gm, folded
    env: dict[torch.fx.Node, Node] = {}
    constants: list[torch.Tensor] = []

    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            val = fx_node.meta.get("val")
            if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
                raise Unsupported(f"input {fx_node.name} is a symbolic shape value "
                                  "(dynamic shapes are not placed)")
            if val is None or not isinstance(val, torch.Tensor):
                raise Unsupported(f"input {fx_node.name} is not a tensor ({type(val).__name__})")
            env[fx_node] = graph.input(_meta_of(val, f"input {fx_node.name}"), fx_node.name)
    moved: list[tuple[torch.fx.Node, Node, TensorMeta]] = []
    for fx_node in gm.graph.nodes:
        if fx_node.op == "get_attr":
            value = getattr(gm, fx_node.target)
            if not isinstance(value, torch.Tensor):
                raise Unsupported(f"attribute {fx_node.target} is a {type(value).__name__}")
            meta = TensorMeta.of(value)
            if meta.shape == () and meta.device != "cpu":
                value = _on_host(value)
            env[fx_node] = graph.input(TensorMeta.of(value), fx_node.name)
            constants.append(value)
            if value.device.type != meta.device.split(":")[0]:
                moved.append((fx_node, env[fx_node], meta))
    for fx_node, host, meta in moved:  # a 0-dim constant lives on the host, moved as eager has it
        env[fx_node] = graph.call(_TO_COPY, (host,), {"device": torch.device(meta.device)},
                                  meta=meta, name=f"{fx_node.name}_to_device")

    def convert(x: Any, what: str) -> Any:
        return plain(x, lambda v: env[v] if isinstance(v, torch.fx.Node)
                     else _check_constant(v, what))

    reads: dict[torch.fx.Node, Node] = {}  # tensor -> its _local_scalar_dense: one read
    for fx_node in gm.graph.nodes:
        if fx_node.op in ("placeholder", "get_attr"):
            continue
        if fx_node.op == "output":
            (outs,) = fx_node.args
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            graph.set_outputs([convert(o, "output") for o in outs])
            continue
        if fx_node.op != "call_function":
            raise Unsupported(f"fx node {fx_node.name} is a {fx_node.op}")
        target = fx_node.target
        what = f"op {fx_node.name} ({target})"
        val = fx_node.meta.get("val")
        if target in SIZE_OPS:
            known = known_number(val)
            if known is None:
                raise Unsupported(f"{what} is a symbolic size {val}")
            env[fx_node] = known
            continue
        if target is _aten._assert_scalar.default and fx_node.args[0] is True:
            continue  # proved while tracing: nothing to check
        if target in SCALAR_OPS or target in SCALAR_FUNCTIONS:
            if target is LOCAL_SCALAR_DENSE and fx_node.args[0] in reads:
                env[fx_node] = reads[fx_node.args[0]]  # the tensor is read once per call
                continue
            try:
                meta = ScalarMeta.of(val)
            except TypeError:
                raise Unsupported(f"{what} has no scalar metadata ({val!r})") from None
            env[fx_node] = graph.call(
                target, convert(tuple(fx_node.args), what), convert(dict(fx_node.kwargs), what),
                meta=meta, name=fx_node.name, source=source_of(fx_node))
            if target is LOCAL_SCALAR_DENSE:
                reads[fx_node.args[0]] = env[fx_node]
            continue
        if not (isinstance(target, torch._ops.OpOverload) or target is operator.getitem):
            raise Unsupported(f"{what} is not an ATen op")
        if target is operator.getitem and not isinstance(fx_node.args[0].meta.get("val"),
                                                         (tuple, list)):
            raise Unsupported(f"{what} indexes a non-tuple value")
        if target is operator.getitem and _known_element(val):
            env[fx_node] = known_number(val)
            continue
        meta = _meta_of(val, what)
        if meta is None and target is not operator.getitem:
            raise Unsupported(f"{what} has no output metadata")
        env[fx_node] = graph.call(
            target, convert(tuple(fx_node.args), what), convert(dict(fx_node.kwargs), what),
            meta=meta, name=fx_node.name, source=source_of(fx_node))
    graph.verify()
    return graph, constants


def kept_unused(node: torch.fx.Node) -> bool:
    """Whether an fx node nothing reads stays in a graph (fx's ``eliminate_dead_code``'s
    ``is_impure_node``): fx's impure nodes (writes, trailing copies into inputs) and random
    draws (eager's generator advances by them). The rest is dead: batch norm's eval form
    returns empty statistics (53 ``empty`` in a ResNet-50's inference step, each an
    allocation a call)."""
    target = node.target
    return node.is_impure() or (isinstance(target, torch._ops.OpOverload)
                                and torch.Tag.nondeterministic_seeded in target.tags)

"""Capture: turn a user's function into autopar Graphs through ``torch.compile``.

Policy
- The ``"autopar"`` dynamo backend runs ``aot_autograd``, so every graph we see is functional
  ATen (no in-place ops but the final input-mutation epilogue that aot_autograd applies itself),
  and training gets a forward and a backward graph, each captured and run by autopar.
- :func:`from_fx` converts one aot_autograd ``GraphModule`` into a :class:`~autopar.graph.Graph`:
  placeholders (then tensor constants from ``get_attr``) become graph inputs, ``call_function``
  nodes become op nodes with metadata read from the fake values dynamo recorded.
- Anything the Graph can't represent exactly (symbolic shapes, non-ATen callables, ops on
  non-tensor values, missing metadata) raises :class:`Unsupported`; the backend then runs that
  fx graph eagerly and logs one reason on the ``autopar`` logger. Never a wrong result.
- Capture decides nothing about devices: :mod:`autopar.api` hands the Graph to the stages
  after it (place, plan, run).
"""

from __future__ import annotations

import logging
import operator
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .graph import Graph, Node, TensorMeta

log = logging.getLogger("autopar")

__all__ = ["Unsupported", "autopar_backend", "from_fx", "source_of"]


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
        if any(not isinstance(s, int) for s in value.shape):
            raise Unsupported(f"{what} has a symbolic shape {tuple(value.shape)}")
        if value.layout != torch.strided:
            raise Unsupported(f"{what} has layout {value.layout}")
        return TensorMeta.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(_meta_of(v, what) if v is not None else None for v in value)
    if value is None:
        return None
    raise Unsupported(f"{what} produces a {type(value).__name__}, not a tensor")


def _check_constant(x: Any, what: str) -> Any:
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Unsupported(f"{what} takes a symbolic value {x}")
    if isinstance(x, torch.Tensor):
        raise Unsupported(f"{what} takes a tensor that is not a graph value")
    return x


def from_fx(gm: torch.fx.GraphModule, name: str = "graph") -> tuple[Graph, list[torch.Tensor]]:
    """Convert an aot_autograd GraphModule into a Graph.

    Returns the graph and the constant tensors (``get_attr``) to append to the call's arguments:
    the graph's inputs are the placeholders followed by those constants.
    """
    graph = Graph(name)
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
    for fx_node in gm.graph.nodes:
        if fx_node.op == "get_attr":
            value = getattr(gm, fx_node.target)
            if not isinstance(value, torch.Tensor):
                raise Unsupported(f"attribute {fx_node.target} is a {type(value).__name__}")
            env[fx_node] = graph.input(TensorMeta.of(value), fx_node.name)
            constants.append(value)

    def convert(x: Any, what: str) -> Any:
        if isinstance(x, torch.fx.Node):
            return env[x]
        if isinstance(x, torch.fx.immutable_collections.immutable_list | list):
            return [convert(v, what) for v in x]
        if isinstance(x, tuple):
            return tuple(convert(v, what) for v in x)
        if isinstance(x, dict):
            return {k: convert(v, what) for k, v in x.items()}
        return _check_constant(x, what)

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
        if not (isinstance(target, torch._ops.OpOverload) or target is operator.getitem):
            raise Unsupported(f"{what} is not an ATen op")
        if target is operator.getitem and not isinstance(fx_node.args[0].meta.get("val"),
                                                         (tuple, list)):
            raise Unsupported(f"{what} indexes a non-tuple value")
        meta = _meta_of(fx_node.meta.get("val"), what)
        if meta is None and target is not operator.getitem:
            raise Unsupported(f"{what} has no output metadata")
        env[fx_node] = graph.call(
            target, convert(tuple(fx_node.args), what), convert(dict(fx_node.kwargs), what),
            meta=meta, name=fx_node.name, source=source_of(fx_node))
    graph.verify()
    return graph, constants


# -- the torch.compile backend -------------------------------------------------------------------

GraphRunner = Callable[[Graph, str], Callable[[Sequence[torch.Tensor]], Sequence[Any]]]
"""Builds the callable that runs one captured graph: (graph, phase) -> run(args) -> outputs."""


def _boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def _eager(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
    def run(args: list) -> Any:
        return gm(*args)
    return _boxed(run)


def make_backend(build: GraphRunner, name: str = "autopar") -> Callable:
    """A dynamo backend that captures each aot_autograd graph and runs it through ``build``."""
    from torch._dynamo.backends.common import aot_autograd

    counter = {"n": 0}

    def compiler(phase: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            counter["n"] += 1
            label = f"{name}_{phase}_{counter['n']}"
            try:
                graph, constants = from_fx(gm, label)
            except Unsupported as e:
                log.warning("autopar: running %s eagerly: %s", label, e)
                return _eager(gm)
            run = build(graph, phase)

            def call(args: list) -> Any:
                if constants:
                    args = [*args, *constants]
                return run(args)
            return _boxed(call)
        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
    )


_DEFAULT_BACKEND: list[Callable] = []


def autopar_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any):
    """The ``torch.compile(fn, backend="autopar")`` entry point.

    With default options, one runner (one machine and cost model) serves every graph of the
    process; options given through ``torch.compile(..., options=...)`` get a runner of their own.
    """
    from .api import Options, make_runner

    if options:
        return make_backend(make_runner(Options.parse(options)))(gm, example_inputs)
    if not _DEFAULT_BACKEND:
        _DEFAULT_BACKEND.append(make_backend(make_runner(Options.parse({}))))
    return _DEFAULT_BACKEND[0](gm, example_inputs)


# -- capture without running: for explain on machines that aren't at hand ----------------------

def trace_fake(fn: Callable, args: Sequence[Any], inputs_on: str | None = None,
               name: str | None = None) -> Graph:
    """Capture ``fn(*args)`` as a functional Graph without computing anything.

    Tensors among ``args`` (and an ``nn.Module``'s parameters and buffers) are replaced by fake
    tensors of the same shape, dtype and strides; those built on the CPU are taken to live on
    ``inputs_on`` (e.g. ``"cuda:0"``), so code written for a GPU can be explained on a CPU-only
    machine. In-place updates of inputs appear as ``aten.copy_`` nodes at the end. Forward only:
    it traces under ``no_grad``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._pytree import tree_flatten, tree_map

    mode = FakeTensorMode()

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        device = inputs_on if (inputs_on and x.device.type == "cpu") else x.device
        with mode:
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype,
                                       device=device)

    call = fn
    if isinstance(fn, torch.nn.Module):
        state = {k: fake(v) for k, v in {**dict(fn.named_parameters()),
                                         **dict(fn.named_buffers())}.items()}

        def call(*a: Any) -> Any:
            return torch.func.functional_call(fn, state, a)

    def flat(*a: Any) -> list[Any]:
        return tree_flatten(call(*a))[0]

    fake_args = tree_map(fake, tuple(args))
    try:
        traced = make_fx(torch.func.functionalize(flat), tracing_mode="fake",
                         record_stack_traces=True)
    except TypeError:  # torch without record_stack_traces
        traced = make_fx(torch.func.functionalize(flat), tracing_mode="fake")
    try:
        with mode, torch.no_grad():  # forward only: autograd can't build on fake GPU tensors
            gm = traced(*fake_args)
    except Exception as e:  # data-dependent ops, backward(), device code fake tensors can't take
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unsupported(
            f"can't trace {getattr(fn, '__name__', type(fn).__name__)} without running it: "
            f"{type(e).__name__}: {first} (explain traces the forward pass with fake inputs; "
            "data-dependent values such as tensor slice bounds or .item(), and backward(), "
            "need a real run)") from e
    graph, constants = from_fx(gm, name or getattr(fn, "__name__", type(fn).__name__))
    if constants:
        log.info("autopar: %d tensor constants in %s are graph inputs", len(constants), graph.name)
    return graph


def capture_by_running(fn: Callable, args: Sequence[Any]) -> list[Graph]:
    """Capture every graph ``fn(*args)`` makes by running it once, eagerly, through the backend.

    For code :func:`trace_fake` can't follow: values read back from tensors (``.item()``, tensor
    slice bounds) split it into several graphs, and ``backward()`` and an optimizer step are
    captured as graphs of their own. The arguments are used as given: it really computes.
    """
    from .runtime import SequentialRunner

    graphs: list[Graph] = []

    def record(graph: Graph, phase: str) -> Callable:
        graphs.append(graph)
        return SequentialRunner(graph)

    name = getattr(fn, "__name__", type(fn).__name__)
    torch.compile(fn, backend=make_backend(record, name=name), dynamic=False)(*args)
    return graphs


def relabel_devices(graph: Graph, src: str, dst: str) -> Graph:
    """Take every value eager put on ``src`` (e.g. "cpu") to live on ``dst`` ("cuda:0"), in place.

    Used to explain CPU-captured code as if it had been written for ``dst``.
    """
    from dataclasses import replace

    target = torch.device(dst)

    def moved(meta: Any) -> Any:
        if isinstance(meta, TensorMeta) and meta.device == src:
            return replace(meta, device=dst)
        if isinstance(meta, tuple):
            return tuple(moved(m) for m in meta)
        return meta

    for node in graph.nodes:
        node.meta = moved(node.meta)
        if isinstance(node.kwargs.get("device"), torch.device) and str(
                node.kwargs["device"]) == src:
            node.kwargs = {**node.kwargs, "device": target}
    return graph

"""Capture: turn a user's function into autopar Graphs through ``torch.compile``.

Policy
- The ``"autopar"`` dynamo backend runs ``aot_autograd``, so every graph we see is functional
  ATen (no in-place ops but the final input-mutation epilogue that aot_autograd applies itself),
  and training gets a forward and a backward graph, each captured and run by autopar. An
  inference graph for which aot_autograd's runtime wrapper has nothing to do (no input mutated,
  no output aliasing an input, no autocast, no effect tokens: aot_autograd's own metadata says
  so) is called by dynamo without that wrapper, with grad mode off as the wrapper has it.
- :func:`from_fx` converts one aot_autograd ``GraphModule`` into a :class:`~autopar.ir.graph.Graph`:
  placeholders (then tensor constants from ``get_attr``) become graph inputs, ``call_function``
  nodes become op nodes with metadata read from the fake values dynamo recorded.
- Scalar reads stay in the graph (with ``torch._dynamo.config.capture_scalar_outputs``, which
  :func:`autopar.compile` turns on): ``aten._local_scalar_dense`` (``.item()``, a tensor used as
  a slice bound) becomes a node whose value is a Python number (:class:`ScalarMeta`), read once
  per input tensor however often dynamo asked for it; arithmetic on such numbers
  (``operator.add``, ``torch.sym_max``...) and runtime asserts on them are nodes too, and the
  tensor ops that take them as arguments refer to them. ``aten.sym_size`` and friends whose
  value is a known int become that int.
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

import contextlib
import functools
import logging
import math
import operator
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ..ir.graph import LOCAL_SCALAR_DENSE, Graph, Node, ScalarMeta, TensorMeta
from .shapes import PerShape, is_symbolic

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
        if any(_known_number(s) is None for s in (*value.shape, *value.stride())):
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


_aten = torch.ops.aten
_TO_COPY = _aten._to_copy.default
_SCALAR_OPS = frozenset({LOCAL_SCALAR_DENSE, _aten._assert_scalar.default,
                         _aten.sym_constrain_range.default,
                         _aten.sym_constrain_range_for_size.default})
"""ATen ops whose value is a Python number (or None): they run on the host."""
_SIZE_OPS = frozenset({_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
                       _aten.sym_storage_offset.default})
"""Shape queries: their value is known when the shape is, and then becomes a constant."""
_SCALAR_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.not_, math.floor, math.ceil, math.trunc, torch.sym_max,
    torch.sym_min, torch.sym_float, torch.sym_int, torch.sym_not, torch.sym_ite})
"""Python arithmetic dynamo records on numbers read from tensors."""


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A real copy of a constant on the host (the backend runs inside fake tensor tracing)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return t.detach().cpu()


def _known_number(value: Any) -> int | float | bool | None:
    """The plain number a traced scalar stands for, if it is not symbolic (else None)."""
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        node = value.node
        if node.is_constant():
            return node.pytype(node.constant)  # type: ignore[no-any-return]
        expr = getattr(node, "expr", None)  # a sympy expression; a number once shapes agree
        if getattr(expr, "is_number", False):
            return node.pytype(expr)  # type: ignore[no-any-return]
    return None


def from_fx(gm: torch.fx.GraphModule, name: str = "graph") -> tuple[Graph, list[torch.Tensor]]:
    """Convert an aot_autograd GraphModule into a Graph.

    Returns the graph and the constant tensors (``get_attr``) to append to the call's arguments:
    the graph's inputs are the placeholders followed by those constants. Constants made inside
    the function are folded first (:func:`autopar.capture.fold.fold_constants`; ``gm`` is not
    changed).
    """
    from .fold import fold_constants

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
        if isinstance(x, torch.fx.Node):
            return env[x]
        if isinstance(x, torch.fx.immutable_collections.immutable_list | list):
            return [convert(v, what) for v in x]
        if isinstance(x, tuple):
            return tuple(convert(v, what) for v in x)
        if isinstance(x, dict):
            return {k: convert(v, what) for k, v in x.items()}
        return _check_constant(x, what)

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
        if target in _SIZE_OPS:
            known = _known_number(val)
            if known is None:
                raise Unsupported(f"{what} is a symbolic size {val}")
            env[fx_node] = known
            continue
        if target is _aten._assert_scalar.default and fx_node.args[0] is True:
            continue  # proved while tracing: nothing to check
        if target in _SCALAR_OPS or target in _SCALAR_FUNCTIONS:
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
        meta = _meta_of(val, what)
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
    """A dynamo backend that captures each aot_autograd graph and runs it through ``build``.

    An inference graph whose aot_autograd runtime wrapper would do nothing but turn grad mode
    off (:func:`_bare_inference`) is handed to dynamo without that wrapper: dynamo calls the
    graph's runner directly (:func:`_without_aot_wrapper`). The wrapper's layers cost ~11 us a
    call on a 2-core VM (``x @ y``, 5x10x5: dynamo 21 us, dynamo and aot_autograd 36 us).
    """
    from torch._dynamo.backends.common import aot_autograd

    counter = {"n": 0}
    bare: list[tuple[Callable, int]] = []  # this graph's inference runner, with no wrapper due

    def compiler(phase: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            counter["n"] += 1
            label = f"{name}_{phase}_{counter['n']}"
            try:
                graph, constants = from_fx(gm, label)
            except Unsupported as e:
                if is_symbolic(example_inputs):  # one static graph per signature, when called
                    run = PerShape(gm, label, lambda static, lbl: runner(*from_fx(static, lbl)))
                else:
                    log.warning("autopar: running %s eagerly: %s", label, e)
                    run = _eager(gm)
            else:
                run = runner(graph, constants)
            if phase == "inference" and _bare_inference():
                bare.append((run, len(example_inputs)))
            return run

        def runner(graph: Graph, constants: list[torch.Tensor]) -> Callable[[list], Any]:
            run = build(graph, phase)
            if not constants:
                return _boxed(run)

            def call(args: list) -> Any:
                return run([*args, *constants])
            return _boxed(call)
        return compile_graph

    aot = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
    )

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        bare.clear()  # what an earlier, failed compile may have left
        compiled = aot(gm, example_inputs)
        # the same inputs as dynamo's (aot lifted no parameters, merged no duplicates) and no
        # autocast to switch off around the call (dynamo guards both)
        if len(bare) == 1 and bare[0][1] == len(example_inputs) and \
                not _any_autocast_enabled() and \
                all(type(x) in _PLAIN_INPUTS for x in example_inputs):
            return _without_aot_wrapper(bare.pop()[0])
        return compiled
    return backend


_PLAIN_INPUTS = (torch.Tensor, torch.nn.Parameter, int, float, bool, torch.SymInt, torch.SymFloat,
                 torch.SymBool)


def _any_autocast_enabled() -> bool:
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    return True if check is None else bool(check())


def _bare_inference() -> bool:
    """Whether aot_autograd's runtime wrapper around the inference graph being compiled has
    nothing to do but switch grad mode off: no input mutated (data, metadata or storage), every
    output a fresh tensor (no alias of an input, an intermediate or another output) that needs
    no grad, no effect tokens, no functionalized RNG. Read from the metadata aot_autograd
    hands its compilers (``TracingContext.fw_metadata``); False where any of it is missing."""
    from torch._functorch._aot_autograd.schemas import OutputType
    from torch._guards import TracingContext

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return False
    try:
        return (not any(i.mutates_data or i.mutates_metadata
                        or getattr(i, "mutates_storage_metadata", False)
                        for i in meta.input_info)
                and all(o.output_type == OutputType.non_alias and not o.requires_grad
                        for o in meta.output_info)
                and meta.num_intermediate_bases == 0 and not meta.tokens
                and not getattr(meta, "num_graphsafe_rng_states", 0)
                and not meta.is_rng_op_functionalized)
    except AttributeError:  # another torch's metadata: keep its wrapper
        return False


def _without_aot_wrapper(run: Callable) -> Callable:
    """``run`` (boxed or not) called as dynamo calls a backend's result, with grad mode off
    as aot_autograd runs an inference graph."""
    boxed = getattr(run, "_boxed_call", False)

    def call(*args: Any) -> Any:
        grad = _is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            return run(list(args)) if boxed else run(*args)
        finally:
            if grad:
                _set_grad_enabled(True)
    call.autopar_bare = True  # type: ignore[attr-defined]
    return call


_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def capturing_scalars(compiled: Callable, needed: Callable[[], bool] | None = None) -> Callable:
    """``compiled`` (a ``torch.compile`` result) traced with ``.item()`` and tensor slice
    bounds kept in the graph (dynamo's ``capture_scalar_outputs``) instead of breaking it.

    The setting is dynamo's, read when a frame is traced; it is switched on around each call
    only, so the caller's other compiled code is not affected. Switching costs a few
    microseconds a call, so it stops once ``needed()`` says False (``autopar.compile``: the
    first call's graphs read no scalar, so the function's code has none to capture); with
    ``torch._dynamo.config.capture_scalar_outputs = True`` (or
    ``TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS=1``) already set, calls go straight through. Where
    dynamo itself fails to trace with the setting on (an internal error, before anything ran),
    the call is traced again without it, once, logged, and the setting is not used again.
    """
    config = torch._dynamo.config
    state = {"off": False}

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if state["off"] or (needed is not None and not needed()) or \
                    config.capture_scalar_outputs:  # a dynamo config read costs ~1 us: last
                return fn(*args, **kwargs)
            # set and reset the attribute itself: ``config.patch`` costs ~25 us a call
            config.capture_scalar_outputs = True
            try:
                return fn(*args, **kwargs)
            except torch._dynamo.exc.InternalTorchDynamoError as e:
                state["off"] = True
                log.warning("autopar: tracing %s with .item() captured failed inside dynamo "
                            "(%s); tracing it with graph breaks at .item() instead",
                            getattr(fn, "__name__", "the function"), str(e).splitlines()[0])
            finally:
                config.capture_scalar_outputs = False
            return fn(*args, **kwargs)
        return call

    if isinstance(compiled, torch.nn.Module):  # an OptimizedModule: its forward is dynamo's
        compiled.forward = wrap(compiled.forward)
        return compiled
    return wrap(compiled)


_BACKENDS: dict[tuple, Callable] = {}  # options -> its backend: one runner per set of options


def autopar_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                    options: dict[str, Any] | None = None, **kwargs: Any):
    """The ``torch.compile(fn, backend="autopar")`` entry point.

    Options come as ``torch.compile(fn, backend="autopar", options={...})`` (the convention
    every backend shares) or as keyword arguments; both are validated as
    :func:`autopar.compile`'s. One runner (one machine and cost model) serves every graph
    compiled with the same options in this process.
    """
    from ..api import Options, make_runner

    merged = {**(options or {}), **kwargs}
    key = tuple(sorted((k, repr(v)) for k, v in merged.items()))
    if key not in _BACKENDS:
        _BACKENDS[key] = make_backend(make_runner(Options.parse(merged)))
    return _BACKENDS[key](gm, example_inputs)


# -- capture without running: for explain on machines that aren't at hand ----------------------

class _IndexedCuda(torch.overrides.TorchFunctionMode):
    """Names ``"cuda"`` without an index as ``"cuda:0"`` (eager's current device by default)
    in every call's arguments, and ``Tensor.cuda()`` as ``.to("cuda:0")``: a build of torch
    without CUDA can't look up a current device, though fake tensors may live on ``cuda:0``."""

    @staticmethod
    def _indexed(value: Any) -> Any:
        if isinstance(value, str) and value == "cuda":
            return "cuda:0"
        if isinstance(value, torch.device) and value.type == "cuda" and value.index is None:
            return torch.device("cuda", 0)
        return value

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.device and (len(args) > 1 or "index" in kwargs):
            return func(*args, **kwargs)  # torch.device("cuda", 1): the index is given
        kwargs = {k: self._indexed(v) for k, v in kwargs.items()}
        args = tuple(self._indexed(a) for a in args)
        if func is torch.Tensor.cuda:  # its device, if any, is already indexed above
            device = args[1] if len(args) > 1 else kwargs.get("device")
            index = device if isinstance(device, int) else torch.device(device or "cuda:0").index
            return args[0].to(torch.device("cuda", index),
                              non_blocking=kwargs.get("non_blocking", False))
        return func(*args, **kwargs)


def trace_fake(fn: Callable, args: Sequence[Any], inputs_on: str | None = None,
               name: str | None = None) -> Graph:
    """Capture ``fn(*args)`` as a functional Graph without computing anything.

    Tensors among ``args`` (and an ``nn.Module``'s parameters and buffers) are replaced by fake
    tensors of the same shape, dtype and strides; those built on the CPU are taken to live on
    ``inputs_on`` (e.g. ``"cuda:0"``), so code written for a GPU can be explained on a CPU-only
    machine (where ``"cuda"`` without an index means ``cuda:0``). In-place updates of inputs
    appear as ``aten.copy_`` nodes at the end. Forward only: it traces under ``no_grad``.
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
        indexed = contextlib.nullcontext() if torch.cuda.is_available() else _IndexedCuda()
        with mode, torch.no_grad(), indexed:  # forward only: no autograd on fake GPU tensors
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
    from ..runtime import SequentialRunner

    graphs: list[Graph] = []

    def record(graph: Graph, phase: str) -> Callable:
        graphs.append(graph)
        return SequentialRunner(graph)

    name = getattr(fn, "__name__", type(fn).__name__)
    compiled = torch.compile(fn, backend=make_backend(record, name=name), dynamic=False)
    capturing_scalars(compiled)(*args)
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

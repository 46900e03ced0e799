"""The dynamo backend: every graph ``torch.compile`` captures, converted and handed to a runner.

Policy
- The backend runs ``aot_autograd``, so every graph we see is functional ATen (no in-place ops
  but the final input-mutation epilogue that aot_autograd applies itself), and training gets a
  forward and a backward graph, each captured (:func:`autopar.capture.fx.from_fx`) and run by
  the runner the backend was made with. An inference graph for which aot_autograd's runtime
  wrapper has little to do (inputs whose data it updates, inputs returned as outputs, no
  other alias, no autocast, no effect tokens: aot_autograd's own metadata says so) is called
  by dynamo through a wrapper doing only that, with grad mode off as aot's has it.
- What runs a graph is not decided here: :func:`make_backend` takes the runner builder
  (``autopar.api.make_runner``'s, for ``torch.compile(backend="autopar")``: :mod:`autopar.backend`).
- One trace, two compiled forms (``make_backend(..., switch=WaySwitch())``): each graph dynamo
  captures is also compiled by Inductor (``compile_fx``, what ``torch.compile``'s default
  does with the same graph), and the callable dynamo gets runs the form the switch names.
  The measured choice's ``inductor`` way is then the same dynamo code with the switch on, not
  a second ``torch.compile`` tracing the function again (on one H200, Llama's first calls:
  dynamo's tracing was 4.6 of 5.5 s, twice over). Inductor's form is compiled at its first
  call (:class:`_Deferred`; a graph of symbolic sizes at once), after autopar's (Inductor's
  passes may rewrite the graph module in place). Where Inductor fails on a graph, that graph
  runs autopar's form under either setting, and the switch says why (``WaySwitch.failed``):
  the inductor way is then not Inductor's and is left out. A third
  form, Inductor's function replayed as a CUDA graph, is built at its first use where a graph
  qualifies (:func:`_cuda_graph_form`) by what the switch is given (the runtime's capture).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx
from torch._guards import CompileContext, TracingContext
from torch._subclasses.fake_tensor import FakeTensor

from ..ir.graph import Graph
from ..ir.locks import enter
from ..ir.locks import tracing as tracing_lock
from ..ir.logs import cover_torch_loggers, first_line, quiet_code
from .fx import Unsupported, from_fx, source_of
from .shapes import PerShape, is_symbolic

__all__ = ["GraphRunner", "LightWrapper", "WaySwitch", "capturing_scalars", "data_dependent",
           "make_backend", "with_own_code"]

log = logging.getLogger("autopar.capture")


GraphRunner = Callable[[Graph, str], Callable[[Sequence[torch.Tensor]], Sequence[Any]]]
"""Builds the callable that runs one captured graph: (graph, phase) -> run(args) -> outputs."""


def _boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def _user_line(gm: torch.fx.GraphModule, error: BaseException) -> str | None:
    """``file.py:line`` of the user's code where ``error`` (raised converting ``gm``) arose: the
    fx node :func:`from_fx` was at, else the first node with a stack trace."""
    tb, node = error.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code is from_fx.__code__:
            node = tb.tb_frame.f_locals.get("fx_node")
        tb = tb.tb_next
    if isinstance(node, torch.fx.Node) and source_of(node):
        return source_of(node)
    return next((source_of(n) for n in gm.graph.nodes if source_of(n)), None)


def with_own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, for a second ``torch.compile`` of it: dynamo keeps
    its compiled entries on the code object, so two ``torch.compile`` of one function with
    other backends or modes (autopar's shared trace and a ``mode="reduce-overhead"`` way) look
    up one list of entries, check each other's guards on every call and share one recompile
    limit. A plain function is copied (globals, closure and attributes are the very objects);
    a bound method is its function so copied, bound to the same object. Another callable (a
    ``functools.partial``, a callable object) is called from a function of its own, which
    dynamo traces, inlining the callable: dynamo calls such callables from one function of
    its own, whose limit every one of them shared (the ninth compiled ran eagerly). A
    function with default values is returned as it is, and so is a module: a copy's defaults
    would be those of the moment (a later ``f.__defaults__ = ...`` unseen), and torch 2.11's
    dynamo does not guard the defaults of a function it inlines. The frames dynamo traces in
    what is called are shared in every case."""
    if isinstance(fn, types.MethodType):
        func = with_own_code(fn.__func__)
        return fn if func is fn.__func__ else types.MethodType(func, fn.__self__)
    if isinstance(fn, torch.nn.Module | type) or (
            isinstance(fn, types.FunctionType) and (fn.__defaults__ or fn.__kwdefaults__)):
        return fn
    code = fn
    if not isinstance(fn, types.FunctionType):
        def call(*args: Any, **kwargs: Any) -> Any:  # a frame for dynamo, ``fn`` inlined
            return fn(*args, **kwargs)
        code = call
    copy = types.FunctionType(code.__code__.replace(), code.__globals__, code.__name__, None,
                              code.__closure__)
    return functools.update_wrapper(copy, fn)


def _eager(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
    def run(args: list) -> Any:
        return gm(*args)
    return _boxed(run)


class WaySwitch:
    """Which compiled form the graphs of one shared trace run: ``form``, one of "autopar",
    "inductor" (``torch.compile``'s default) and "cudagraphs" (Inductor's replayed as CUDA
    graphs, what ``mode="reduce-overhead"`` does).
    ``failed``: the first graph Inductor could not compile, and why (None while every graph
    has Inductor's form); ``failures``: how many could not, ``last_failure`` why the latest
    (a call that made one more was not of Inductor's form). ``graphed``: graphs given a
    CUDA-graph form so far. ``replay``: what makes that form of Inductor's function
    (``replay(fn, device, label)``, the runtime's ``GraphedCall``; None: no CUDA-graph form).
    ``pending``: Inductor's forms not compiled yet (weakly: a graph dynamo drops is not kept)."""

    def __init__(self, replay: Callable[[Callable, str, str], Callable] | None = None) -> None:
        self.form = "autopar"
        self.failed: str | None = None
        self.failures = 0
        self.last_failure: str | None = None
        self.graphed = 0
        self.replay = replay
        self.pending: weakref.WeakSet[_Deferred] = weakref.WeakSet()

    def compile_pending(self) -> None:
        """Compile every Inductor form not compiled yet (where the inductor way is kept with
        no trial, so that a failure is known before, not after, it is kept)."""
        for deferred in list(self.pending):
            deferred.compiled()

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.last_failure = why
        if self.failed is None:
            self.failed = why


def _switched(ours: Callable, theirs: Callable, switch: WaySwitch,
              graphed: Callable[[], Callable] | None) -> Callable:
    """The callable dynamo gets: the form ``switch`` names. ``graphed`` builds the CUDA-graph
    form at its first use (None: Inductor's form serves that setting too)."""
    built: list[Callable] = []

    def call(*args: Any) -> Any:
        form = switch.form
        if form == "autopar":
            return ours(*args)
        if form == "inductor" or graphed is None:
            return theirs(*args)
        if not built:
            built.append(graphed())
        return built[0](*args)
    return call


def _one_gpu(example_inputs: Sequence[Any]) -> str | None:
    """The GPU every tensor input is on, or None (inputs elsewhere, or on several)."""
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    return str(next(iter(devices)))


def _cuda_graph_form(example_inputs: Sequence[Any], theirs: _Deferred, label: str,
                     switch: WaySwitch, seen: dict[str, Any]) -> Callable[[], Callable] | None:
    """The builder of a graph's CUDA-graph form (``switch.replay`` of Inductor's function), or
    None where it has none: only aot_autograd's inference graphs (grad off while tracing, or
    nothing read requires grad: dynamo guards both) with static shapes and every tensor input
    on one GPU, that neither write into an input (a replay would write into its static copy)
    nor draw random numbers (a replay's stream is not eager's), as autopar's conversion of the
    graph found (``seen``)."""
    if switch.replay is None or seen["writes"] or seen["random"] or \
            seen["phase"] != "inference" or is_symbolic(example_inputs):
        return None
    device = _one_gpu(example_inputs)
    if device is None:
        return None

    def build() -> Callable:
        fn = theirs.compiled()
        if theirs.failed:  # no Inductor's form to replay
            return fn
        switch.graphed += 1
        return switch.replay(fn, device, label)  # type: ignore[misc]
    return build


def make_backend(build: GraphRunner, name: str = "autopar",
                 learn: Callable[[Callable, tuple, Any], None] | None = None,
                 switch: WaySwitch | None = None) -> Callable:
    """A dynamo backend that captures each aot_autograd graph and runs it through ``build``.

    An inference graph whose aot_autograd runtime wrapper would do no more than turn grad mode
    off, copy updated inputs back and return inputs as outputs (:func:`_light_inference`) is
    handed to dynamo with a wrapper doing just that (:func:`_without_aot_wrapper`). aot's
    wrapper's layers cost ~11 us a call on a 2-core VM (``x @ y``, 5x10x5: dynamo 21 us,
    dynamo and aot_autograd 36 us).
    ``learn(program, args, outputs)``: told of each call dynamo makes of such a graph
    (``program(*args)`` gave ``outputs``), for ``guards="arguments"``
    (:class:`autopar.capture.direct.Direct`). ``switch``: each graph compiled by Inductor too,
    the switch choosing which form runs (see the module docstring).
    """
    from torch._dynamo.backends.common import aot_autograd  # lazy: slow to import

    counter = {"n": 0}
    bare: list[tuple[Callable, int, tuple]] = []  # this graph's inference runner and light wrapper
    # whether the graph last converted writes its inputs, draws random numbers
    seen: dict[str, Any] = {"writes": True, "random": True, "phase": None}

    def compiler(phase: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            cover_torch_loggers()  # those imported since (Inductor's): kept quiet too
            counter["n"] += 1
            label = f"{name}_{phase}_{counter['n']}"
            light = _light_inference() if phase == "inference" else None
            if light is not None and light[0]:
                _copy_back_sources(gm, len(light[0]), light[1])
            seen.update(writes=_writes_inputs(), random=True, phase=phase)  # random: until seen
            try:
                graph, constants = from_fx(gm, label)
                graph.writes_inputs = seen["writes"]
                seen["random"] = graph.draws_random
            except Unsupported as e:
                if is_symbolic(example_inputs):  # one static graph per signature, when called
                    run = PerShape(gm, label, lambda static, lbl: runner(*from_fx(static, lbl)))
                else:
                    where = _user_line(gm, e)
                    log.warning("autopar: running %s eagerly%s: %s", label,
                                f" (at {where})" if where else "", e)
                    run = _eager(gm)
            else:
                run = runner(graph, constants)
            if light is not None:
                bare.append((run, len(example_inputs), light))
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

    def ours(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        bare.clear()  # what an earlier, failed compile may have left
        compiled = aot(gm, example_inputs)
        # the same inputs as dynamo's (aot lifted no parameters, merged no duplicates) and no
        # autocast to switch off around the call (dynamo guards both)
        if len(bare) == 1 and bare[0][1] == len(example_inputs) and \
                not any_autocast_enabled() and \
                all(type(x) in _PLAIN_INPUTS for x in example_inputs):
            run, _, (mutated, bases) = bare.pop()
            direct = _without_aot_wrapper(run, mutated, bases)
            return direct if learn is None else _told(direct, learn)
        return compiled

    if switch is None:
        return ours

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        seen.update(writes=True, random=True, phase=None)  # for a graph no compiler of ours sees
        mine = ours(gm, example_inputs)
        theirs = _Deferred(gm, example_inputs, mine, name, switch)
        if not theirs.deferred:
            theirs.compiled()
            if theirs.failed:
                return mine
        graphed = _cuda_graph_form(example_inputs, theirs, f"{name} (Inductor's form)",
                                   switch, seen)
        return _switched(mine, theirs, switch, graphed)
    return backend


class _Deferred:
    """Inductor's form of one graph (``compile_fx``, what ``torch.compile``'s default does with
    it), compiled at its first call: a form never run is never lowered (a training step whose
    trial goes from eager's calls straight to CUDA graphs, ``autopar.choose``, where that
    lowering was a large share of a training step's first calls: see benchmarks/NOTES.md).
    As aot_autograd compiles a backward at its first use, the
    compile runs in the tracing and compile contexts dynamo compiled the graph in, under the
    grad mode and autocast state dynamo traced it with, holding dynamo's compile lock. It holds
    the example inputs as the fake tensors dynamo traced (its fake mode's memo), never the
    user's tensors: dynamo hands real ones (parameters, the batch, an optimizer graph's
    gradients and state), and a form never run kept a deleted model's weights and a step's
    first gradients alive for good. A graph of symbolic sizes is compiled at once
    (``deferred`` False: the caller calls :meth:`compiled`), while dynamo takes guards:
    Inductor may add guards on sizes; so is one without a fake mode to hold its inputs as.
    Where Inductor fails, the graph runs ``mine`` (autopar's form) in every form and the
    switch says why (the inductor way is then left out)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 mine: Callable, name: str, switch: WaySwitch) -> None:
        ctx = TracingContext.try_get()
        fakes = None if is_symbolic(example_inputs) else \
            _as_traced(example_inputs, getattr(ctx, "fake_mode", None))
        #: compiled at its first call (else at once, by the caller)
        self.deferred = fakes is not None
        self._gm: torch.fx.GraphModule | None = gm
        self._inputs: Sequence[Any] | None = fakes if fakes is not None else example_inputs
        self._mine, self._name, self._switch = mine, name, switch
        self._contexts = (ctx, CompileContext.try_get())
        self._state = _global_state()
        self._fn: Callable | None = None
        self.failed = False  #: Inductor failed on the graph (its form is ``mine``)
        if self.deferred:
            switch.pending.add(self)

    def compiled(self) -> Callable:
        """Inductor's function, compiled now if not yet (``mine`` where Inductor failed)."""
        if self._fn is None:
            with tracing_lock():
                if self._fn is None:
                    self._fn = self._compile()
        return self._fn

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        return (fn if fn is not None else self.compiled())(*args)

    def _compile(self) -> Callable:
        from torch._inductor.compile_fx import compile_fx  # lazy: slow to import

        gm, inputs, (ctx, compile_ctx) = self._gm, self._inputs, self._contexts
        self._gm = self._inputs = None  # held no longer than needed
        self._contexts = (None, None)
        prior = _global_state()
        try:
            _set_global_state(self._state)
            with torch._guards.tracing(ctx), torch._guards.compile_context(compile_ctx):
                return compile_fx(gm, inputs)
        except Exception as e:  # that graph runs autopar's form either way
            self.failed = True
            why = f"{self._name}: {type(e).__name__}: {first_line(e)}"
            self._switch._failed(why)
            log.info("autopar: Inductor failed on a graph of %s, which runs autopar's form in "
                     "the inductor way too: %s", self._name, why)
            return self._mine
        finally:
            _set_global_state(prior)
            self._switch.pending.discard(self)


def _as_traced(inputs: Sequence[Any], fake_mode: Any) -> list[Any] | None:
    """``inputs`` with each real tensor replaced by the fake dynamo traced it as (its fake
    mode's memo; a tensor not in it is made anew, static), or None: no fake mode, or a fake
    of symbolic sizes."""
    if fake_mode is None:
        return None
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            x = fake_mode.from_tensor(x, static_shapes=True)
            if is_symbolic([x]):
                return None
        out.append(x)
    return out


def _global_state() -> list[tuple[Callable[[Any], Any], Any]]:
    """The global state dynamo traces a graph under and compiles it under (its
    ``OutputGraph.save_global_state``): grad mode and autocast's, as (setter, value) pairs."""
    gpu = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    gpu_type = gpu.type if gpu is not None else "cuda"
    return [(torch.set_grad_enabled, torch.is_grad_enabled()),
            *((functools.partial(torch.set_autocast_enabled, d), torch.is_autocast_enabled(d))
              for d in (gpu_type, "cpu")),
            *((functools.partial(torch.set_autocast_dtype, d), torch.get_autocast_dtype(d))
              for d in (gpu_type, "cpu")),
            (torch.set_autocast_cache_enabled, torch.is_autocast_cache_enabled())]


def _set_global_state(state: list[tuple[Callable[[Any], Any], Any]]) -> None:
    for setter, value in state:
        setter(value)


def _told(program: Callable, learn: Callable[[Callable, tuple, Any], None]) -> Callable:
    """``program``, telling ``learn`` of each call."""
    def call(*args: Any) -> Any:
        out = program(*args)
        learn(program, args, out)
        return out
    call.autopar_bare = True  # type: ignore[attr-defined]
    return call


_PLAIN_INPUTS = (torch.Tensor, torch.nn.Parameter, int, float, bool, torch.SymInt, torch.SymFloat,
                 torch.SymBool)


def any_autocast_enabled() -> bool:
    """Whether any autocast is on (True where this torch can't say)."""
    return True if _IS_ANY_AUTOCAST is None else bool(_IS_ANY_AUTOCAST())


_IS_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _light_inference() -> tuple[tuple[int, ...], tuple[int | None, ...]] | None:
    """What aot_autograd's runtime wrapper around the inference graph being compiled does,
    where it is no more than: grad mode off, each input whose data the graph updates copied
    from the graph's first outputs (``mutated``: their input indices, in that order), and each
    user output either the graph's own or an input returned as it is (``bases``: None, or
    that input's index). None where it does more: an input's metadata or storage changed, an
    output that is a view of an input, an intermediate or another output, or needs grad,
    effect tokens, functionalized RNG. Read from the metadata aot_autograd hands its
    compilers (``TracingContext.fw_metadata``); None where any of it is missing."""
    from torch._functorch._aot_autograd.schemas import OutputType  # lazy: slow to import

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return None
    try:
        if any(i.mutates_metadata or getattr(i, "mutates_storage_metadata", False)
               or getattr(i, "mutation_inductor_storage_resize", False)
               or (i.mutates_data and i.requires_grad) for i in meta.input_info):
            return None
        mutated = tuple(meta.mutated_inp_runtime_indices)
        if sorted(mutated) != [j for j, i in enumerate(meta.input_info) if i.mutates_data]:
            return None  # a mutation kept in the graph, or one this reading misses
        bases: list[int | None] = []
        for o in meta.output_info:
            if o.requires_grad:
                return None
            if o.output_type == OutputType.non_alias:
                bases.append(None)
            elif o.output_type == OutputType.is_input and o.base_idx is not None:
                bases.append(o.base_idx)
            else:
                return None
        if meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized or \
                getattr(meta, "num_graphsafe_rng_states", 0):
            return None
    except AttributeError:  # another torch's metadata: keep its wrapper
        return None
    return mutated, tuple(bases)


def _writes_inputs() -> bool:
    """Whether a call of the graph being compiled writes into one of its inputs (data or
    metadata: aot_autograd's epilogue applies what the functional graph computed), as
    aot_autograd's metadata says; True where it says nothing."""
    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    try:
        return any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
    except AttributeError:  # no metadata, or another torch's
        return True


def _copy_back_sources(gm: torch.fx.GraphModule, n_mutated: int,
                       bases: tuple[int | None, ...]) -> None:
    """Where the graph's new value of a mutated input is ``aten.copy(input, src)`` (``B[:] =
    src``, functionalized), return ``src`` itself in that place: the epilogue's ``copy_``
    into the input broadcasts and casts as ``aten.copy`` does, so the value the graph made
    (a fresh tensor, written once more by the epilogue) is one copy too many. Only where that
    ``copy`` is read by nothing else than the graph's output in that place and in places of
    outputs that are inputs returned as they are (their values are not used). In place, on
    aot_autograd's graph handed to this backend's compiler."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    ignored = {n_mutated + j for j, b in enumerate(bases) if b is not None}
    changed = False
    for k in range(n_mutated):
        node = values[k]
        if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.copy.default
                and isinstance(node.args[0], torch.fx.Node)
                and node.args[0].op == "placeholder" and not node.kwargs):
            continue
        places = [i for i, v in enumerate(values) if v is node]
        if len(node.users) != 1 or any(i != k and i not in ignored for i in places) or \
                _view_base(node.args[1]) is node.args[0]:
            continue  # read elsewhere, or ``B[:] = B.t()``: a copy_ from B's own memory
        values = [node.args[1] if i in places else v for i, v in enumerate(values)]
        changed = True
    if changed:
        out.args = (tuple(values),)
        gm.graph.eliminate_dead_code()
        gm.recompile()


def _view_base(node: Any) -> Any:
    """The value ``node`` is a view of, through ops whose first result aliases their input
    (``slice``, ``t``, ``expand``...); ``node`` itself if it is none."""
    while isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload) \
            and node.target._schema.returns and node.args and \
            node.target._schema.returns[0].alias_info is not None:
        node = node.args[0]
    return node


def _without_aot_wrapper(run: Callable, mutated: tuple[int, ...] = (),
                         bases: tuple[int | None, ...] = ()) -> Callable:
    """``run`` (boxed or not) called as dynamo calls a backend's result, doing what
    :func:`_light_inference` found aot_autograd's wrapper does: grad mode off, the inputs
    ``mutated`` copied from the first outputs, an input returned where ``bases`` names one.
    ``call.light``: the parts, a :class:`LightWrapper`."""
    boxed = getattr(run, "_boxed_call", False)
    n = len(mutated)
    aliased = any(b is not None for b in bases)

    def call(*args: Any) -> Any:
        grad = _is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            outs = run(list(args)) if boxed else run(*args)
            if not n and not aliased:
                return outs
            for k, i in enumerate(mutated):
                args[i].copy_(outs[k])
            user = outs[n:]
            return [o if b is None else args[b] for o, b in zip(user, bases)] if aliased \
                else user
        finally:
            if grad:
                _set_grad_enabled(True)
    call.autopar_bare = True  # type: ignore[attr-defined]
    call.light = LightWrapper(run, boxed, mutated, bases)  # type: ignore[attr-defined]
    return call


class LightWrapper(NamedTuple):
    """What :func:`_without_aot_wrapper`'s call does, for code that does it inline
    (:mod:`autopar.capture.direct`): ``run`` the graph's runner (``boxed``: takes one list),
    ``mutated`` the input indices copied from its first outputs, ``bases`` per user output the
    input returned in its place (or None)."""

    run: Callable
    boxed: bool
    mutated: tuple[int, ...]
    bases: tuple[int | None, ...]


_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


_scalars = {"calls": 0, "ours": False}  # calls inside scalars_captured; did we set it?
_scalars_lock = threading.Lock()


@contextlib.contextmanager
def scalars_captured() -> Iterator[None]:
    """Dynamo's ``capture_scalar_outputs`` on for the block. The setting is one for the
    process: calls in several threads share it, counted, and the last one out puts it back
    (a thread's call had switched it off under another's compile, whose graph then broke at
    an ``.item()``). Set by the user before, it is left alone. The attribute itself is set:
    ``config.patch`` costs ~25 us a call."""
    config = torch._dynamo.config
    with _scalars_lock:
        if _scalars["calls"] == 0:
            _scalars["ours"] = not config.capture_scalar_outputs
            config.capture_scalar_outputs = True
        _scalars["calls"] += 1
    try:
        yield
    finally:
        with _scalars_lock:
            _scalars["calls"] -= 1
            if _scalars["calls"] == 0 and _scalars["ours"]:
                config.capture_scalar_outputs = False


def capturing_scalars(compiled: Callable, needed: Callable[[], bool] | None = None,
                      failed: Callable[[], None] | None = None) -> Callable:
    """``compiled`` (a ``torch.compile`` result) traced with ``.item()`` and tensor slice
    bounds kept in the graph (dynamo's ``capture_scalar_outputs``) instead of breaking it.

    The setting is dynamo's, read when a frame is traced; it is switched on around each call
    only, so the caller's other compiled code is not affected. Switching costs a few
    microseconds a call, so it stops once ``needed()`` says False (``autopar.compile``: the
    first call's graphs read no scalar, so the function's code has none to capture); with
    ``torch._dynamo.config.capture_scalar_outputs = True`` (or
    ``TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS=1``) set by the user, it is left on. Where
    dynamo itself fails to trace with the setting on (an internal error, before anything ran),
    or a backend fails on a value read in the graph (aot_autograd on torch 2.11, W1's slice
    bounds passed in as tensors: ``GuardOnDataDependentSymNode``, which reached the user),
    the call is traced again without it, once, logged, and the setting is not used again
    (``failed()`` is then called: ``guards="arguments"`` traces such a function by running
    it, :class:`autopar.capture.direct.Direct`). Threads share the setting
    (:func:`scalars_captured`).
    """
    state = {"off": False}

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                if state["off"] or (needed is not None and not needed()):
                    return enter(fn, args, kwargs)
                try:
                    with scalars_captured():
                        return enter(fn, args, kwargs)
                except (torch._dynamo.exc.InternalTorchDynamoError,
                        torch._dynamo.exc.BackendCompilerFailed) as e:
                    if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) and \
                            not data_dependent(e):
                        raise
                    state["off"] = True
                    if failed is not None:
                        failed()
                    log.warning("autopar: tracing %s with .item() captured failed inside "
                                "dynamo (%s); tracing it with graph breaks at .item() instead",
                                getattr(fn, "__name__", "the function"), str(e).splitlines()[0])
                return enter(fn, args, kwargs)
            except torch._dynamo.exc.TorchRuntimeError as e:  # the user's code failed tracing
                return _as_eager(e, fn, args, kwargs)
        quiet_code(call)  # dynamo's warnings about the user's code stay off the console
        return call

    if isinstance(compiled, torch.nn.Module):  # an OptimizedModule: its forward is dynamo's
        compiled.forward = wrap(compiled.forward)
        return compiled
    return wrap(compiled)


_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound",
                   "data-dependent")


def data_dependent(error: BaseException) -> bool:
    """Whether a backend's failure came from a value read in the graph (an unbacked symbol)."""
    for _ in range(8):  # the chain of causes, a few deep
        if error is None:
            return False
        if any(m in f"{type(error).__name__}: {error}" for m in _DATA_DEPENDENT):
            return True
        error = error.__cause__ or error.__context__
    return False


_STDLIB = os.path.dirname(os.__file__)
_OURS = (os.path.dirname(torch.__file__), os.path.dirname(sys.modules["autopar"].__file__),
         _STDLIB)


def _user_frames(text: str) -> str:
    """The frames of the user's code in a dynamo error's text (its "from user code:" part)."""
    _, found, rest = text.partition("from user code:\n")
    return rest.split("\n\n", 1)[0].rstrip() if found else ""


def _as_eager(error: Exception, compiled: Callable, args: tuple, kwargs: dict) -> Any:
    """Raise what eager raises where dynamo failed on the user's code with fake tensors (a
    shape mistake: eager says ``mat1 and mat2 shapes cannot be multiplied``, fake tensors say
    something else, wrapped in dynamo's ``TorchRuntimeError``). When none of the user's code
    ran yet in this call (the failure was tracing its first frame), the function runs eagerly:
    its error is eager's own; should it succeed, its result is eager's, and a line says
    autopar ran it eagerly. After a graph break (part of the call ran), running it again
    would repeat that part: the error dynamo caught is raised as it is, without dynamo's
    wrapper."""
    cause, seen = error.__cause__ or error.__context__, 0
    while isinstance(cause, torch._dynamo.exc.TorchDynamoException) and seen < 8:
        cause, seen = cause.__cause__ or cause.__context__, seen + 1  # the user's own error
    if isinstance(cause, torch._dynamo.exc.TorchDynamoException):
        cause = None
    tb, ran = error.__traceback__, False
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith(_OURS) and not filename.startswith("<"):
            ran = True  # a frame of the user's code ran before dynamo failed
            break
        tb = tb.tb_next
    original = getattr(compiled, "_torchdynamo_orig_callable", None)  # a module's __call__ too
    if ran or original is None:
        if isinstance(cause, Exception):
            where = _user_frames(str(error))
            if where:  # dynamo's own record of the user's line (the traceback is its)
                cause.add_note(f"(raised in user code, traced by dynamo:\n{where})")
            raise cause.with_traceback(None) from None
        raise error
    try:
        out = original(*args, **kwargs)
    except Exception as eager:
        raise eager from None
    log.warning("autopar: %s could not be traced (%s); this call ran eagerly",
                getattr(original, "__name__", "the function"),
                str(cause or error).strip().splitlines()[0])
    return out

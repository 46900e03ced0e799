"""Whole-step capture for data parallelism: a training step (forward, backward, update) traced
into one functional graph (see :mod:`autopar.dataparallel` for why not ``torch.compile``)."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import register_pytree_node, tree_flatten, tree_map, tree_unflatten

from ..ir.graph import Graph, Node
from ..ir.locks import tracing
from ..ir.logs import first_line
from . import pystate
from .direct import free_values
from .fused import FunctionalFusedUpdates
from .fx import Unsupported, from_fx, kept_unused
from .state import State

__all__ = ["ChangesPython", "StepGraph", "capture_step"]

log = logging.getLogger(__name__)

_COPY_ = torch.ops.aten.copy_.default


class ChangesPython(Unsupported):
    """The step changes Python state as it runs (:mod:`autopar.capture.pystate`): no trace of
    it can be replayed, whatever its signature."""


@dataclass
class StepGraph:
    """One traced step: a functional graph over the step's tensor arguments.

    The graph's inputs are the step's tensor arguments (``n_args`` of them) followed by the
    :class:`~autopar.capture.state.State`'s tensors. ``graph.outputs`` are, in order: the
    step's own outputs (``n_outputs`` of them, flattened: tensors, and Python numbers such as
    ``loss.item()`` that the graph reads on the host), the ``.grad`` of each index in
    ``grads``, and the new value of each index in ``mutated``; each index in ``cleared`` held a
    ``.grad`` the step set to None. ``constants`` (tensors made during the trace) are the
    graph's last inputs.
    """

    graph: Graph
    n_outputs: int
    out_spec: Any
    grads: list[int]
    mutated: list[int]
    params: list[int]
    n_args: int = 0
    cleared: list[int] = field(default_factory=list)
    constants: list[torch.Tensor] = field(default_factory=list)  # inputs after the tensors

    @property
    def arg_params(self) -> list[int]:
        """The parameters among the step's arguments (their ``.grad`` must be None on entry)."""
        return [j for j in self.params if j < self.n_args]

    @property
    def updates(self) -> dict[Node, Node]:
        """Each mutated input and the node of its new value."""
        first = self.n_outputs + len(self.grads)
        inputs = self.graph.inputs
        return {inputs[j]: self.graph.outputs[first + k] for k, j in enumerate(self.mutated)}


def capture_step(fn: Callable, args: Sequence[Any], name: str | None = None,
                 state: State | None = None) -> StepGraph:
    """Trace ``fn(*args)`` (forward, backward, update) into one functional :class:`StepGraph`;
    ``state`` (see :mod:`autopar.capture.state`) is what it reads besides its arguments.

    Nothing is computed and nothing of ``args`` or ``state`` changes: the trace runs on fake
    tensors. Raises :class:`Unsupported` (:class:`StateNotReady`: try the next call).

    One trace, functional as it runs: the fake tensors wrapped as functional ones
    (``FunctionalTensorMode``), what the step wrote into its inputs appended as ``copy_``.
    Where that trace fails (code that asks whether a tensor is a ``FakeTensor`` before a
    data-dependent test, as Hugging Face's mask code does on some versions, sees a
    ``FunctionalTensor``), two: a plain trace, then ``torch.func.functionalize`` over it.
    Either traces under the Python dispatcher, as aot_autograd does, so that torch's
    decompositions above autograd apply: without them a CUDA batch norm is recorded as
    ``cudnn_batch_norm``, whose kernel updates the running statistics its schema says it
    only reads (no write-back in the graph; a CUDA graph's warm-up and replay updated them
    twice).
    """
    state = state if state is not None else State()
    leaves, spec = tree_flatten(tuple(args))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    n_args = len(tensor_at)
    tensors = [leaves[i] for i in tensor_at] + list(state.tensors)
    params = [j for j, t in enumerate(tensors) if t.requires_grad and t.is_leaf]
    held = [j for j in params if j < n_args and tensors[j].grad is not None]
    if held:
        raise Unsupported(f"argument tensor {held[0]} has a .grad already: the step would add "
                          "into it; set it to None (optimizer.zero_grad()) before the step")
    holds = {n_args + p: n_args + g for g, p in state.grad_of.items()}  # param -> its grad
    found: dict[str, Any] = {}  # what a trace found, and how it traces (set by trace())

    def flat(*ts: torch.Tensor) -> list[torch.Tensor]:
        functional = found["functional"]
        mode: Any = FunctionalTensorMode() if functional else contextlib.nullcontext()
        fs = list(ts)
        if functional:
            with mode:
                fs = [FunctionalTensor.to_functional(t) for t in ts]
            for j in params:
                fs[j].requires_grad_()
        for j in params:
            _hooks_onto(tensors[j], fs[j])
        full = list(leaves)
        for i, t in zip(tensor_at, fs):
            full[i] = t
        with mode, state.swapped(fs[n_args:], {id(r): f for r, f in zip(tensors, fs[:n_args])},
                                 compiling=found["compiling"]), FunctionalFusedUpdates():
            out = fn(*tree_unflatten(full, spec))
            after = {j: fs[j].grad for j in params}
        outs, out_spec = tree_flatten(tree_map(_held, out))
        grads = [j for j in params if after[j] is not None
                 and (j not in holds or after[j] is not fs[holds[j]])]
        cleared = [j for j in holds if after[j] is None]
        found.update(n=len(outs), spec=out_spec, grads=grads, cleared=cleared)
        if not functional:
            return [_detached(o) for o in outs] + [after[j] for j in grads]
        results = [_detached(_unwrapped(o)) for o in outs] + \
            [_unwrapped(after[j]) for j in grads]
        with torch.no_grad():  # what the step wrote into its inputs, written back last
            for j, (t, f) in enumerate(zip(ts, fs)):
                if torch._functionalize_has_metadata_mutation(f.elem):
                    what = f"argument tensor {j}" if j < n_args else state.names[j - n_args]
                    raise Unsupported(f"the step changes the shape, strides or storage of "
                                      f"{what} in place")
                if torch._functionalize_has_data_mutation(f.elem):
                    t.copy_(_unwrapped(f))
        return results

    stepped = {id(opt) for _, opt in state.optimizers}

    def refuse_optimizer(opt: Any, *_: Any) -> None:
        if id(opt) in stepped:
            return
        raise Unsupported(f"the step calls {type(opt).__name__}.step() on an optimizer it "
                          "doesn't name (not an argument, global or closure variable of the "
                          "step): pass it as an argument")

    plain = [t.detach() for t in tensors]  # the functional trace makes its own leaves

    def trace(functional: bool) -> torch.fx.GraphModule:
        # torch's decompositions above autograd, as aot's; FX patches the process: one tracer
        with enable_python_dispatcher(), tracing():
            return traced(functional)

    def traced(functional: bool) -> torch.fx.GraphModule:
        # foreach updates fail on torch.optim's compile-friendly path under fake tensors (its
        # stacked step sizes): those take the eager path, whose .item() reads stay graph values
        found.update(functional=functional, compiling=not state.uses_foreach())
        inputs = plain if functional else tensors
        try:
            gm = make_fx(flat, tracing_mode="fake", record_stack_traces=True)(*inputs)
        except Unsupported:
            raise
        except Exception:
            if not state.optimizers or not found["compiling"]:
                raise
            # the compile-friendly path failed for another optimizer option: the eager path
            found["compiling"] = False
            gm = make_fx(flat, tracing_mode="fake", record_stack_traces=True)(*inputs)
        _drop_profiler_ranges(gm)
        if not functional:  # the plain trace made functional by a second one
            with torch.fx.traceback.preserve_node_meta():  # user lines carried, for messages
                gm = make_fx(torch.func.functionalize(_replay(gm), remove="mutations"),
                             tracing_mode="fake")(*plain)
        return gm

    places = pystate.watch(fn, state.modules)  # Python state the trace must leave alone
    before = pystate.snapshot(places)
    moved: list[str] = []
    hook = register_optimizer_step_pre_hook(refuse_optimizer)
    try:
        try:
            gm = trace(functional=True)
        except Unsupported:
            raise
        except Exception as e:  # code that tests for fake tensors sees functional ones
            log.info("autopar: the step's functional trace failed (%s: %s): traced plain, "
                     "then functionalized", type(e).__name__, first_line(e))
            gm = trace(functional=False)
        gm.graph.eliminate_dead_code(is_impure_node=kept_unused)
    except Unsupported:
        raise
    except Exception as e:
        text = str(e).strip()
        where = _user_line(e)
        if "convert all Tensors to FakeTensors" in text:  # a real tensor the trace can't lift
            op = text.split("Found in ", 1)[1].split("(", 1)[0] if "Found in " in text else "an op"
            raise Unsupported(
                f"the step reads a tensor that is not its argument in {op}{where}: "
                f"{_not_arguments(fn, state)}; {_PASS_THEM}") from e
        first = (text.splitlines() or [type(e).__name__])[0]
        if type(e).__name__ == "GuardOnDataDependentSymNode":  # a branch on a traced number
            raise Unsupported(
                f"can't trace the step{where}: {_code_line(e)} branches on a number computed "
                f"from tensors, which a trace can't decide ({first[:160]})") from e
        raise Unsupported(f"can't trace the step{where}: {type(e).__name__}: {first}") from e
    finally:
        hook.remove()
        moved = pystate.changed(places, before)
        if moved:  # (fake tensors must not stay in user objects, whatever stopped the trace)
            pystate.restore(places, before)
    if moved:
        raise ChangesPython(
            f"the step changes {', '.join(moved[:3])} in Python as it runs, which a replayed "
            "graph would not do again (put back as it was before the trace); return such "
            "values from the step instead")
    graph, constants = from_fx(gm, name or getattr(fn, "__name__", "step"))
    outside = _held_outside(fn, constants)
    if outside:
        raise Unsupported(f"the step reads {len(outside)} tensor(s) that are not its "
                          f"arguments: {_not_arguments(fn, state, outside)}; {_PASS_THEM}")
    mutated = _take_input_copies(graph)
    return StepGraph(graph, found["n"], found["spec"], found["grads"], mutated, params, n_args,
                     found["cleared"], constants)


_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
"""What a step may return besides tensors: Python numbers (``loss.item()``: the graph reads
it on the host, as eager does) and constants."""


def _held(value: Any) -> Any:
    """An output leaf as the trace keeps it: a tensor, a number or None as itself; a plain
    Python object holding tensors (a Hugging Face ``DynamicCache``, a dataclass no pytree
    knows) as a :class:`_Held` of it, whose tensors are graph outputs."""
    if isinstance(value, (torch.Tensor, *_NUMBERS, type(None))):
        return value
    tensors = pystate.held_tensors(value)
    if tensors is None:
        raise Unsupported(f"the step returns a {type(value).__name__}, which holds what a "
                          "graph can't give back; only tensors, numbers (loss.item()), None "
                          "and plain objects holding them are captured")
    return _Held(value, tensors)


class _Held:
    """A plain object the step returns and the tensors it holds. Flattened (a pytree node),
    it is those tensors; unflattened around a call's tensors, it is a deep copy of the object
    the trace returned with each of its tensors replaced by the call's (so a call's cache is
    a new object of the user's type, as eager's is; its other values are the trace's)."""

    def __init__(self, template: Any, tensors: list[torch.Tensor]) -> None:
        self.template, self.tensors = template, tensors


def _unflatten_held(children: Any, context: Any) -> Any:
    template, ids = context
    return copy.deepcopy(template, memo=dict(zip(ids, children, strict=True)))


register_pytree_node(_Held, lambda h: (h.tensors, (h.template, [id(t) for t in h.tensors])),
                     _unflatten_held, serialized_type_name="autopar.capture.step._Held")


def _hooks_onto(real: torch.Tensor, traced: torch.Tensor) -> None:
    """The hooks the user put on a parameter (``register_hook``: on its gradient as backward
    computes it; ``register_post_accumulate_grad_hook``: once its ``.grad`` is accumulated)
    put on the leaf that stands for it in the trace, so that they are traced as eager runs
    them (the functional trace makes leaves of its own, which carry none)."""
    for hook in (real._backward_hooks or {}).values():
        traced.register_hook(hook)
    for hook in (getattr(real, "_post_accumulate_grad_hooks", None) or {}).values():
        traced.register_post_accumulate_grad_hook(hook)


def _replay(gm: torch.fx.GraphModule) -> Callable:
    """``gm``'s ops run again (for ``torch.func.functionalize``), fused updates functional."""
    def run(*args: Any) -> Any:
        with FunctionalFusedUpdates():
            return torch.fx.Interpreter(gm).run(*args)
    return run


def _unwrapped(t: Any) -> Any:
    """The traced tensor a functional one stands for, its pending updates applied (a number
    as it is)."""
    if not isinstance(t, torch.Tensor):
        return t
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _held_outside(fn: Callable, constants: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The constants the trace met that the user holds (a module's tensor, a global or closure
    tensor): a later call could see them changed or replaced, so they are refused. The rest
    were made during the trace (``torch.tensor([...])`` in the step) and are the graph's own."""
    held = {id(v) for _, v, _ in free_values(fn) if isinstance(v, torch.Tensor)}
    for module in _reachable_modules(fn).values():
        held.update(id(t) for t in [*module.parameters(), *module.buffers()])
    return [c for c in constants if id(c) in held]


_PROFILER_OPS = (torch.ops.profiler._record_function_exit._RecordFunction,
                 torch.ops.profiler._record_function_enter_new.default)


def _drop_profiler_ranges(gm: torch.fx.GraphModule) -> None:
    """Take out the ``record_function`` ranges ``torch.optim`` opens (they carry no value)."""
    for target in _PROFILER_OPS:
        for node in [n for n in gm.graph.nodes if n.target is target]:
            if not node.users:
                gm.graph.erase_node(node)
    gm.recompile()


_PASS_THEM = ("pass it as an argument, or hold it in a module or optimizer the step names (as an "
              "argument, a global or a closure variable)")


def _reachable_modules(fn: Callable) -> dict[str, torch.nn.Module]:
    """The modules ``fn`` names: in its closure and among the globals its code reads."""
    return {name: v for name, v, _ in free_values(fn) if isinstance(v, torch.nn.Module)}


def _not_arguments(fn: Callable, state: State,
                   tensors: Sequence[torch.Tensor] | None = None) -> str:
    """Names of the tensors a step reads that are not its arguments: a module's parameters
    and buffers by their qualified names (``model.fc.weight (2x3)``), others by shape."""
    names: dict[int, str] = {}
    lifted = {id(t) for t in state.tensors}
    for var, module in _reachable_modules(fn).items():
        for qual, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) not in lifted:
                names.setdefault(id(t),
                                 f"{var}.{qual} ({'x'.join(map(str, t.shape)) or 'scalar'})")
    if tensors is None:  # which ones the trace met is not known: the candidates
        return ", ".join(list(names.values())[:6]) + (" ..." if len(names) > 6 else "") \
            if names else "a tensor held outside the step"
    return ", ".join(names.get(id(t), f"a tensor of shape {tuple(t.shape)}") for t in tensors)


def _innermost(e: BaseException, outside: tuple[str, ...]) -> tuple[Any, int] | None:
    """(code, line) of the innermost frame of ``e``'s traceback whose file is under none of
    the ``outside`` paths, or None."""
    tb, found = e.__traceback__, None
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(outside):
            found = tb.tb_frame.f_code, tb.tb_lineno
        tb = tb.tb_next
    return found


def _user_line(e: BaseException) -> str:
    """`` at file:line`` of the innermost frame of ``e``'s traceback outside torch and
    autopar (the user's line), or ''."""
    found = _innermost(e, _LIBRARIES)
    return "" if found is None else f" at {os.path.basename(found[0].co_filename)}:{found[1]}"


def _code_line(e: BaseException) -> str:
    """``file:line (function)`` of the innermost frame of ``e``'s traceback that is code the
    user knows (theirs, or torch's libraries: ``torch/optim``, ``torch/nn``...) and not the
    tracing machinery (``torch/fx``, fake and functional tensors, ``torch/__init__.py``'s
    symbolic numbers), its path from torch's parent; ``an op`` if none."""
    found = _innermost(e, _MACHINERY)
    if found is None:
        return "an op"
    code, line = found
    root = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep
    path = code.co_filename
    path = path[len(root):] if path.startswith(root) else os.path.basename(path)
    return f"{path}:{line} ({code.co_name})"


_TORCH = os.path.dirname(torch.__file__) + os.sep
_AUTOPAR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = (_TORCH, _AUTOPAR)
_MACHINERY = (_AUTOPAR, *(_TORCH + part for part in (
    "fx", "_subclasses", "_ops.py", "__init__.py", "_tensor.py", "utils", "_dynamo", "_prims",
    "_refs", "_decomp", "_functorch", "_compile.py", "_library", "overrides.py",
    "_higher_order_ops", "sym_")))


def _take_input_copies(graph: Graph) -> list[int]:
    """Remove the trailing ``copy_(input, value)`` nodes; their values become outputs."""
    inputs = graph.inputs
    mutated: list[int] = []
    values: list[Node] = []
    users = graph.users()
    while graph.nodes and graph.nodes[-1].op is _COPY_:
        node = graph.nodes[-1]
        target, value = node.args[:2]
        if not target.is_input or users[node] or node in graph.output_nodes:
            raise Unsupported(f"{node!r} writes a value that is not a step argument")
        graph.nodes.pop()
        mutated.insert(0, inputs.index(target))
        values.insert(0, value)
    writers = [n for n in graph.ops if n.writes]
    if writers:
        raise Unsupported(f"{writers[0]!r} writes in place in the middle of the step")
    graph.set_outputs([*graph.outputs, *values])
    graph.verify()
    return mutated



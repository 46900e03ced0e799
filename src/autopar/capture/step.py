"""Whole-step capture for data parallelism: a training step (forward, backward, update) traced
into one functional graph (see :mod:`autopar.dataparallel` for why not ``torch.compile``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..ir.graph import Graph, Node
from .direct import free_values
from .fx import Unsupported, from_fx

__all__ = ["StepGraph", "capture_step"]

_COPY_ = torch.ops.aten.copy_.default


@dataclass
class StepGraph:
    """One traced step: a functional graph over the step's tensor arguments.

    ``graph.outputs`` are, in order: the step's own outputs (``n_outputs`` of them, flattened),
    the ``.grad`` of each index in ``grads``, and the new value of each index in ``mutated``.
    """

    graph: Graph
    n_outputs: int
    out_spec: Any
    grads: list[int]
    mutated: list[int]
    params: list[int]

    @property
    def updates(self) -> dict[Node, Node]:
        """Each mutated input and the node of its new value."""
        first = self.n_outputs + len(self.grads)
        inputs = self.graph.inputs
        return {inputs[j]: self.graph.outputs[first + k] for k, j in enumerate(self.mutated)}


def capture_step(fn: Callable, args: Sequence[Any], name: str | None = None) -> StepGraph:
    """Trace ``fn(*args)`` (forward, backward, update) into one functional :class:`StepGraph`.

    Nothing is computed and nothing of ``args`` changes: the trace runs on fake tensors.
    """
    leaves, spec = tree_flatten(tuple(args))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_at]
    params = [j for j, t in enumerate(tensors) if t.requires_grad and t.is_leaf]
    held = [j for j in params if tensors[j].grad is not None]
    if held:
        raise Unsupported(f"argument tensor {held[0]} has a .grad already: the step would add "
                          "into it; set it to None (optimizer.zero_grad()) before the step")
    found: dict[str, Any] = {}

    def flat(*ts: torch.Tensor) -> list[torch.Tensor]:
        full = list(leaves)
        for i, t in zip(tensor_at, ts):
            full[i] = t
        out = fn(*tree_unflatten(full, spec))
        outs, out_spec = tree_flatten(out)
        bad = [o for o in outs if not isinstance(o, torch.Tensor)]
        if bad:
            raise Unsupported(f"the step returns a {type(bad[0]).__name__}; only tensors are "
                              "captured")
        grads = [j for j in params if ts[j].grad is not None]
        found.update(n=len(outs), spec=out_spec, grads=grads)
        return [o.detach() for o in outs] + [ts[j].grad for j in grads]

    def refuse_optimizer(opt: Any, *_: Any) -> None:
        raise Unsupported(f"the step calls {type(opt).__name__}.step(): torch.optim optimizers "
                          "hold the parameters themselves, which the trace can't follow; write "
                          "the update on the step's arguments (p -= lr * p.grad)")

    hook = register_optimizer_step_pre_hook(refuse_optimizer)
    try:
        gm = make_fx(flat, tracing_mode="fake")(*tensors)
        plain = [t.detach() for t in tensors]
        gm = make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="fake")(*plain)
    except Unsupported:
        raise
    except Exception as e:
        text = str(e).strip()
        where = _user_line(e)
        if "convert all Tensors to FakeTensors" in text:  # a real tensor the trace can't lift
            op = text.split("Found in ", 1)[1].split("(", 1)[0] if "Found in " in text else "an op"
            raise Unsupported(
                f"the step reads a tensor that is not its argument in {op}{where}: "
                f"{_not_arguments(fn)}; {_PASS_THEM}") from e
        first = (text.splitlines() or [type(e).__name__])[0]
        raise Unsupported(f"can't trace the step{where}: {type(e).__name__}: {first}") from e
    finally:
        hook.remove()
    graph, constants = from_fx(gm, name or getattr(fn, "__name__", "step"))
    if constants:
        raise Unsupported(f"the step reads {len(constants)} tensor(s) that are not its "
                          f"arguments: {_not_arguments(fn, constants)}; {_PASS_THEM}")
    mutated = _take_input_copies(graph)
    return StepGraph(graph, found["n"], found["spec"], found["grads"], mutated, params)


_PASS_THEM = ("data_parallel splits a step whose parameters and buffers are its arguments: pass "
              "them as arguments (a module's own parameters and torch.optim optimizers are not "
              "split yet)")


def _reachable_modules(fn: Callable) -> dict[str, torch.nn.Module]:
    """The modules ``fn`` names: in its closure and among the globals its code reads."""
    return {name: v for name, v, _ in free_values(fn) if isinstance(v, torch.nn.Module)}


def _not_arguments(fn: Callable, tensors: Sequence[torch.Tensor] | None = None) -> str:
    """Names of the tensors a step reads that are not its arguments: a module's parameters
    and buffers by their qualified names (``model.fc.weight (2x3)``), others by shape."""
    names: dict[int, str] = {}
    for var, module in _reachable_modules(fn).items():
        for qual, t in [*module.named_parameters(), *module.named_buffers()]:
            names.setdefault(id(t), f"{var}.{qual} ({'x'.join(map(str, t.shape)) or 'scalar'})")
    if tensors is None:  # which ones the trace met is not known: the candidates
        return ", ".join(list(names.values())[:6]) + (" ..." if len(names) > 6 else "") \
            if names else "a tensor held outside the step"
    return ", ".join(names.get(id(t), f"a tensor of shape {tuple(t.shape)}") for t in tensors)


def _user_line(e: BaseException) -> str:
    """`` at file:line`` of the innermost frame of ``e``'s traceback outside torch and
    autopar (the user's line), or ''."""
    tb, where = e.__traceback__, ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith(_LIBRARIES):
            where = f" at {os.path.basename(path)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


_LIBRARIES = (os.path.dirname(torch.__file__) + os.sep,
              os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


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



"""Graphs with dynamic shapes: one static graph per concrete signature, made at its first call.

autopar places graphs whose shapes are known (placement prices every op from its shapes).
Dynamo hands a backend a graph with symbolic sizes when a compiled function is called with new
shapes (its "automatic dynamic" recompile) or when the user marked a dimension dynamic.

Policy
- :class:`PerShape` stands in for such a graph. At each call it keys the arguments by their
  signature (each tensor's shape, strides, dtype and device; each other argument's value); the
  first call of a signature makes the graph static for those shapes (every size input
  replaced by its number, every value recomputed on fake tensors of those shapes:
  :func:`_static_graph`) and hands it to the builder, as dynamo would have handed it a static
  graph. Later calls of the signature look it up: one dict
  lookup per call.
- A signature whose graph can't be made static (a size decided by a value the graph reads, as
  ``x[:n.item()]``) or placed runs the dynamic graph eagerly, with the reason logged once per
  signature: never a wrong result.
- At most ``MAX_SIGNATURES`` static graphs are kept per dynamic graph; beyond that new
  signatures run eagerly (logged once), so a function called with ever new shapes doesn't
  compile without end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

log = logging.getLogger("autopar.capture")

__all__ = ["MAX_SIGNATURES", "PerShape", "is_symbolic"]

MAX_SIGNATURES = 16

Run = Callable[[list], Any]


def is_symbolic(example_inputs: Sequence[Any]) -> bool:
    """Whether dynamo made any of a graph's inputs symbolic (a size, or a tensor's shape)."""
    sym = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for x in example_inputs:
        if isinstance(x, sym):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt)
                                               for s in (*x.shape, *x.stride())):
            return True
    return False


def _static_graph(gm: torch.fx.GraphModule, args: Sequence[Any]) -> torch.fx.GraphModule:
    """``gm`` for ``args``: each input that is not a tensor (a size) replaced by its value and
    every node's value recomputed on fake tensors of the arguments' shapes
    (``FakeTensorProp``, an interpreter: no FX trace, so no process-wide tracing flag that
    would refuse other threads' compiled calls while it runs, as ``make_fx`` did)."""
    graph = torch.fx.Graph()
    given: dict[torch.fx.Node, Any] = {}
    tensors = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), args, strict=True):
        if isinstance(value, torch.Tensor):
            given[node] = graph.placeholder(node.name)
            given[node].meta = dict(node.meta)
            tensors.append(value)
        else:
            given[node] = value
    out = graph.graph_copy(gm.graph, given)
    graph.output(out)
    static = torch.fx.GraphModule(gm, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.no_grad():
        FakeTensorProp(static, mode).propagate(*[mode.from_tensor(t) for t in tensors])
    return static


def _signature(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else (type(a), a) for a in args)


class PerShape:
    """``run(args)`` for a dynamic-shape aot_autograd graph ``gm`` (see the module docstring).

    ``specialize(static_gm, label)`` turns a static graph of tensor inputs into its runner
    (``run(tensor_args) -> outputs``), raising to refuse it."""

    def __init__(self, gm: torch.fx.GraphModule, label: str,
                 specialize: Callable[[torch.fx.GraphModule, str], Run]) -> None:
        # an instance attribute: wrappers copy __dict__ (functools.wraps), not class attributes
        self._boxed_call = True  # aot_autograd's calling convention: one list of arguments
        self.gm = gm
        self.label = label
        self.specialize = specialize
        self.runs: dict[tuple, tuple[list[int], Run | None]] = {}
        self.full = False  # MAX_SIGNATURES met (said once)

    def __call__(self, args: list) -> Any:
        args = list(args)
        key = _signature(args)
        found = self.runs.get(key)
        if found is None:
            found = self._build(args, key)
        tensors, run = found
        if run is None:
            return self.gm(*args)
        return run([args[i] for i in tensors])

    def _build(self, args: list, key: tuple) -> tuple[list[int], Run | None]:
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if len(self.runs) >= MAX_SIGNATURES:  # not kept: runs stays bounded
            if not self.full:
                self.full = True
                log.warning("autopar: %s has met %d signatures: new ones run eagerly",
                            self.label, MAX_SIGNATURES)
            return tensors, None
        label = f"{self.label}#{len(self.runs) + 1}"
        shapes = ", ".join(str(list(args[i].shape)) for i in tensors)

        run: Run | None
        try:
            run = self.specialize(_static_graph(self.gm, args), label)
            log.info("autopar: %s placed for shapes %s", label, shapes)
        except Exception as e:  # any failure: this signature runs eagerly
            log.warning("autopar: %s runs eagerly for shapes %s: %s: %s", self.label, shapes,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            run = None
        self.runs[key] = (tensors, run)
        return self.runs[key]

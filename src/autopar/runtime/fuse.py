"""Fusion: runs of one device's ops compiled by Inductor into one function (autopar places,
Inductor fuses).

Policy
- Which regions are compiled is decided in :mod:`autopar.passes.fusion` (it is handed to the
  executor): a *region* is a maximal run of consecutive fusible Run steps of one program; Free
  steps are transparent, any other step (Send, Record, Wait: a cross-device point) or a
  non-fusible op ends it. A region is compiled only where that pays: at least ``MIN_FUSED_OPS``
  pointwise or reduction ops (a lone ``mm`` gains nothing from Inductor).
- Fusible: an ATen op (or ``getitem`` of one) with tensor outputs that mutates nothing, draws
  no random numbers (Inductor's RNG is not eager's), is no free device move (a copy or a
  hand-on: :func:`~autopar.ir.routing.is_free_move`),
  reads only values that live in this device's memory pool (a host scalar a GPU kernel takes
  as an argument stays with the plain ops), and neither reads nor makes float16 or bfloat16
  values: Inductor computes those in float32 inside a kernel and rounds where eager's kernels
  don't (a half-precision ``layer_norm`` backward came out 3 ulps off eager on an H200, beyond
  eager-equality tolerances), so low-precision math runs op by op, as eager's.
- A region's inputs are the values it reads from outside; its outputs are the values used
  outside it (by any later step of any program, or as graph outputs). Outputs are fresh
  tensors: a view (or tuple) that would escape a region is left out of it and runs as a plain
  op, so aliasing stays exactly eager's (found by a fixpoint: leaving one op out can split a
  region and make another value escape).
- Compilation is lazy: the first call of a region compiles it with
  ``torch._inductor.compile_fx.compile_fx_inner`` on the real inputs (outside any tracing, on
  the device's worker thread, one compile at a time), logs the seconds it took, and keeps the
  result in a process-wide cache keyed by the region's code and input layouts (Inductor's own
  on-disk cache serves later processes). Inductor compiles in this process
  (``compile_threads=1``): its pool of compile worker processes would take every core for
  seconds after the first call, beside the user's program. A failed compile, or inputs whose
  layout changed, runs the region's ops one by one from then on, with the reason logged once:
  never a wrong result.

Glossary: :class:`Fused` the step that replaces a region in a program; :class:`FusedKernel`
its callable (``kernel(inputs) -> outputs``, inputs as a list), with ``status`` one of
``"pending"``, ``"compiled"``, ``"fallback"`` and ``compile_s``, ``reason``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map_only

from ..ir.graph import Node, TensorMeta, op_name
from ..ir.locks import tracing
from ..ir.logs import first_line
from ..ir.regions import inputs_of, outputs_of
from ..ir.routing import GraphIndex, kind_of, pool
from ..schedule.steps import Free, Run, Step

__all__ = ["Fused", "FusedKernel", "fuse_program", "same_pool"]

log = logging.getLogger("autopar.runtime")

_LABEL_KINDS = ("pointwise", "reduction")  # named in a region's label
_COMPILE_LOCK = threading.Lock()
_CACHE: dict[tuple, Callable[[list], Any]] = {}


class FusedKernel:
    """One region's callable: Inductor's compiled function, built at its first call."""

    def __init__(self, gm: torch.fx.GraphModule, device: str, label: str,
                 eager_layouts: Sequence[TensorMeta | None] = ()) -> None:
        self.gm = gm
        self.device = device
        self.label = label
        self.status = "pending"
        self.reason: str | None = None
        self.compile_s = 0.0
        self._fn: Callable[[list], Any] | None = None
        self._layout: tuple | None = None
        self.eager_layouts = tuple(eager_layouts)  # each output's eager metadata, if known
        self._restride: list[int] | None = None  # outputs whose strides are not eager's

    @property
    def compiled(self) -> Callable[[list], Any] | None:
        """Inductor's function once the region compiled (None before, or after a fallback)."""
        return self._fn if self.status == "compiled" else None

    def __call__(self, inputs: list) -> Sequence[Any]:
        fn = self._fn
        if fn is None:
            fn = self._compile(inputs)
        try:
            outs = fn(list(inputs))  # Inductor's boxed call empties the list it is given
        except Exception:
            # Inductor checks its inputs' sizes and strides; a region is functional, so
            # running its ops one by one instead is safe. Any other error is the user's.
            if self._layout is None or _layout(inputs) == self._layout:
                raise
            self._give_up("the inputs' layout changed since the region was compiled")
            return self._plain(inputs)
        return self.eager_strides(outs)

    def eager_strides(self, outs: Sequence[Any]) -> Sequence[Any]:
        """``outs`` with eager's strides: Inductor may lay an output out otherwise (a padded
        attention bias made contiguous, a transposed result), and kernels with layout rules
        (SDPA's alignment checks, ``view``) downstream must see what they see eagerly. Which
        outputs differ is found at the first call: a compiled region's layouts don't change."""
        if self._restride is None:
            self._restride = [
                i for i, (o, m) in enumerate(zip(outs, self.eager_layouts))
                if isinstance(m, TensorMeta) and isinstance(o, torch.Tensor)
                and tuple(o.shape) == m.shape and o.stride() != m.stride]
        if not self._restride:
            return outs
        outs = list(outs)
        for i in self._restride:
            m = self.eager_layouts[i]
            outs[i] = torch.empty_strided(m.shape, m.stride, dtype=outs[i].dtype,
                                          device=outs[i].device).copy_(outs[i])
        return outs

    def _plain(self, inputs: list) -> Sequence[Any]:
        return self.gm(*inputs)

    def _give_up(self, reason: str) -> None:
        self.status, self.reason, self._fn, self._layout = "fallback", reason, self._plain, None
        self._restride = None
        log.warning("autopar: %s runs op by op: %s", self.label, reason)

    def _compile(self, inputs: list) -> Callable[[list], Any]:
        with _COMPILE_LOCK:
            if self._fn is not None:
                return self._fn
            layout = _layout(inputs)
            key = (self.gm.code, layout)
            fn = _CACHE.get(key)
            cached = fn is not None
            start = time.perf_counter()
            if fn is None:
                try:
                    fn = _inductor(self.gm, inputs)
                except Exception as e:
                    self._give_up(f"Inductor failed: {type(e).__name__}: {first_line(e)}")
                    return self._plain
                _CACHE[key] = fn
            self.compile_s = time.perf_counter() - start
            self.status, self._layout = "compiled", layout
            log.info("autopar: compiled %s in %.3f s%s", self.label, self.compile_s,
                     " (the same region was compiled before)" if cached else "")
            self._fn = fn
            return fn


def _layout(inputs: list) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor)
                 else type(t) for t in inputs)


def _inductor(gm: torch.fx.GraphModule, inputs: list) -> Callable[[list], Any]:
    """Inductor's compiled function of ``gm`` (a functional ATen graph, as aot_autograd hands
    Inductor): ``fn(list) -> tuple``, a boxed call that empties the list it is given."""
    from torch._inductor import config as inductor_config  # lazy: slow to import
    from torch._inductor.compile_fx import compile_fx_inner  # lazy: slow to import
    from torch._inductor.decomposition import select_decomp_table  # lazy: slow to import

    # Inductor lowers decomposed graphs: aot_autograd applies its table before handing one over
    # (an op with a decomposition, such as aten.t, has no lowering of its own).
    # compile_threads=1: Inductor compiles in this process. Its pool of compile workers would
    # start beside the user's program and take every core for seconds (2xH200 host: a 4 MB
    # host copy went from 23 us to 8 ms until the pool settled: benchmarks/NOTES.md)
    # (tracing(): FX patches the process while it traces, and torch.compile's own compiles
    # take the same lock)
    with torch.no_grad(), inductor_config.patch({"compile_threads": 1}), tracing():
        decomposed = make_fx(gm, decomposition_table=select_decomp_table(),
                             tracing_mode="fake")(*inputs)
        return compile_fx_inner(decomposed, list(inputs))


@dataclass(frozen=True, eq=False)
class Fused:
    """The step that runs a region: ``outputs = kernel(inputs)``."""

    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    kernel: FusedKernel

    @property
    def node(self) -> Node:
        """The region's last op (where errors are reported)."""
        return self.nodes[-1]

    def __str__(self) -> str:
        return (f"fused  {', '.join(map(repr, self.outputs))} = {self.kernel.label}"
                f"({', '.join(map(repr, self.inputs))})")


# -- building ---------------------------------------------------------------------------------
def build_gm(nodes: Sequence[Node], inputs: Sequence[Node], outputs: Sequence[Node],
             device: str) -> torch.fx.GraphModule:
    """An fx GraphModule computing ``outputs`` from ``inputs`` by ``nodes`` (ops with a
    ``device=`` argument get ``device``, as in :mod:`autopar.runtime.codegen`)."""
    torch_device = torch.device("cpu") if device.startswith("cpu") else torch.device(device)
    g = torch.fx.Graph()
    env: dict[Node, torch.fx.Node] = {v: g.placeholder(f"in{i}") for i, v in enumerate(inputs)}

    for n in nodes:
        kwargs = dict(n.kwargs)
        if "device" in kwargs:
            kwargs["device"] = torch_device
        env[n] = g.call_function(n.op, *tree_map_only(Node, env.__getitem__,
                                                      (tuple(n.args), kwargs)))
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule({}, g)


def fuse_program(device: str, steps: list[Step], found: Sequence[Sequence[Node]], ix: GraphIndex,
                 graph_outputs: set[Node], label: str = "") -> list[Any]:
    """``steps`` with each region of ``found`` (chosen by :mod:`autopar.passes.fusion`) replaced
    by one :class:`Fused` step.

    Frees inside a region of values it made and keeps to itself go; the other Frees follow
    the Fused step.
    """
    if not found:
        return list(steps)
    region_of = {n: i for i, g in enumerate(found) for n in g}
    fused: list[Fused] = []
    for i, g in enumerate(found):
        ins, outs = inputs_of(g), outputs_of(g, ix.users, graph_outputs)
        kinds = sorted({op_name(n.op) for n in g if kind_of(n.op) in _LABEL_KINDS})
        name = (f"fused region {label}{device}#{i} ({len(g)} ops: "
                f"{', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''})")
        kernel = FusedKernel(build_gm(g, ins, outs, device), device, name,
                             [o.meta if isinstance(o.meta, TensorMeta) else None for o in outs])
        fused.append(Fused(tuple(g), tuple(ins), tuple(outs), kernel))
    out: list[Any] = []
    pending_frees: list[Step] = []
    current: int | None = None
    for step in steps:
        if isinstance(step, Run) and step.node in region_of:
            r = region_of[step.node]
            if r != current:
                out += pending_frees
                pending_frees = []
                out.append(fused[r])
                current = r
            continue
        if isinstance(step, Free) and current is not None:
            internal = step.value in region_of and region_of[step.value] == current \
                and step.value not in fused[current].outputs
            if not internal:
                pending_frees.append(step)
            continue
        out += pending_frees
        pending_frees = []
        current = None
        out.append(step)
    return out + pending_frees


def same_pool(device: str, source_of: Callable[[Node, str], str]) -> Callable[[Node], bool]:
    """``local(v)``: does a reader on ``device`` find ``v`` in its own memory pool?"""
    here = pool(device)
    return lambda v: pool(source_of(v, device)) == here

"""Fusion: runs of one device's ops compiled by Inductor into one function (autopar places,
Inductor fuses).

Policy
- A *region* is a maximal run of consecutive fusible Run steps of one program; Free steps are
  transparent, any other step (Send, Record, Wait: a cross-device point) or a non-fusible op
  ends it. A region is compiled only where that pays: at least ``MIN_FUSED_OPS`` pointwise or
  reduction ops (a lone ``mm`` gains nothing from Inductor).
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
import operator
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir.graph import Node, TensorMeta, op_name
from ..ir.routing import GraphIndex, is_free_move, kind_of, pool
from ..schedule.plan import Free, Run, Step

__all__ = ["MIN_FUSED_OPS", "Fused", "FusedKernel", "cpu_fusion_unavailable", "fuse_program",
           "regions"]

log = logging.getLogger("autopar")

MIN_FUSED_OPS = 2
"""A region is compiled when it has at least this many pointwise or reduction ops."""

_PAYING_KINDS = ("pointwise", "reduction")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_COMPILE_LOCK = threading.Lock()
_CACHE: dict[tuple, Callable[[list], Any]] = {}


@cache
def cpu_fusion_unavailable() -> str | None:
    """Why Inductor can't compile CPU code here (it needs a C++ compiler), or None."""
    try:
        from torch._inductor import config  # lazy: slow to import

        names = [c for c in config.cpp.cxx if c]
    except Exception as e:  # pragma: no cover - Inductor's config moved
        return f"Inductor's C++ compiler setting is unreadable: {type(e).__name__}: {e}"
    if not any(shutil.which(c) for c in names):
        return f"no C++ compiler for Inductor's CPU code (looked for {', '.join(names)})"
    return None


class FusedKernel:
    """One region's callable: Inductor's compiled function, built at its first call."""

    def __init__(self, gm: torch.fx.GraphModule, device: str, label: str) -> None:
        self.gm = gm
        self.device = device
        self.label = label
        self.status = "pending"
        self.reason: str | None = None
        self.compile_s = 0.0
        self._fn: Callable[[list], Any] | None = None
        self._layout: tuple | None = None

    @property
    def compiled(self) -> Callable[[list], Any] | None:
        """Inductor's function once the region compiled (None before, or after a fallback)."""
        return self._fn if self.status == "compiled" else None

    def __call__(self, inputs: list) -> Sequence[Any]:
        fn = self._fn
        if fn is None:
            fn = self._compile(inputs)
        try:
            return fn(list(inputs))  # Inductor's boxed call empties the list it is given
        except Exception:
            # Inductor checks its inputs' sizes and strides; a region is functional, so
            # running its ops one by one instead is safe. Any other error is the user's.
            if self._layout is None or _layout(inputs) == self._layout:
                raise
            self._give_up("the inputs' layout changed since the region was compiled")
            return self._plain(inputs)

    def _plain(self, inputs: list) -> Sequence[Any]:
        return self.gm(*inputs)

    def _give_up(self, reason: str) -> None:
        self.status, self.reason, self._fn, self._layout = "fallback", reason, self._plain, None
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
                    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    self._give_up(f"Inductor failed: {type(e).__name__}: {first}")
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
    with torch.no_grad(), inductor_config.patch({"compile_threads": 1}):
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


# -- which ops, which regions ----------------------------------------------------------------
def fusible(node: Node, device: str, local: Callable[[Node], bool],
            device_of: dict[Node, str], passthrough: frozenset[Node] = frozenset()) -> bool:
    """May ``node`` (placed on ``device``) be part of a region? See the module docstring."""
    if node.op is operator.getitem:
        return True  # with its tuple's producer only: regions() checks
    if not isinstance(node.op, torch._ops.OpOverload) or node.writes or not node.tensor_metas:
        return False
    if isinstance(node.meta, tuple) and any(m is None for m in node.meta):
        return False
    if kind_of(node.op) == "random" or is_free_move(node, device_of, passthrough):
        return False
    if torch.Tag.nondeterministic_seeded in node.op.tags:
        return False
    if not all(local(v) for v in node.inputs):
        return False
    if not all(isinstance(v.meta, TensorMeta) for v in node.inputs):
        return False
    metas = [*node.tensor_metas, *(v.meta for v in node.inputs)]
    return not any(m.dtype in _LOW_PRECISION for m in metas)


def regions(steps: Sequence[Step], can_fuse: Callable[[Node], bool],
            users: dict[Node, list[Node]], graph_outputs: set[Node],
            min_ops: int = MIN_FUSED_OPS) -> list[list[Node]]:
    """The regions of one program worth compiling, each a list of nodes in program order."""
    left_out: set[Node] = set()

    def ok(n: Node) -> bool:
        return n not in left_out and can_fuse(n)

    while True:
        groups = _groups(steps, ok)
        misfits = {n for g in groups for n in _misfits(g, users, graph_outputs)}
        if not misfits:
            break
        left_out |= misfits
    return [g for g in groups
            if sum(kind_of(n.op) in _PAYING_KINDS for n in g) >= min_ops
            and outputs_of(g, users, graph_outputs)]


def _groups(steps: Sequence[Step], ok: Callable[[Node], bool]) -> list[list[Node]]:
    groups: list[list[Node]] = []
    current: list[Node] = []
    for step in steps:
        if isinstance(step, Free):
            continue
        if isinstance(step, Run) and ok(step.node):
            current.append(step.node)
            continue
        if current:
            groups.append(current)
        current = []
    if current:
        groups.append(current)
    return groups


def outputs_of(group: Sequence[Node], users: dict[Node, list[Node]],
               graph_outputs: set[Node]) -> list[Node]:
    """The nodes of ``group`` read outside it, in order."""
    inside = set(group)
    return [n for n in group
            if n in graph_outputs or any(u not in inside for u in users[n])]


def inputs_of(group: Sequence[Node]) -> list[Node]:
    """The values ``group`` reads from outside, in order of first use."""
    inside = set(group)
    return list(dict.fromkeys(v for n in group for v in n.inputs if v not in inside))


def is_view(node: Node) -> bool:
    """Does ``node`` share a storage with another value? A view, or an element of a tuple of
    views (``split``, ``unbind``); an element of a tuple of fresh tensors is fresh itself."""
    if node.op is operator.getitem:
        node = node.args[0]
    return bool(node.aliases) or bool(getattr(node.op, "is_view", False))


def _misfits(group: list[Node], users: dict[Node, list[Node]],
             graph_outputs: set[Node]) -> list[Node]:
    """Nodes that must leave ``group``: escaping views and tuples, getitems of outside tuples."""
    inside = set(group)
    out: list[Node] = []
    for n in group:
        if n.op is operator.getitem and n.args[0] not in inside:
            out.append(n)
    for n in outputs_of(group, users, graph_outputs):
        if isinstance(n.meta, tuple) or is_view(n):
            out.append(n)
    return out


# -- building ---------------------------------------------------------------------------------
def build_gm(nodes: Sequence[Node], inputs: Sequence[Node], outputs: Sequence[Node],
             device: str) -> torch.fx.GraphModule:
    """An fx GraphModule computing ``outputs`` from ``inputs`` by ``nodes`` (ops with a
    ``device=`` argument get ``device``, as in :mod:`autopar.runtime.codegen`)."""
    torch_device = torch.device("cpu") if device.startswith("cpu") else torch.device(device)
    g = torch.fx.Graph()
    env: dict[Node, torch.fx.Node] = {v: g.placeholder(f"in{i}") for i, v in enumerate(inputs)}

    def arg(x: Any) -> Any:
        if isinstance(x, Node):
            return env[x]
        if isinstance(x, list):
            return [arg(v) for v in x]
        if isinstance(x, tuple):
            return tuple(arg(v) for v in x)
        if isinstance(x, dict):
            return {k: arg(v) for k, v in x.items()}
        return x

    for n in nodes:
        kwargs = dict(n.kwargs)
        if "device" in kwargs:
            kwargs["device"] = torch_device
        env[n] = g.call_function(n.op, arg(tuple(n.args)), arg(kwargs))
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule({}, g)


def fuse_program(device: str, steps: list[Step], ix: GraphIndex, graph_outputs: set[Node],
                 local: Callable[[Node], bool], device_of: dict[Node, str],
                 label: str = "") -> list[Any]:
    """``steps`` with each region worth compiling replaced by one :class:`Fused` step.

    Frees inside a region of values it made and keeps to itself go; the other Frees follow
    the Fused step.
    """
    handed = ix.passthrough
    found = regions(steps, lambda n: fusible(n, device, local, device_of, handed), ix.users,
                    graph_outputs)
    if not found:
        return list(steps)
    region_of = {n: i for i, g in enumerate(found) for n in g}
    fused: list[Fused] = []
    for i, g in enumerate(found):
        ins, outs = inputs_of(g), outputs_of(g, ix.users, graph_outputs)
        kinds = sorted({op_name(n.op) for n in g if kind_of(n.op) in _PAYING_KINDS})
        name = (f"fused region {label}{device}#{i} ({len(g)} ops: "
                f"{', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''})")
        kernel = FusedKernel(build_gm(g, ins, outs, device), device, name)
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

r"""CUDA-graph segments of a GPU program: which steps form one, what can't be captured, what a
replay must hand out as a fresh tensor. Facts about a plan's steps and ops that the runtime
obeys (:mod:`autopar.runtime.cudagraphs` captures them) and the prediction prices
(:mod:`autopar.passes.cudagraphs`, which also owns whether capturing pays, handed in here as
``pays``).

Rules
- A *segment* is a maximal run of a program's capturable Run steps and fused regions (Frees
  inside it go with it): it ends at every cross-device point (Send, Record, Wait) and at every
  op that can't be captured (:func:`why_not_capturable`). A tuple's ``getitem``\ s run right
  after the step that makes it (:func:`tuples_unpacked_at_once`), so that a getitem past a
  cross-device step takes neither the tuple nor its op out of a segment.
- What can't be captured is decided before trying (a failed capture can leave the CUDA RNG
  state unusable for the process): ops that draw random numbers (:func:`draws_random`:
  attention with ``dropout_p`` 0 draws none), ops that write into an input, ops that make no
  tensor or a host tensor, ops that sync with the host or have data-dependent output shapes,
  and ops reading a value from another memory pool (a host scalar would be baked in).
- A view read after a segment is made again after each replay, from its root (the first
  value of its chain of views that is none, or one the segment reads), which the segment
  hands out in its place (:func:`_views_made_again`; ``Segment.again``): views split no
  segment (GPT-2 small's step over 8 GPUs had ~160 segments a GPU, one every ~6 ops, when
  each such view ran after its segment and ended it). A tuple, or a view of a tuple's item,
  that would leave a segment runs after it, on the stream, and so does a ``getitem`` of a
  tuple made before it (a fixpoint, as for fusion regions).
- An output *escapes* (is cloned after each replay, the next replay overwriting its static
  buffer) where it is held past the call (a graph output, but one the caller consumes before
  its next call), read off the program (a later Send or Record), or the base of a later view
  that escapes so.
- An input needs no copy into a static buffer where it is at the same address every call:
  read in place (the executor's ``in_place``), a non-escaping output of an earlier chosen
  segment, an item of a collective (the executor keeps each collective's sums in the same
  buffers while it captures graphs: ``Executor.keep_sums``), or a view of any of them made
  on the stream (``Segment.read_in_place``).
- A view run outside the chosen segments whose chain starts at such a value (not an input) is
  the same tensor every call: made once (:func:`views_made_once`).
- :func:`chosen_segments` starts from every segment and drops those ``pays`` refuses until
  none is dropped (a segment left out makes its outputs copies in later ones).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.collective import take
from ..ir.graph import Node, TensorMeta, op_name
from ..ir.ops import always_a_view
from ..ir.regions import is_view
from ..ir.routing import GraphIndex, kind_of
from .steps import Free, Run

__all__ = ["Segment", "chosen_segments", "draws_random", "escaping", "launches", "segments",
           "step_ops", "tuples_unpacked_at_once", "views_made_once", "why_not_capturable"]

log = logging.getLogger("autopar.schedule")


def _is_region(step: Any) -> bool:
    """A fused region's step (:class:`autopar.runtime.fuse.Fused`: nodes, inputs, outputs)."""
    return getattr(step, "nodes", None) is not None and not isinstance(step, Run)


def _holds_ops(step: Any) -> bool:
    return isinstance(step, Run) or _is_region(step)


def step_ops(step: Any) -> tuple[Node, ...]:
    """The ops a Run step or a fused region runs (none for other steps)."""
    if _is_region(step):
        return step.nodes
    return (step.node,) if isinstance(step, Run) else ()


log = logging.getLogger("autopar.passes")

_SYNCING = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
            "aten::is_nonzero", "aten::equal", "aten::_assert_async", "aten::unique",
            "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::bincount",
            "aten::repeat_interleave", "aten::histc", "aten::_assert_scalar"}
_DATA_DEPENDENT = tuple(t for t in (getattr(torch.Tag, "dynamic_output_shape", None),
                                    getattr(torch.Tag, "data_dependent_output", None)) if t)


def segments(steps: Sequence[Any],
             capturable: Callable[[Any], bool] = lambda step: True) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of capturable Run and Fused steps (and Frees)
    holding an op: cross-device steps and ops that can't be captured end a segment."""
    out: list[tuple[int, int]] = []
    start: int | None = None
    for i, step in enumerate([*steps, None]):
        if isinstance(step, Free) or (_holds_ops(step) and capturable(step)):
            if start is None:
                start = i
            continue
        if start is not None:
            if any(_holds_ops(s) for s in steps[start:i]):
                out.append((start, i))
            start = None
    return out


def draws_random(node: Node) -> bool:
    """Whether the op draws random numbers: seeded (``nondeterministic_seeded``), unless its
    ``dropout_p`` is 0 (attention without dropout, as models run in eval mode or are
    configured: it draws none)."""
    op = node.op
    if not isinstance(op, torch._ops.OpOverload) or \
            torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args)
                                else arg.default_value)
            return not (isinstance(p, int | float) and p == 0)
    return True


def _why_not_node(node: Node, local: Callable[[Node], bool]) -> str | None:
    name = op_name(node.op)
    if node.op is operator.getitem:
        return None
    if draws_random(node):
        return f"{name} draws random numbers (a failed capture would spoil the CUDA RNG)"
    if node.writes:
        return f"{name} writes into its input (a graph would write into a static copy)"
    if not node.tensor_metas:
        return f"{name} makes no tensor"
    if any(m.device == "cpu" for m in node.tensor_metas) and "device" in node.kwargs \
            and str(node.kwargs["device"]).startswith("cpu"):
        return f"{name} makes a host tensor"
    op = node.op
    if isinstance(op, torch._ops.OpOverload):
        if op._schema.name in _SYNCING:
            return f"{name} syncs with the host"
        if any(t in op.tags for t in _DATA_DEPENDENT):
            return f"{name} has a data-dependent output shape"
    for v in node.inputs:
        if not local(v):
            return f"{name} reads {v!r} from another memory pool"
    return None


def why_not_capturable(steps: Sequence[Any], local: Callable[[Node], bool]) -> str | None:
    """Why a segment (its steps) can't be captured as a CUDA graph, or None."""
    for step in steps:
        for node in step_ops(step):
            why = _why_not_node(node, local)
            if why:
                return why
    return None


def launches(steps: Sequence[Any], moved: set[Node],
             region: dict[Node, int] | None = None) -> int:
    """Kernel launches a segment makes on streams: one per op (views and moves launch none),
    one per fused region: a Fused step, or the ops ``region`` maps to one region number (a
    plan's steps before fusion, as the prediction sees them)."""
    n = 0
    seen: set[int] = set()
    for step in steps:
        if _is_region(step):
            n += 1
        elif isinstance(step, Run) and step.node not in moved \
                and kind_of(step.node.op) not in ("view", "getitem"):
            k = region.get(step.node) if region else None
            n += k is None or k not in seen
            if k is not None:
                seen.add(k)
    return n


def escaping(seg_steps: Sequence[Any], outputs: Sequence[Node], at: dict[Node, int],
             end: int, ix: GraphIndex, graph_outputs: set[Node],
             transient: Callable[[Node], bool] = lambda v: False) -> set[Node]:
    """Outputs of the segment that must not stay in static buffers (module docstring): one
    held past the call (a graph output, but one the caller consumes before its next call,
    ``transient``), read off this program's later steps (a Send or Record), or the base of a
    later view that escapes so (a view read only by later steps of the program aliases the
    static buffer harmlessly). ``at``: the step index of each op of the program."""
    inside = {n for s in seg_steps for n in step_ops(s)}

    def leaves(v: Node) -> bool:
        if v in graph_outputs and not transient(v):
            return True
        for u in ix.users[v]:
            if u in inside:
                continue
            if at.get(u, -1) < end or (v in u.aliases and leaves(u)):
                return True
        return False
    return {v for v in outputs if leaves(v)}


def _made(step: Any) -> tuple[Node, ...]:
    """Values a Run step or a fused region stores in the program's slots."""
    if _is_region(step):
        return step.outputs
    return (step.node,) if isinstance(step, Run) else ()


def _boundary(seg: Sequence[Any], ix: GraphIndex,
              graph_outputs: set[Node]) -> tuple[list[Node], list[Node]]:
    """(inputs, outputs) of a segment: values it reads from outside, values read outside."""
    made = [v for s in seg for v in _made(s)]
    inside_values = set(made)
    ops = {n for s in seg for n in step_ops(s)}
    reads = [v for s in seg if _holds_ops(s)
             for v in (s.inputs if _is_region(s) else s.node.inputs)]
    inputs = list(dict.fromkeys(v for v in reads if v not in inside_values))
    # (a random op's ordering-only input, the previous draw, is no value it reads)
    outputs = [v for v in made
               if v in graph_outputs or any(u not in ops and v in u.inputs for u in ix.users[v])]
    return inputs, outputs


def _views_made_again(seg: Sequence[Any], outputs: list[Node]
                      ) -> tuple[list[Node], list[Node], dict[Node, Node]]:
    """(outputs, views made again, view -> its root) of a segment whose outputs include
    views: a view read after the segment, with every view between it and its root (the
    first value of the chain that is no view, or one the segment reads) made inside, is made
    again after each replay from the root, which the segment hands out in its place (a
    graph's static buffer, or its clone where a view escapes); an item of a tuple of views
    (``split``) is made again with its tuple."""
    made = {n for s in seg for n in step_ops(s)}
    kept: list[Node] = []
    again: dict[Node, None] = {}
    root_of: dict[Node, Node] = {}
    for v in outputs:
        chain, x = [], v
        while x in made and is_view(x):  # (an item of split's tuple: the split, then its base)
            if not x.args or not isinstance(x.args[0], Node):
                chain = []
                break
            chain.append(x)
            x = x.args[0]
        if not chain or (x in made and not isinstance(x.meta, TensorMeta)):
            kept.append(v)
            continue
        again.update(dict.fromkeys(chain))
        if x in made:
            root_of[v] = x
    for root in root_of.values():
        if root not in kept:
            kept.append(root)
    return [v for v in kept if v not in again], list(again), root_of


def _misfit(value: Node) -> bool:
    """A value no graph may hand out: a view (it would alias a static buffer) or something
    other than one tensor."""
    return not isinstance(value.meta, TensorMeta) or is_view(value)




@dataclass(frozen=True)
class Segment:
    """A segment chosen for capture: ``steps[start:end]`` of its program, the values it reads
    from outside (``inputs``), those read after it (``outputs``) and the outputs cloned after
    each replay (``escapes``)."""

    index: int
    start: int
    end: int
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    escapes: frozenset[Node]
    read_in_place: frozenset[int] = frozenset()  # indices of inputs at a fixed address
    copies: int = 0  # inputs copied into static buffers at each replay
    again: tuple[Node, ...] = ()  # views read after it, made again after each replay


def tuples_unpacked_at_once(steps: list[Any]) -> list[Any]:
    """``steps`` with each ``getitem`` Run moved up to just after the step that makes its
    tuple (in this program): a plan orders them by time, and a getitem that falls past a
    cross-device step would take its tuple out of a segment, and the op that makes it with
    it (a tuple can't be a graph's output). A getitem costs nothing and reads only its
    tuple, so running it earlier changes nothing else."""
    made_at: dict[Node, int] = {}
    after: dict[int, list[Any]] = {}
    moved: set[int] = set()
    for i, step in enumerate(steps):
        if isinstance(step, Run) and step.node.op is operator.getitem and \
                step.node.args and step.node.args[0] in made_at:
            after.setdefault(made_at[step.node.args[0]], []).append(step)
            moved.add(i)
            continue
        for n in step_ops(step):
            made_at[n] = i
    if not moved:
        return steps
    out: list[Any] = []
    for i, step in enumerate(steps):
        if i not in moved:
            out.append(step)
            out += after.get(i, ())
    return out


def chosen_segments(steps: list[Any], ix: GraphIndex, graph_outputs: set[Node],
                    local: Callable[[Node], bool], pays: Callable[[int, int, int], bool],
                    count: Callable[[Sequence[Any]], int], label: str = "",
                    transient: Callable[[Node], bool] = lambda v: False,
                    in_place: Callable[[Node], bool] = lambda v: False) -> list[Segment]:
    """The segments of a program worth capturing: ``pays(launches, copies, clones)``, with
    ``count(steps)`` the launches a segment makes on streams, and no copy for an input read
    ``in_place``, left in its static buffer by an earlier chosen segment, or a view of either
    (read where it lives: ``Segment.read_in_place``; see the module docstring). Those left
    out are logged at debug level."""
    return chosen_segments_each(steps, ix, graph_outputs, local, [pays], count, label,
                                transient, in_place)[0]


def chosen_segments_each(steps: list[Any], ix: GraphIndex, graph_outputs: set[Node],
                         local: Callable[[Node], bool],
                         rules: Sequence[Callable[[int, int, int], bool]],
                         count: Callable[[Sequence[Any]], int], label: str = "",
                         transient: Callable[[Node], bool] = lambda v: False,
                         in_place: Callable[[Node], bool] = lambda v: False
                         ) -> list[list[Segment]]:
    """:func:`chosen_segments` under each of ``rules``, the segments found once."""
    known: dict[int, bool] = {}  # id(step) -> capturable (asked again in each pass below)

    def capturable(step: Any) -> bool:
        got = known.get(id(step))
        if got is None:
            why = why_not_capturable([step], local)
            if why:
                log.debug("autopar: %s runs on streams, between graphs: %s", step, why)
            got = known[id(step)] = why is None
        return got

    left_out: set[Node] = set()

    def kept(step: Any) -> bool:
        return not (isinstance(step, Run) and step.node in left_out) and capturable(step)

    while True:  # tuples leaving a segment run after it, on the stream; views are made again
        found = []
        for start, end in segments(steps, kept):
            inputs, outputs = _boundary(steps[start:end], ix, graph_outputs)
            found.append((start, end, inputs, *_views_made_again(steps[start:end], outputs)))
        misfits = {v for *_, outs, _, _ in found for v in outs if _misfit(v)}
        misfits |= {n for _, _, ins, *_ in found for v in ins
                    if not isinstance(v.meta, TensorMeta) for n in ix.users[v]}
        if not misfits - left_out:
            break
        left_out |= misfits
    at = {n: i for i, step in enumerate(steps) for n in step_ops(step)}
    whole = []
    for k, (start, end, inputs, outputs, again, root_of) in enumerate(found):
        left = escaping(steps[start:end], [*outputs, *root_of], at, end, ix, graph_outputs,
                        transient)
        escapes = {root_of.get(v, v) for v in left} & set(outputs)
        whole.append((k, start, end, inputs, outputs, escapes, count(steps[start:end]),
                      tuple(sorted(again, key=at.__getitem__))))
    return [_paying(whole, pays, label, in_place) for pays in rules]


def _paying(whole: list[tuple], pays: Callable[[int, int, int], bool], label: str,
            in_place: Callable[[Node], bool]) -> list[Segment]:
    chosen = {k for k, *_ in whole}
    while True:  # from all of them: one left out makes its outputs copies in later ones
        statics = {v for k, _, _, _, outputs, escapes, *_ in whole if k in chosen
                   for v in outputs if v not in escapes}

        def fixed(v: Node, statics: set[Node] = statics) -> bool:
            """At the same address every call: read in place, a static output, or a view
            of one made on the stream (a view op's first argument is its base)."""
            return _fixed_root(v, lambda r: in_place(r) or r in statics, is_view)

        out: list[Segment] = []
        before = len(chosen)
        for k, start, end, inputs, outputs, escapes, n_launch, again in whole:
            if k not in chosen:
                continue
            at_home = frozenset(i for i, v in enumerate(inputs) if v not in statics and fixed(v))
            copies = sum(1 for i, v in enumerate(inputs) if v not in statics and i not in at_home)
            if not pays(n_launch, copies, len(escapes)):
                log.debug("autopar: segment %s#%d not captured: %d launches don't pay for %d "
                          "copies and %d clones", label, k, n_launch, copies, len(escapes))
                chosen.discard(k)
                continue
            out.append(Segment(k, start, end, tuple(inputs), tuple(outputs),
                               frozenset(escapes), at_home, copies, again))
        if len(chosen) == before:
            return out


def _fixed_root(v: Node, fixed: Callable[[Node], bool], view: Callable[[Node], bool]) -> bool:
    """Does ``v``'s chain of views (each ``view(v)``'s first argument its base) reach a value
    that is ``fixed``, or a collective's item (see the module docstring)?"""
    while True:
        if v.op is take or fixed(v):
            return True
        base = v.args[0] if view(v) and v.args else None
        if not isinstance(base, Node):
            return False
        v = base


def views_made_once(steps: Sequence[Any], chosen: Sequence[Segment]) -> frozenset[Node]:
    """The views a program runs outside its ``chosen`` segments (between them, or made again
    after one: ``Segment.again``) that are the same tensor at every call: ops that are always
    views (:func:`~autopar.ir.ops.always_a_view`) along a chain from a non-escaping output of
    a chosen segment (its static buffer) or a collective's item (kept sums). The runtime
    makes each at the first call and hands the same tensor out after, as long as its base is
    the tensor it was made of (an identity check: ~0.05 us on the 2-core VM, against 0.4 us
    for a ``detach``; GPT-2's step over 8 GPUs re-made ~430 gradient views a GPU each call).
    Never from a graph input: a caller can give the same tensor object new storage
    (``p.data = ...``)."""
    statics = {v for seg in chosen for v in seg.outputs if v not in seg.escapes}
    inside = {n for seg in chosen for step in steps[seg.start:seg.end] for n in step_ops(step)}
    again = {v for seg in chosen for v in seg.again}

    def view(v: Node) -> bool:
        return always_a_view(v.op)

    return frozenset(
        step.node for step in steps
        if isinstance(step, Run) and (step.node not in inside or step.node in again)
        and view(step.node) and _fixed_root(step.node, statics.__contains__, view))

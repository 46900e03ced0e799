"""Turn one device's program (a list of plan steps) into straight-line Python, once.

Policy
- Each program becomes one Python function ``program(env, rt)``: a Run step is one line that
  calls the ATen op on values read from ``env`` (a per-call list of slots); Send, Record, Wait and
  Free steps are calls into the runtime's transfer helpers ``rt``. Nothing is interpreted per
  node at call time.
- A *slot* holds one value on one device: ``(node, device)``. A Send fills the destination's slot.
- Ops with a ``device=`` argument (factories, ``_to_copy``) get the device they were placed on.
- A ``_to_copy`` that only moves a value to the device it was placed on, whose input arrived
  there by a Send, is the Send itself: no second copy (as :mod:`autopar.schedule.place` assumes).
  One placed in its input's pool that may hand the input on (:attr:`GraphIndex.passthrough`) is
  that input: no copy at all.
- A :class:`~autopar.runtime.fuse.Fused` step (a region Inductor compiled) is one line that
  calls its kernel on the region's inputs and stores its outputs; a :class:`Call` step (a
  segment replayed as a CUDA graph) is one line that calls its object with ``env`` and ``rt``.
- The generated source is registered with ``linecache`` under a fake file name, so tracebacks
  show it and a failing line maps back to its step (:meth:`Program.step_at`).
- An op is called through torch's Python binding for it (``torch.<name>`` or the
  ``Tensor.<name>`` method) where that provably runs the very op: called on meta tensors
  shaped like the node's inputs, under a dispatch mode that records it, the binding dispatched
  exactly ``node.op`` with exactly those arguments and returned what the op returns (checked
  once per op and argument types). Else through the op's C++ entry (``OpOverload._op``, what
  ``OpOverload.__call__`` calls). On the 2-core VM a binding is 0.3-0.8 us faster than the
  entry (``permute`` 1.45 -> 0.76 us, ``sum.dim_IntList`` 2.20 -> 1.43), the entry 0.26 us
  faster than the OpOverload (a ``slice`` 1.75 -> 1.49).
- In a whole-call program (``entry``) of plain ops, a chain of two or more ``slice`` views
  from a graph input (``A[r0:r1, c0:c1]``) is one ``as_strided`` view of the input, at its
  storage offset plus the chain's, called through ``Tensor.as_strided`` (1.16 us against 3.5
  for two slices; the op's C++ entry parses the int lists at 2.7 us); a slice of the chain
  that something else reads is kept. Sound where the input has the strides of its metadata,
  which the graph's callers guarantee (dynamo's guards, :mod:`autopar.capture.direct`'s
  checks).
"""

from __future__ import annotations

import itertools
import linecache
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._python_dispatch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

from ..ir.collective import COMM, is_collective
from ..ir.graph import Node, TensorMeta, op_name
from ..ir.ops import PLAIN_VALUES
from ..ir.routing import compute_lane, pool
from ..schedule.steps import Free, Record, Run, Send, Step, Wait
from .fuse import Fused

_counter = itertools.count()


@dataclass
class Program:
    device: str
    fn: Callable[[list, Any], None]
    source: str
    filename: str
    steps_by_line: dict[int, Step]
    call_lines: Inline | None = None  # a whole call's lines, for a caller's generated function

    def step_at(self, lineno: int) -> Step | None:
        return self.steps_by_line.get(lineno)


@dataclass(frozen=True)
class Inline:
    """A whole call of ops alone as lines that another generated function takes in: it binds
    the locals ``inputs`` to the call's arguments, runs ``body`` (each line unindented), and
    the outputs are ``outputs`` (a list's expression); the lines read ``globals``. They report
    no failure and open no profiler range: the function calls ``program(args)`` for that
    (:mod:`autopar.capture.direct`'s entries run the program again where the lines fail)."""

    inputs: tuple[str, ...]
    body: tuple[str, ...]
    outputs: str
    globals: dict[str, Any]


@dataclass(frozen=True, eq=False)
class Call:
    """A step that calls ``fn(env, rt)``: a captured segment
    (:mod:`autopar.runtime.cudagraphs`); ``node`` is where its errors are reported."""

    fn: Callable[[list, Any], None]
    label: str
    node: Node

    def __str__(self) -> str:
        return f"call   {self.label}"


class SlotTable:
    """Numbers every (node, memory space) value of a plan.

    CPU workers share host memory, so ``cpu:0`` and ``cpu:1`` name one slot for each value.
    """

    def __init__(self) -> None:
        self.index: dict[tuple[int, str], int] = {}

    def __call__(self, node: Node, device: str) -> int:
        key = (node.id, pool(device))
        if key not in self.index:
            self.index[key] = len(self.index)
        return self.index[key]

    def __len__(self) -> int:
        return len(self.index)


class _Emitter:
    def __init__(self, device: str, slots: SlotTable,
                 source_of: Callable[[Node, str], str]) -> None:
        self.device = device
        self.slots = slots
        self.source_of = source_of
        self.globals: dict[str, Any] = {"torch": torch}
        self.lines: list[str] = []
        self.steps_by_line: dict[int, Step] = {}
        self._consts: dict[int, str] = {}
        self.local = False  # slots as the function's locals (a whole call's program)

    def at(self, slot: int) -> str:
        """The expression of a slot: ``env[i]``, or the local ``v<i>``."""
        return f"v{slot}" if self.local else f"env[{slot}]"

    def const(self, value: Any) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            return f"float({str(value)!r})"  # repr(inf) is not Python source
        if isinstance(value, PLAIN_VALUES):
            return repr(value)
        name = self._consts.get(id(value))
        if name is None:
            name = f"c{len(self._consts)}"
            self._consts[id(value)] = name
            self.globals[name] = value
        return name

    def expr(self, x: Any) -> str:
        if isinstance(x, Node):
            return self.at(self.slots(x, self.source_of(x, self.device)))
        if isinstance(x, list):
            return "[" + ", ".join(self.expr(v) for v in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(self.expr(v) + ", " for v in x) + ")"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {self.expr(v)}" for k, v in x.items()) + "}"
        return self.const(x)

    def emit(self, line: str, step: Step | None = None) -> None:
        self.lines.append("    " + line)
        if step is not None:
            self.steps_by_line[len(self.lines) + 1] = step  # +1: the def line

    def timed(self, line: str, step: Step, timing: tuple[str, str, str, int] | bool) -> None:
        """``line``, between ``rt.begin`` and ``rt.end`` when ``timing`` is
        ``(device, lane, name, node id)`` (a traced program)."""
        if not timing:
            self.emit(line, step)
            return
        device, lane, name, node_id = timing
        self.emit(f"mark = rt.begin({device!r})")
        self.emit(line, step)
        self.emit(f"rt.end(mark, {lane!r}, {name!r}, {node_id})")


def build_program(device: str, steps: list[Step | Fused | Call], slots: SlotTable,
                  source_of: Callable[[Node, str], str], free_moves: set[Node],
                  traced: bool = False, eager_devices: bool = False,
                  entry: tuple[list[int], list[tuple[str, Any]]] | None = None,
                  step_devices: list[str] | None = None,
                  failed: Callable[[list, BaseException], Any] | None = None,
                  profiled: Callable[[list], Any] | None = None,
                  once: frozenset[tuple[Node, str]] = frozenset()) -> Program:
    """Compile ``steps`` of ``device`` into a Python function ``program(env, rt)``.

    ``source_of(value, device)``: the device whose slot a reader on ``device`` takes ``value``
    from (its own, after a copy; the producer's, for values shared without a copy).
    ``free_moves``: pure-move ``_to_copy`` nodes that are no op of their own: their Send did the
    work, or they hand on their input (:func:`autopar.ir.routing.is_free_move`). ``traced``: also
    time every op (``rt.begin`` / ``rt.end``: host clock on CPU workers, CUDA events on GPUs),
    for measured Timelines. ``eager_devices``: keep every op's own ``device=`` argument (the
    sequential runner: ops run where eager runs them).
    ``entry=(input_slots, outputs)``: a whole call instead, ``program(args) -> outputs``
    (``outputs`` as :class:`~autopar.runtime.executor.Executor` lists them), for a plan of one
    program with nothing to order. ``step_devices``: the device of each step, when the
    program runs the steps of several devices on one thread (see
    :mod:`autopar.runtime.interleave`); ``device`` then names the program.
    A whole call may also take ``failed(args, error)``: what an error of its steps becomes
    (raised again, annotated, or another way's result), inside the program, so that a caller
    can call ``program(args)`` itself; and ``profiled(args)``: the call under
    ``torch.profiler`` (its ranges around ``program(args, True)``).
    ``once``: (view, device) pairs whose view is the same tensor every call
    (:func:`~autopar.schedule.segments.views_made_once`): made at the first call and kept in a
    cell of the program with the base it was made of; a later call whose base is that very
    tensor takes the kept view (one tuple per cell, replaced whole: calls from several threads
    never pair a view with another base); a base that keeps changing ends the keeping
    (``_kept``).
    """
    em = _Emitter(device, slots, source_of)
    chains = _slice_chains(steps, entry, slots, source_of, device) if entry is not None else {}
    distinct = entry is not None and len(set(entry[0])) == len(entry[0])  # no input twice
    if entry is not None:
        # a whole call of ops alone keeps its values in locals (no list; 0.3 us a call
        # of one op less on the 2-core VM); a segment's call reads the list
        em.local = all(isinstance(s, Run | Free | Fused) for s in steps)
        if not em.local:
            em.emit("env = [None] * n_slots")
            em.lines += [f"    env[{slot}] = args[{i}]" for i, slot in enumerate(entry[0])]
        elif entry[0] and distinct:
            em.emit("".join(f"v{slot}, " for slot in entry[0]) + "= args")
        else:
            em.lines += [f"    v{slot} = args[{i}]" for i, slot in enumerate(entry[0])]
    program_device = device
    for i, step in enumerate(steps):
        device = em.device = step_devices[i] if step_devices is not None else program_device
        lane = compute_lane(device)
        if isinstance(step, Run):
            node = step.node
            out = em.at(slots(node, device))
            if device == COMM and is_collective(node.op):  # on the GPUs' comm streams
                parts = ", ".join(em.expr(a) for a in node.args)
                em.timed(f"{out} = rt.all_reduce([{parts}], {node.id})  # {op_name(node.op)}",
                         step, traced and (device, lane, op_name(node.op), node.id))
                continue
            if node in free_moves:
                em.emit(f"{out} = {em.expr(node.args[0])}  # {op_name(node.op)}: "
                        "a free move", step)
                continue
            if node in chains:
                root, delta = chains[node]
                if root is not None:  # the chain's end: one view of the input
                    base = em.expr(root)
                    em.emit(f"{out} = {em.const(_AS_STRIDED)}({base}, "
                            f"{node.meta.shape!r}, {node.meta.stride!r}, "
                            f"{base}.storage_offset() + {delta})  # slices as one view", step)
                continue  # (inside the chain: nothing reads it but the chain)
            kwargs = dict(node.kwargs)
            if "device" in kwargs and not eager_devices:
                kwargs["device"] = torch.device("cpu") if device.startswith("cpu") else \
                    torch.device(device)
            op = em.const(fast_call(node))
            args = ", ".join([em.expr(a) for a in node.args]
                             + [f"{k}={em.expr(v)}" for k, v in kwargs.items()])
            note = f"  # {op_name(node.op)}" + (f" {node.source}" if node.source else "")
            call = f"{op}({args})"
            if (node, device) in once and not traced:
                cell, base = em.const([None, 0]), em.expr(node.args[0])
                call = (f"_m[1] if (_m := {cell}[0]) is not None and _m[0] is {base} "
                        f"else {em.const(_kept)}({cell}, {base}, {call})")
                note += " (made once)"
            em.timed(f"{out} = {call}{note}", step, traced and (
                device, lane, op_name(node.op), node.id))
        elif isinstance(step, Fused):
            ins = ", ".join(em.expr(v) for v in step.inputs)
            outs = "".join(f"{em.at(slots(n, device))}, " for n in step.outputs)
            em.timed(f"{outs}= {em.const(step.kernel)}([{ins}])  # {step.kernel.label}", step,
                     traced and (device, lane, step.kernel.label, step.node.id))
        elif isinstance(step, Call):
            em.emit(f"{em.const(step.fn)}(env, rt)  # {step.label}", step)
        elif isinstance(step, Send):
            src = slots(step.value, step.src)
            dst = slots(step.value, step.dst)
            em.emit(f"env[{dst}] = rt.send(env[{src}], {step.src!r}, {step.dst!r}, "
                    f"{step.event}, {step.value.id})  # {step.value!r} {step.src}->{step.dst}",
                    step)
        elif isinstance(step, Record) and device == COMM:  # each item's event on its GPU
            em.emit(f"rt.record_items({step.event}, {em.at(slots(step.value, device))})"
                    f"  # {step.value!r} ready", step)
        elif isinstance(step, Record):
            em.emit(f"rt.record({step.event})  # {step.value!r} ready", step)
        elif isinstance(step, Wait):
            slot = slots(step.value, source_of(step.value, device))
            em.emit(f"rt.wait({step.event}, env, {slot}, {device!r})  # {step.value!r} "
                    f"from {step.src}", step)
        elif isinstance(step, Free):
            em.emit(f"{em.at(slots(step.value, device))} = None", step)
        else:  # pragma: no cover - plan and codegen share the step types
            raise TypeError(f"unknown plan step {step!r}")
    header = "def program(env, rt):\n"
    inline = None
    if entry is not None:
        outs = [em.at(v) if kind == "slot" else em.const(v) for kind, v in entry[1]]
        if em.local and distinct:
            first = 1 if entry[0] else 0  # (the line that unpacks args)
            inline = Inline(tuple(f"v{slot}" for slot in entry[0]),
                            tuple(line[4:] for line in em.lines[first:]),
                            f"[{', '.join(outs)}]", dict(em.globals))
        em.emit(f"return [{', '.join(outs)}]")
        em.globals["n_slots"] = len(slots)
        header = "def program(args, rt=None):\n"
        if failed is not None:  # (a try costs nothing until it catches)
            em.lines = ["    try:", *("    " + line for line in em.lines),
                        "    except BaseException as e:", "        return _failed(args, e)"]
            em.steps_by_line = {k + 1: v for k, v in em.steps_by_line.items()}
            em.globals["_failed"] = failed
        if profiled is not None:  # rt: the profiler's ranges are open
            em.lines.insert(0, "    if _profiler._is_profiler_enabled and rt is None:\n"
                               "        return _profiled(args)")
            em.steps_by_line = {k + 2: v for k, v in em.steps_by_line.items()}
            em.globals.update(_profiler=torch.autograd.profiler, _profiled=profiled)
    if not em.lines:
        em.lines.append("    pass")
    filename = f"<autopar program {program_device} #{next(_counter)}>"
    source = header + "\n".join(em.lines) + "\n"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(em.globals)
    exec(compile(source, filename, "exec"), namespace)
    return Program(program_device, namespace["program"], source, filename, em.steps_by_line,
                   inline)


_INERT = (object(), None)  # a cell that gave up: no base is this object
_MISSES = 2


def _kept(cell: list, base: Any, view: Any) -> Any:
    """A view made once: kept in ``cell`` (``[(base, view), misses]``) with its base (see
    ``build_program``'s ``once``). A base that keeps changing (its segment back on streams
    hands out new tensors) is a miss each call: after ``_MISSES`` misses past the first
    (the capture's call makes the static buffers) the cell keeps nothing, so that no call's
    tensor outlives its call."""
    if cell[0] is _INERT:
        return view
    if cell[0] is not None:
        cell[1] += 1
        if cell[1] > _MISSES:
            cell[0] = _INERT
            return view
    cell[0] = (base, view)
    return view


_SLICE = torch.ops.aten.slice.Tensor
_AS_STRIDED = torch.Tensor.as_strided  # the Python binding: 1.16 us, the op's C++ entry 2.7


_FAST: dict[tuple, Any] = {}  # (op, argument types) -> the callable fast_call chose


def fast_call(node: Node) -> Any:
    """The fastest callable that runs exactly ``node.op`` on ``node``'s arguments (see the
    module docstring): a Python binding that passed the check, else the op's C++ entry."""
    op = node.op
    if type(op) is not torch._ops.OpOverload:
        return op
    key = (op, _kind(node.args), *((k, _kind(v)) for k, v in node.kwargs.items()))
    got = _FAST.get(key)
    if got is None:
        with unset_fake_temporarily():  # (a backend compiles inside dynamo's fake mode)
            got = _FAST[key] = _binding(node) or op._op
    return got


def _kind(x: Any) -> Any:
    """What a binding's overload choice may depend on: a graph tensor, another graph value,
    a constant's type, lists and tuples item by item."""
    if isinstance(x, Node):
        return "tensor" if isinstance(x.meta, TensorMeta) else "value"
    if isinstance(x, list | tuple):
        return (type(x).__name__, *map(_kind, x))
    return type(x).__name__


class _Record(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _binding(node: Node) -> Any:
    """torch's Python function or Tensor method for ``node.op`` where calling it on meta
    tensors like the node's inputs dispatches ``node.op`` alone with the same arguments and
    returns the same type; else None. Ops given a device, ops of no graph value (factories:
    a binding would obey a ``torch.device`` context of the caller's, a function mode), and
    ops given a tensor that is not a graph value are left to their entry."""
    op = node.op
    leaves = tree_flatten((node.args, node.kwargs))[0]
    if "device" in node.kwargs or any(isinstance(v, torch.Tensor) for v in leaves) or \
            not any(isinstance(v, Node) for v in leaves):
        return None
    try:
        args = tree_map_only(Node, _meta, list(node.args))
        kwargs = tree_map_only(Node, _meta, dict(node.kwargs))
        want = op(*args, **kwargs)
    except Exception:  # a value the meta device can't stand for: the entry it is
        return None
    name = op._schema.name.split("::")[-1]
    for fn in (getattr(torch._C._VariableFunctions, name, None),
               getattr(torch.Tensor, name, None)):
        if fn is None:
            continue
        record = _Record()
        try:
            with record:
                got = fn(*args, **kwargs)
        except Exception:  # this binding does not take these arguments
            continue
        if len(record.calls) == 1 and record.calls[0][0] is op and type(got) is type(want) \
                and _same(record.calls[0][1], tuple(args)) and _same(record.calls[0][2], kwargs):
            return fn
    return None


def _meta(x: Node) -> torch.Tensor:
    """A meta tensor like the value ``x`` (raises for a value that is not a tensor)."""
    m = x.meta
    if not isinstance(m, TensorMeta):
        raise TypeError(f"{x!r} is not a tensor")
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def _same(a: Any, b: Any) -> bool:
    """The same arguments: tensors by identity, lists and tuples item by item (either kind),
    other values equal and of one type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _slice_chains(steps: list, entry: tuple[list[int], list], slots: SlotTable,
                  source_of: Callable[[Node, str], str], device: str
                  ) -> dict[Node, tuple[Node | None, int]]:
    """The slices of a whole-call program that collapse into one view: the end of a chain of
    two or more from a graph input -> (that input, the chain's storage offset), a slice
    inside one -> (None, 0). Only slices whose dim and bounds are Python ints (a bound read
    from a tensor is a value of the graph). Empty where a step reads values the code can't
    see (a CUDA-graph segment, a copy between devices)."""
    if any(not isinstance(s, Run | Free | Fused) for s in steps):
        return {}
    inputs = set(entry[0])
    outputs = {v for kind, v in entry[1] if kind == "slot"}
    readers: dict[Node, list[Node | None]] = {}  # value -> the Run nodes reading it (None: other)
    for s in steps:
        if isinstance(s, Run):
            for x in s.node.inputs:
                readers.setdefault(x, []).append(s.node)
        elif isinstance(s, Fused):
            for x in s.inputs:
                readers.setdefault(x, []).append(None)
    slices = {s.node for s in steps if isinstance(s, Run) and s.node.op is _SLICE and all(
        a is None or type(a) is int for a in [*s.node.args[1:], *s.node.kwargs.values()])}

    def offset(node: Node) -> int:
        """The storage offset ``node``'s slice adds to its input's."""
        x, args, kw = node.args[0], node.args, node.kwargs
        dim = args[1] if len(args) > 1 else kw.get("dim", 0)
        start = args[2] if len(args) > 2 else kw.get("start")
        size = x.meta.shape[dim]
        start = 0 if start is None else start + size if start < 0 else start
        return min(max(start, 0), size) * x.meta.stride[dim]

    rooted: dict[Node, tuple[Node, int, int]] = {}  # slice -> (graph input, offset, length)
    for s in steps:  # in program order: a slice's input is rooted before it
        node = s.node if isinstance(s, Run) else None
        if node not in slices:
            continue
        x = node.args[0]
        if x in rooted:
            root, delta, n = rooted[x]
            rooted[node] = (root, delta + offset(node), n + 1)
        elif isinstance(x, Node) and x not in slices and \
                slots(x, source_of(x, device)) in inputs:
            rooted[node] = (x, offset(node), 1)
    chains: dict[Node, tuple[Node | None, int]] = {}
    for node, (root, delta, n) in rooted.items():
        reads = readers.get(node, [])
        if reads and all(r in slices for r in reads) and \
                slots(node, source_of(node, device)) not in outputs:
            chains[node] = (None, 0)  # only slices read it: each is one view of the input
        elif n >= 2:
            chains[node] = (root, delta)
    return chains

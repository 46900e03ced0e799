"""``guards="arguments"``: a learned signature's call goes straight into its graph, past dynamo.

Every call of ``torch.compile``'s result enters dynamo's frame: its Python wrapper, the guards,
the bytecode before and after the graph. That costs several times a small op's own time,
whatever the guards: dropping every guard (``guard_filter_fn``), skipping the modules' guards
(``skip_guard_on_all_nn_modules_unsafe``) or their evaluation (``torch.compiler.set_stance``
with ``skip_guard_eval_unsafe=True``, whose context manager costs more than the guards it
skips) saves ~1 us at most; the rest is the frame. So PyTorch's mechanisms are not used here:
:class:`Direct` keeps, per argument signature, the one graph dynamo called and calls it itself,
for less than half of dynamo's cost a call on a one-op function: ~0.9 us of checks for two
tensors, ~0.5 us of dispatch, and the graph's runner (measured: ``benchmarks/call_floor.py``,
benchmarks/NOTES.md).

The contract (opt-in, ``autopar.compile(fn, guards="arguments")``): the function's result
depends only on its arguments, and the modules and globals it reads do not change between calls
(but as checked below). Under it a call whose arguments match a learned entry runs the entry's
graph with no dynamo at all.

Policy
- Learning: a call no entry matches goes through dynamo (every guard: always sound), and is
  watched: the backend reports each graph call it serves (:func:`make_backend`'s ``learn``).
  An entry is kept only where that call was exactly one graph, an inference graph dynamo
  calls without aot_autograd's wrapper (autopar's light one: inputs whose data the graph
  updates are copied back, inputs returned as outputs; W1's ``B[:] = A[r0:r1, c0:c1]``), every
  graph input is identified by identity (an argument, a parameter or buffer of the module, a
  tensor global or closure variable of the code; one the graph writes into only an
  argument: a written buffer's ``_version`` would miss every later call), and the result is
  built of the graph's outputs alone (the graph's result itself, or a tuple or list of its
  outputs, each used). Arguments are positional only, each a tensor (not one autograd
  records) or a plain value (``int``, ``float``, ``bool``, ``str``, ``None``), no tensor
  passed twice. Anything else keeps going through dynamo.
- An entry matches a call with as many arguments, each tensor of the learned shape, strides,
  dtype, device, ``requires_grad`` and dispatch keys (checked at once by dynamo's own C++
  tensor check, ``TensorGuards``: 0.17 us for two tensors on the 2-core VM, against 0.75 for
  the attributes compared in Python), each plain value equal (and of
  the same type), torch's global state as learned (dynamo's own ``GlobalStateGuard``: grad
  mode, autocast, default dtype, deterministic algorithms, TF32 and reduced-precision flags,
  thread count; 0.17 us on the VM, as much as grad mode and autocast alone cost), no
  autocast, a module's ``training`` as learned; and its
  cheap checks hold: every parameter and buffer the graph reads has the ``_version`` it had
  (an optimizer's in-place step changes it) and the layout it had (in the same C++ check as
  the arguments, about 0.08 us a tensor: ``module.double()``, ``.to(...)`` and
  ``requires_grad_`` keep the parameter objects but change these), every global or closure
  tensor is still the object bound to its name. A check that fails sends the call through
  dynamo, which re-guards it (and recaptures what changed) and the entry is learned again.
- Entries: at most ``MAX_ENTRIES``, the latest learned or used first (the head); each is one
  generated function; the head's miss tries the others in order (:meth:`Direct._walk`).
- Traced by running (a plain function, not a module's forward, whose scalars dynamo failed to
  capture: torch 2.11 on CUDA fails on W1's slice bounds made inside with
  ``PendingUnbackedSymbolNotFound`` and traces with graph breaks, a device sync per bound):
  a call no entry matches is traced with ``make_fx``'s real tracing on copies of its tensor
  arguments (the function runs once on the copies, its ``.item()`` reads give real numbers,
  so the bounds of values made inside fold into the graph), and the entry is that graph,
  which then runs the call itself on the real arguments. Sound by make_fx's own rule: a value
  read from a tensor that depends on an argument stops the trace (``.item()`` of a tracing
  tensor), and so does a graph that reads any tensor other than its arguments (a parameter, a
  global) after dead code is gone. Where the trace stops, the call goes through dynamo, and
  the function is not traced by running again.

What breaks the contract, undetected: Python side effects of the function (appending to a list,
counting calls in a global: dynamo replays them, an entry does not); a module's attribute,
hook or submodule changed, a parameter replaced by another object (``module.weight =
nn.Parameter(...)``); non-tensor globals changed (a flag, a Python number the code reads);
a ``TorchFunctionMode`` entered around the call; a submodule's ``training`` changed alone.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._C._dynamo.guards import GlobalStateGuard, TensorGuards

from ..ir.locks import tracing
from ..ir.ops import PLAIN_VALUES
from .dynamo import LightWrapper, any_autocast_enabled
from .fx import kept_unused

__all__ = ["MAX_ENTRIES", "Direct", "layout_check", "positional_entry"]

log = logging.getLogger("autopar.capture")

MAX_ENTRIES = 16
"""Signatures a :class:`Direct` keeps entries for (the latest first)."""

_MISS = object()
_counter = itertools.count()


def _missed(*args: Any, **kwargs: Any) -> Any:
    return _MISS  # the miss of an entry tried alone (traced by running, checked once)


class Direct:
    """``compiled`` (dynamo's way) with calls of learned signatures served past dynamo (see the
    module docstring). ``module``: the ``nn.Module`` whose forward ``compiled`` is, else None;
    ``code``: the function whose globals and closure the graph may read."""

    def __init__(self, code: Callable, module: torch.nn.Module | None = None) -> None:
        self.compiled: Callable | None = None  # set once the backend is built
        self.code = code
        self.module = module
        self.entries: list[Callable] = []  # generated, the latest first
        self.learned = 0  # entries made
        self._watch: list | None = None  # the graph calls of the call being learned
        self.by_running = False  # trace calls by running them (dynamo failed on the scalars)
        self.refused: str | None = None  # why tracing by running stopped, once it did
        #: what a call runs: the entry that served the latest call no other served before
        #: it, whose miss calls :meth:`_walk` (one frame a matched call: no loop in between)
        self.head: Callable = self._slow

    def describe(self) -> str:
        """The learned entries, in the order a call tries them (for ``explain``): a call of
        another signature than the first pays each earlier entry's checks."""
        def one(sig: tuple) -> str:
            shapes = ", ".join(str(tuple(x[0])) for x in sig[3:]
                               if isinstance(x, tuple) and isinstance(x[0], torch.Size))
            return f"({shapes}) grad {'on' if sig[0] else 'off'}"
        entries = "; ".join(one(e.signature) for e in self.entries)
        return f"{len(self.entries)} signature(s) served past dynamo, tried in order: {entries}"

    def scalars_failed(self) -> None:
        """dynamo could not trace the function with its scalars captured: trace by running."""
        if self.module is None and self.refused is None:
            self.by_running = True

    def record(self, program: Callable, args: tuple, out: Sequence[Any]) -> None:
        """The backend's report of one graph call (``program(*args) -> out``)."""
        if self._watch is not None:
            self._watch.append((program, args, out))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.head(*args, **kwargs)

    def _slow(self, *args: Any, **kwargs: Any) -> Any:
        """A call no entry matched: traced by running, else through dynamo (and learned)."""
        if not kwargs and self.by_running:
            entry = self._traced(args)
            if entry is not None:
                entry.__globals__["_next"] = _missed
                out = entry(*args)
                if out is not _MISS:  # (it matches the arguments it was made from)
                    self._add(entry)
                    return out
        watch: list = []
        self._watch = watch
        try:
            out = self.compiled(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._watch = None
        if not kwargs and not self.by_running:
            entry = self._learn(args, watch, out)
            if entry is not None:
                self._add(entry)
        return out

    def _add(self, entry: Callable) -> None:
        sig = entry.signature
        self.learned += 1
        self._first([entry, *(e for e in self.entries if e.signature != sig)])

    def _first(self, entries: list[Callable]) -> None:
        """``entries`` in the order calls try them: the head's miss walks the rest."""
        self.entries = entries[:MAX_ENTRIES]
        for e in self.entries[1:]:
            e.__globals__["_next"] = _missed
        self.entries[0].__globals__["_next"] = self._walk
        self.head = self.entries[0]

    def _walk(self, *args: Any, **kwargs: Any) -> Any:
        """The head's miss: the other entries in order, the one that serves the call put
        first (a signature called once, say under ``no_grad``, must not stay ahead of the one
        every other call has: each of those would pay its checks and this walk), else
        :meth:`_slow`."""
        for i, e in enumerate(self.entries[1:], 1):
            out = e(*args, **kwargs)
            if out is not _MISS:
                self._first([e, *self.entries[:i], *self.entries[i + 1:]])
                return out
        return self._slow(*args, **kwargs)

    # -- tracing by running --------------------------------------------------------------------
    def _traced(self, args: tuple) -> Callable | None:
        """An entry for ``args``' signature from ``make_fx``'s real trace of the function on
        copies of them (see the module docstring), or None (``by_running`` then stops)."""
        if any_autocast_enabled():
            return None
        grad = torch.is_grad_enabled()
        why = None
        if _tensor_positions(args, grad) is None:
            why = "its arguments are not distinct tensors autograd ignores and plain values"
        else:
            from torch.fx.experimental.proxy_tensor import make_fx  # heavy: on first use

            copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            try:
                with tracing():  # FX patches the process while it traces: one tracer at a time
                    gm = make_fx(self.code, tracing_mode="real")(*copies)
            except Exception as e:  # a data-dependent read, or an op the tracer lacks
                why = f"the trace stopped: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            else:
                gm.graph.eliminate_dead_code(is_impure_node=kept_unused)
                outside = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
                if outside:
                    why = f"it reads {len(outside)} tensor(s) besides its arguments"
        if why is not None:
            self.by_running, self.refused = False, why
            log.info("autopar: %s is not traced by running (%s); its calls go through dynamo",
                     getattr(self.code, "__name__", "the function"), why)
            return None
        gm.recompile()  # (positional arguments: plain code, the result built as returned)
        code = _Code(grad, len(args))
        for i, a in enumerate(args):
            code.argument(i, a)
        log.info("autopar: %s traced by running it (dynamo could not capture its scalars): "
                 "%d ops", getattr(self.code, "__name__", "the function"),
                 sum(n.op == "call_function" for n in gm.graph.nodes))
        return code.build(gm.forward, [f"a{i}" for i in range(len(args))], "out")

    # -- learning ------------------------------------------------------------------------------
    def _learn(self, args: tuple, watch: list, result: Any) -> Callable | None:
        if len(watch) != 1:
            return None  # no graph, or a graph break: dynamo runs Python between graphs
        program, inputs, outputs = watch[0]
        grad = torch.is_grad_enabled()
        if any_autocast_enabled():
            return None
        at = _tensor_positions(args, grad)
        if at is None:
            return None
        fixed = self._fixed()
        feeds: list[str] = []
        code = _Code(grad, len(args))
        light = getattr(program, "light", None)
        written = set(light.mutated) if light is not None else set()
        for j, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                return None  # a symbolic size or an unspecialized number
            if id(x) in at:
                feeds.append(f"a{at[id(x)]}")
            elif id(x) in fixed and j not in written and not x.is_inference():
                feeds.append(code.fixed(x, fixed[id(x)]))  # (an inference tensor: no version)
            else:
                return None  # read from somewhere not checked, or a buffer written
        ret = _result(result, outputs)
        if ret is None:
            return None
        for i, a in enumerate(args):
            code.argument(i, a)
        if self.module is not None:
            code.check(f"{code.name(self.module)}.training is {self.module.training}")
            code.signature.append(self.module.training)
        return code.build(program, feeds, ret)

    def _fixed(self) -> dict[int, tuple]:
        """id -> where it is read, for every tensor the graph may read besides arguments:
        ("version", tensor) for parameters and buffers, ("global", dict, name) and ("cell",
        cell) for the code's globals and closure variables."""
        found: dict[int, tuple] = {}
        codes: list[Callable] = [self.code]
        if self.module is not None:
            for m in self.module.modules():
                found.update((id(t), ("version", t)) for t in m.parameters(recurse=False))
                found.update((id(t), ("version", t)) for t in m.buffers(recurse=False))
                codes.append(type(m).forward)
        for fn in codes:
            for _, v, where in free_values(fn):
                if isinstance(v, torch.Tensor):
                    found.setdefault(id(v), where)
        return found


def _tensor_positions(args: tuple, grad: bool) -> dict[int, int] | None:
    """id of each tensor argument -> its position, where the arguments are what an entry can
    check: tensors autograd does not record (with grad mode on, none requiring grad), each
    passed once (the graph assumes distinct tensors), and plain values; else None."""
    at: dict[int, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if id(a) in at or (grad and a.requires_grad):
                return None
            at[id(a)] = i
        elif not isinstance(a, PLAIN_VALUES):
            return None
    return at


def free_values(fn: Callable) -> Iterator[tuple[str, Any, tuple]]:
    """What ``fn`` reads from outside itself: each global its code (nested code too) names
    that its globals hold, as ``(name, value, ("global", globals, name))``, and each filled
    closure cell, as ``(name, value, ("cell", cell))``."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    scope = fn.__globals__
    for name in dict.fromkeys(_names(code)):
        if name in scope:
            yield name, scope[name], ("global", scope, name)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield name, v, ("cell", cell)


def _names(code: types.CodeType) -> list[str]:
    """The global names ``code`` and the code nested in it read."""
    out = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _names(c)
    return out


def _result(result: Any, outputs: Sequence[Any]) -> str | None:
    """The expression that builds ``result`` from the graph's outputs ``out``, where it is
    the graph's outputs alone, each of them used; else None."""
    where = {id(o): i for i, o in enumerate(outputs)}
    if len(where) != len(outputs):
        return None
    if isinstance(result, torch.Tensor):
        return f"out[{where[id(result)]}]" if len(outputs) == 1 and id(result) in where \
            else None
    if type(result) not in (tuple, list) or \
            sorted(where.get(id(r), -1) for r in result) != list(range(len(outputs))):
        return None
    items = "".join(f"out[{where[id(r)]}], " for r in result)
    return f"({items})" if type(result) is tuple else f"[{items}]"


def layout_check(tensors: Sequence[torch.Tensor]) -> Callable[..., bool]:
    """dynamo's own C++ check (``TensorGuards``) that tensors have these ones' shapes, strides,
    dtypes, devices, ``requires_grad`` and dispatch keys, all at once (0.17-0.26 us for two
    on the 2-core VM)."""
    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors]).check


def positional_entry(name: str, n: int, miss: str) -> tuple[str, str, str]:
    """The source pieces of a generated function ``name`` of ``n`` positional arguments
    ``a0 ... a<n-1>``, taken as parameters (a frame's fast locals, no tuple to unpack; one not
    given is ``_MISS`` in its namespace): its ``def`` line; the start of a condition, true
    where the call is not exactly those ``n`` (``"... or "``, for the caller's checks to end);
    and the line that hands the call, with its arguments as they came, to ``miss``."""
    params = "".join(f"a{i}=_MISS, " for i in range(n))
    given = "".join(f"a{i}, " for i in range(n))
    absent = f"a{n - 1} is _MISS or " if n else ""
    hand = (f"        return {miss}(*[a for a in ({given}) if a is not _MISS], *more, **kwargs)"
            if n else f"        return {miss}(*more, **kwargs)")
    return f"def {name}({params}*more, **kwargs):", f"more or kwargs or {absent}", hand


class _Code:
    """The source of one entry: ``entry(a0, a1, ...) -> result``; where the call is not
    its signature's, the next entry's result (``_next``, set by :meth:`Direct._add`)."""

    def __init__(self, grad: bool, n: int) -> None:
        self.n = n
        self.checks: list[str] = []
        self.names: dict[int, str] = {}
        state = GlobalStateGuard()  # the global state as now (the learned call's)
        self.namespace: dict[str, Any] = {"_MISS": _MISS, "_Tensor": torch.Tensor,
                                          "_state": state.check}
        # (the global state's own description: an entry per state, as dynamo's per guard)
        self.signature: list[Any] = [grad, n, state.__getstate__()]  # (a str)
        # (argument or fixed tensor's name, the learned call's tensor): one layout check
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def name(self, value: Any) -> str:
        if id(value) not in self.names:
            self.names[id(value)] = name = f"k{len(self.names)}"
            self.namespace[name] = value
        return self.names[id(value)]

    def check(self, line: str) -> None:
        self.checks.append(line)

    def argument(self, i: int, a: Any) -> None:
        a_i = f"a{i}"
        if isinstance(a, torch.Tensor):
            self.signature.append((a.shape, a.stride(), a.dtype, a.device))
            self.tensors.append((a_i, a))
        else:
            self.signature.append((type(a), a))
            self.check(f"type({a_i}) is {self.name(type(a))} and {a_i} == {self.name(a)}")

    def fixed(self, x: torch.Tensor, where: tuple) -> str:
        t = self.name(x)
        self.tensors.append((t, x))  # its layout too: .to(dtype), .double(), requires_grad_
        if where[0] == "version":
            self.check(f"{t}._version == {x._version}")
        elif where[0] == "global":
            self.check(f"{self.name(where[1])}.get({where[2]!r}) is {t}")
        else:
            self.check(f"{self.name(where[1])}.cell_contents is {t}")
        return t

    def _unwrapped(self, light: LightWrapper, feeds: list[str]) -> list[str]:
        """Lines doing what :func:`autopar.capture.dynamo._without_aot_wrapper`'s call does
        (the updated inputs copied back, inputs returned where the graph returns them; its
        grad mode switch is not needed here, see below), leaving ``out`` as its result."""
        run, boxed, mutated, bases = light
        # a runner's call without its own argument count check, where it has one (the
        # entry's feeds are fixed): one frame less
        self.namespace["_run"] = getattr(run, "unchecked", run) if boxed else run
        call = f"_run([{', '.join(feeds)}])" if boxed else f"_run({', '.join(feeds)})"
        # Grad mode is left as it is: aot made this graph an inference graph, so with grad
        # mode on no input requires grad (the arguments' requires_grad is in the tensor check;
        # a parameter that requires grad makes aot build a training graph, not learned), and
        # its ops record nothing either way
        lines = [f"    outs = {call}"]
        inline = getattr(run, "call_lines", None) if boxed else None
        if inline is not None and len(inline.inputs) == len(feeds) and \
                not inline.globals.keys() & self.namespace.keys():
            # the runner's whole call in this function's own lines: no frame, no lists of
            # arguments and slots (W3 with host data on the H200: 3 frames became 1). Under
            # the profiler, or where a line fails, the program runs the call itself: its
            # ranges, its failure's report or fallback (the graph writes nothing: aot's
            # updates of inputs are the copies below, after it)
            self.namespace.update(inline.globals, _profiler=torch.autograd.profiler)
            lines = ["    if _profiler._is_profiler_enabled:", f"        outs = {call}",
                     "    else:", "        try:",
                     *(f"            {v} = {f}" for v, f in zip(inline.inputs, feeds)),
                     *("            " + line for line in inline.body),
                     f"            outs = {inline.outputs}",
                     "        except Exception:", f"            outs = {call}"]
        lines += [f"    {feeds[i]}.copy_(outs[{k}])" for k, i in enumerate(mutated)]
        n = len(mutated)
        if not bases or all(b is None for b in bases):
            lines.append(f"    out = outs[{n}:]" if n else "    out = outs")
        else:
            items = [f"outs[{n + j}]" if b is None else feeds[b] for j, b in enumerate(bases)]
            lines.append(f"    out = [{', '.join(items)}]")
        return lines

    def build(self, program: Callable, feeds: list[str], ret: str) -> Callable:
        self.namespace["_program"] = program
        if self.tensors:  # every tensor read at once, in C++ (dynamo's own tensor check)
            self.namespace["_tensors_match"] = layout_check([t for _, t in self.tensors])
            self.checks.insert(0, f"_tensors_match({', '.join(a for a, _ in self.tensors)})")
        header, came, miss = positional_entry("entry", self.n, "_next")
        lines = [header, f"    if {came}not _state():", miss]
        if self.checks:
            lines.append("    if not (" + "\n            and ".join(self.checks) + "):")
            lines.append(miss)
        light = getattr(program, "light", None)
        if light is None:
            lines.append(f"    out = _program({', '.join(feeds)})")
        else:  # aot's light wrapper (capture.dynamo), inline: two frames less a call
            lines += self._unwrapped(light, feeds)
        lines.append(f"    return {ret}")
        source = "\n".join(lines) + "\n"
        exec(compile(source, f"<autopar direct entry #{next(_counter)}>", "exec"),
             self.namespace)
        entry = self.namespace["entry"]
        entry.signature = tuple(self.signature)
        entry.source = source
        return entry


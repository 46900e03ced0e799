"""The state a training step reaches without taking it as an argument, lifted into its trace.

A step written as users write it (``opt.zero_grad(); loss_fn(model(x), y).backward();
opt.step()``) reads the parameters and buffers of ``nn.Module``\\ s and the parameters and state
of ``torch.optim`` optimizers it names. :func:`find_state` collects those tensors; they become
extra inputs of the step's trace, and during the trace the modules and optimizers see the
trace's fake tensors in their place (:meth:`State.swapped`), swapped back after, even on error.

Policy and invariants
- Where state is looked for, in order: the step's arguments, the globals its code reads and its
  closure (:func:`autopar.capture.direct.free_values`), the attributes of a bound method's
  object, and, one level down, the items of dicts, lists and tuples found there and the free
  values of plain functions (a ``loss_fn`` that names the model). Each module and optimizer
  once; a module inside another found one is not walked again. A tensor once (tied weights:
  its first name); a step argument is not state (an optimizer that steps an argument sees the
  argument's fake).
- A ``torch.amp.GradScaler`` is state: its scale and growth tracker are tensors of the trace.
  A fused optimizer's kernel checks for infs and skips itself on the device; another's
  ``scaler.step`` reads ``found_inf`` on the host and branches on it, which the trace replaces
  by a ``where`` per tensor the step writes (:func:`_branch_free_step`).
- Tensors, in order: each module's parameters then buffers, then parameters an optimizer steps
  that no module holds, then a GradScaler's scale and growth tracker, then tensors among
  param groups' values (a tensor ``lr``, which a
  scheduler may change without a new capture), then each group's float ``lr`` and ``betas``
  as 0-dim float64 tensors made for the call (:attr:`State.lifted`), then each optimizer's state
  tensors, then the ``.grad`` each parameter holds on entry (the step may zero it, set it to
  None or add into it: all three are traced).
- A float ``lr`` (and each float of ``betas``, and ``momentum``: :data:`_LIFTED`) that the
  caller says varies (``find_state``'s ``varying``: it changed between calls) is an input of
  the trace, not a constant in it: the optimizer sees the ``.item()`` of its tensor (a Python
  number the graph computes on, the very double eager uses), so a scheduler stepped outside
  the step (linear warm-up, cosine, one-cycle: a new value every step) needs no new capture.
  One that doesn't vary is baked in, as every other param group value is: a number read on
  the host each call is an op no CUDA graph can hold (SGD's momentum, lifted, cut each GPU's
  update out of its graph: ResNet-50 over 4 GPUs of ``h200x8`` predicted 17.2 ms against
  16.0). Where the optimizer branches on a lifted value's sign (SGD's ``momentum != 0``) the
  sign is part of the signature (:data:`_SIGNED`). Of a ``fused=True`` group only ``lr`` is
  lifted, and its kernel is given the tensor itself (:data:`_FUSED_LIFTED`); a new value of
  another (``OneCycleLR``'s ``beta1``) is a new capture.
- :attr:`State.signature` keys the compiled graph: every tensor's metadata and whether each
  parameter holds a ``.grad``, each module's ``training`` flags, every param group's non-tensor
  values but the lifted ones (``weight_decay``, ``foreach``, ...; of a lifted one its sign
  where it is signed) and the keys
  of each optimizer's state.
- An optimizer left at ``foreach=None`` is traced on the path eager takes for the real
  parameters (foreach on CUDA), not the per-tensor loop its fake tensors would select.
- The trace runs with ``torch.compiler.is_compiling()`` true, as ``torch.export``'s non-strict
  trace does: ``torch.optim`` then computes bias corrections from its step-count tensors
  instead of baking a Python number read by ``.item()`` into the graph.
- A step whose optimizer makes its state during the call (the first step: Adam's moments, SGD's
  momentum buffers) can't be replayed from the trace: :class:`StateNotReady`; that call runs
  eagerly and the next one is traced. A step that changes a param group's values (a scheduler
  stepped inside the step) is refused: that change would happen at capture only. What the
  trace did to the param groups and to the schedulers it can see is undone after it.
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._pytree import tree_flatten

from . import pystate
from .direct import free_values
from .fx import Unsupported

__all__ = ["State", "StateNotReady", "find_state"]

_MAX_ITEMS = 64  # items of a dict, list or tuple among the free values looked into


class StateNotReady(Unsupported):
    """The optimizer makes its state in this call: run it eagerly, trace the next one."""


@dataclass
class State:
    """The modules and optimizers a step reaches and their tensors (see the module docstring)."""

    modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    optimizers: list[tuple[str, Optimizer]] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    grad_of: dict[int, int] = field(default_factory=dict)  # grad's index -> its parameter's
    schedulers: list[Any] = field(default_factory=list)  # restored after a trace
    scalers: list[tuple[str, Any]] = field(default_factory=list)  # GradScalers (see _SCALER)
    python: tuple = ()  # the Python values the step reads (capture.pystate.read_key)
    foreach: bool | None = None  # a group's foreach=None in the trace (None: eager's choice)
    # (optimizer, param group, key, position in a tuple or None, tensor index) of each float
    # group value lifted into a tensor input (see _LIFTED)
    lifted: list[tuple[int, int, str, int | None, int]] = field(default_factory=list)
    # every float group value that may be lifted, lifted or not:
    # (o, i, key, position) -> (its name, its value)
    floats: dict[tuple[int, int, str, int | None], tuple[str, float]] = \
        field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.modules or self.optimizers)

    @property
    def signature(self) -> tuple:
        metas = tuple((tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
                      for t in self.tensors)
        values = [_group_values(opt) for _, opt in self.optimizers]
        for o, i, key, at, _ in self.lifted:  # an input: its value is no part of the signature
            v = values[o][i][key]
            mark = ("input", _sign(v)) if key in _SIGNED else "input"
            values[o][i][key] = mark if at is None else (*v[:at], mark, *v[at + 1:])
        groups = tuple(tuple(tuple(sorted(g.items())) for g in v) for v in values)
        states = tuple(tuple(tuple(sorted(s)) for s in opt.state.values())
                       for _, opt in self.optimizers)
        # train() / eval() changes what a module computes (batch norm, dropout): baked in
        modes = tuple(tuple(sub.training for sub in m.modules()) for _, m in self.modules)
        scalers = tuple((sc._growth_factor, sc._backoff_factor, sc._growth_interval)
                        for _, sc in self.scalers)  # baked into the trace
        return metas, tuple(sorted(self.grad_of)), groups, states, modes, scalers, self.python


    @contextlib.contextmanager
    def swapped(self, fakes: Sequence[torch.Tensor],
                also: dict[int, torch.Tensor] | None = None,
                compiling: bool = True) -> Iterator[None]:
        """Modules and optimizers see ``fakes`` (one per :attr:`tensors`) in place of their
        tensors until the block ends; ``also`` maps the ids of the step's argument tensors to
        their fakes (an argument an optimizer steps is the same tensor there)."""
        fake = {**(also or {}), **{id(real): f for real, f in
                                   zip(self.tensors, fakes, strict=True)}}
        keys = [dict(self._state_keys(opt)) for _, opt in self.optimizers]
        with contextlib.ExitStack() as stack:
            for _, module in self.modules:
                named = {**dict(module.named_parameters(remove_duplicate=False)),
                         **dict(module.named_buffers(remove_duplicate=False))}
                stack.enter_context(_reparametrize_module(
                    module, {name: fake[id(t)] for name, t in named.items() if id(t) in fake}))
            for scheduler in self.schedulers:  # a scheduler stepped in the trace: undone
                stack.callback(scheduler.load_state_dict, scheduler.state_dict())
            for _, scaler in self.scalers:  # its tensors traced; its stages as they were
                stack.callback(setattr, scaler, "_per_optimizer_states", _stages_of(scaler))
                scaler._maybe_opt_step = _branch_free_step  # (the instance's, for the trace)
                stack.callback(delattr, scaler, "_maybe_opt_step")
                for attr in _SCALER:
                    real = getattr(scaler, attr)
                    stack.callback(setattr, scaler, attr, real)
                    setattr(scaler, attr, fake[id(real)])
            for _, opt in self.optimizers:
                groups = [dict(g) for g in opt.param_groups]
                state = opt.state
                stack.callback(_restore, opt, groups, state)
                for g in opt.param_groups:
                    if "foreach" in g:
                        g["foreach"] = self._traced_foreach(g)
                    g["params"] = [fake[id(p)] for p in g["params"]]
                    for k, v in list(g.items()):
                        if isinstance(v, torch.Tensor) and id(v) in fake:
                            stack.callback(g.__setitem__, k, v)
                            g[k] = fake[id(v)]
                opt.state = defaultdict(dict, {
                    fake[id(p)]: {k: fake.get(id(v), v) if isinstance(v, torch.Tensor) else v
                                  for k, v in s.items()}
                    for p, s in state.items()})
            for o, i, key, at, j in self.lifted:  # the optimizer reads the input's number
                g = self.optimizers[o][1].param_groups[i]
                if g.get("fused"):  # the kernel takes the tensor (tensor_lr): no host read
                    g[key] = fakes[j]
                    continue
                number = fakes[j].item()
                if key in _SIGNED:  # the trace knows its sign, as the signature does
                    _know_sign(number, _sign(g[key]))
                g[key] = number if at is None else (*g[key][:at], number, *g[key][at + 1:])
            values = [_group_values(opt) for _, opt in self.optimizers]  # foreach chosen
            for g, p in self.grad_of.items():
                fakes[p].grad = fakes[g]
            if compiling:
                stack.enter_context(_compiling())
            try:
                yield
            except Exception as e:  # a trace that failed once the state was made: not ready
                if not isinstance(e, Unsupported):
                    self._check_ready(keys, e)
                raise
            self._check_unchanged(values, keys)

    def host_step_counts(self) -> list[int]:
        """Indices in :attr:`tensors` of the step counts ``torch.optim`` keeps on the host
        whatever the parameters' device (all but a capturable or fused optimizer's)."""
        index = {id(t): j for j, t in enumerate(self.tensors)}
        return [index[id(step)] for _, opt in self.optimizers
                if not any(g.get("capturable") or g.get("fused") for g in opt.param_groups)
                for s in opt.state.values()
                if isinstance(step := s.get("step"), torch.Tensor) and id(step) in index]

    def uses_foreach(self) -> bool:
        """Does any param group take the foreach path in the trace?"""
        return any(self._traced_foreach(g) for _, opt in self.optimizers
                   for g in opt.param_groups)

    def _traced_foreach(self, group: dict) -> Any:
        """The group's ``foreach`` in the trace: as given, and for ``foreach=None`` (not fused)
        what ``torch.optim`` picks on the real parameters (the trace's fake tensors would steer
        it to the per-tensor loop): the same code path, and a few list kernels on CUDA instead
        of a loop of tiny ones."""
        if group.get("foreach", False) is not None or group.get("fused"):
            return group.get("foreach")
        if self.foreach is not None:
            return self.foreach
        return bool(_default_to_fused_or_foreach(group["params"], differentiable=False,
                                                 use_fused=False)[1])

    def _check_unchanged(self, values: list, keys: list) -> None:
        for (name, opt), was in zip(self.optimizers, values, strict=True):
            now = _group_values(opt)
            if now != was:
                i = next(i for i, (a, b) in enumerate(zip(now, was)) if a != b)
                changed = sorted(k for k in now[i] if now[i][k] != was[i].get(k))
                raise Unsupported(
                    f"the step changes {', '.join(changed)} of {name}'s param group {i} (a "
                    "learning-rate scheduler stepped inside the step?): step it outside")
        self._check_ready(keys)

    def _check_ready(self, keys: list, error: BaseException | None = None) -> None:
        """Raise :class:`StateNotReady` where an optimizer made its state in the trace (from
        ``error``, the trace's own failure, if any: the next call's trace may succeed)."""
        for (name, opt), had in zip(self.optimizers, keys, strict=True):
            if dict(self._state_keys(opt)) != had:
                raise StateNotReady(f"{name} makes its state in this call ({type(opt).__name__}"
                                    "'s first step): it runs eagerly, the next call is "
                                    "traced") from error

    @staticmethod
    def _state_keys(opt: Optimizer) -> Iterator[tuple[int, set]]:
        """Each stepped parameter's position in the param groups and its state's keys (the
        trace's optimizer is keyed by fake tensors: positions match the real one's)."""
        where = {id(p): k for k, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        for p, s in opt.state.items():
            yield where.get(id(p), -1), set(s)


_LIFTED = ("lr", "betas", "momentum")
"""Param group values a scheduler steps that are inputs of the trace where they are floats
(``betas``: each of them, as ``OneCycleLR`` cycles Adam's ``beta1``; ``momentum``, as it
cycles SGD's)."""

_SCALER = ("_scale", "_growth_tracker")
"""A ``torch.amp.GradScaler``'s tensors, which its ``update()`` writes in place: state of the
trace, as an optimizer's are."""


def _check_scaler(name: str, scaler: Any) -> None:
    if any(getattr(scaler, attr) is None for attr in _SCALER):
        raise StateNotReady(f"the GradScaler {name} makes its scale at its first scale() call")


def _branch_free_step(optimizer: Optimizer, optimizer_state: dict, *args: Any,
                      **kwargs: Any) -> Any:
    """``GradScaler._maybe_opt_step`` as a trace can take it: eager reads ``found_inf`` on the
    host and steps only where it is 0; here the step always runs, and every tensor it may
    write (the parameters and the optimizer's state) keeps its value from before where
    ``found_inf`` is not 0 (a ``where`` each: what eager leaves, bit for bit, without the
    host's branch; the values before are copies, made before the step). A fused optimizer
    takes the scaler's other path (its kernel skips itself) and never comes here."""
    parts = list(optimizer_state["found_inf_per_device"].values())
    found = parts[0]
    for part in parts[1:]:
        found = found + part.to(found.device)
    written = [p for g in optimizer.param_groups for p in g["params"]]
    written += [v for st in optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        before = [t.clone() for t in written]
    out = optimizer.step(*args, **kwargs)
    skip: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for t, was in zip(written, before):
            if t.device not in skip:
                skip[t.device] = found.to(t.device) > 0
            t.copy_(torch.where(skip[t.device], was, t))
    return out


_FUSED_LIFTED = ("lr",)
"""What is lifted of a ``fused=True`` group: its kernel (``_fused_adamw_``, ...) takes ``lr``
as a tensor (its ``tensor_lr`` overload, which reads a host tensor's value as the float
overload takes it) and every other value as a float, which a trace can't leave open."""

def _liftable(group: dict) -> tuple[str, ...]:
    """The keys of ``group`` that may become inputs of the trace: of a fused group only
    ``lr`` (a host tensor the kernel reads as a number, on a GPU too: see
    :func:`autopar.ir.routing.reads_host_lr`)."""
    return _FUSED_LIFTED if group.get("fused") else _LIFTED


_SIGNED = frozenset({"momentum"})
"""Lifted values whose sign the optimizer branches on (SGD: ``if momentum != 0``): the trace
is told the sign the value has (``torch._check``), and the signature holds it, so a value of
another sign is another capture."""


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _know_sign(number: Any, sign: int) -> None:
    """Tell the trace that the traced ``number`` has ``sign``: comparisons with 0 then decide
    without a guard on its value."""
    if sign == 0:
        torch._check(number == 0)
        return
    torch._check(number != 0)
    torch._check(number > 0 if sign > 0 else number < 0)


def _stages_of(scaler: Any) -> dict:
    """A copy of ``scaler``'s per-optimizer stages, two levels deep: a trace's ``unscale_`` and
    ``step`` write into the dict in place (an entry for the optimizer, its stage, fake
    ``found_inf``s) where no ``update()`` replaces it, and the copy is what is put back."""
    stages = scaler._per_optimizer_states
    return type(stages)(stages.default_factory, {  # a defaultdict, as GradScaler keeps it
        k: {kk: dict(vv) if isinstance(vv, dict) else vv for kk, vv in v.items()}
        for k, v in stages.items()})


def _restore(opt: Optimizer, groups: list[dict], state: Any) -> None:
    for g, was in zip(opt.param_groups, groups, strict=True):
        g.clear()
        g.update(was)
    opt.state = state


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    was = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = was


def _group_values(opt: Optimizer) -> list[dict[str, Any]]:
    """Each param group's values but its parameters, tensors by their metadata."""
    return [{k: _plain(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, str(v.device))
    if isinstance(v, torch.SymFloat | torch.SymInt):  # a lifted value in the trace: by identity
        return ("traced", id(v))
    if isinstance(v, list | tuple):
        return tuple(_plain(x) for x in v)
    return v


def find_state(fn: Callable, args: Sequence[Any],
               varying: Collection[tuple[int, int, str, int | None]] = (),
               for_trace: bool = True) -> State:
    """The modules and optimizers ``fn(*args)`` reaches and their tensors, in the module
    docstring's order; of the float param group values :data:`_LIFTED` names (all in
    :attr:`State.floats`), those in ``varying`` are lifted, the others baked in.
    ``for_trace=False``: the caller only reads what was found (a GradScaler whose scale isn't
    made yet is no error)."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(name: str, value: Any, depth: int = 1) -> None:
        if isinstance(value, torch.nn.Module | Optimizer | LRScheduler | torch.amp.GradScaler):
            if id(value) in seen:
                return
            seen.add(id(value))
            found.append((name, value))
        elif depth and isinstance(value, dict):
            for k, v in list(value.items())[:_MAX_ITEMS]:
                visit(f"{name}[{k!r}]", v, depth - 1)
        elif depth and isinstance(value, list | tuple):
            for k, v in enumerate(value[:_MAX_ITEMS]):
                visit(f"{name}[{k}]", v, depth - 1)

    for i, a in enumerate(args):
        visit(f"argument {i}", a)
    functions: list[Callable] = []
    for name, value, _ in free_values(fn):
        visit(name, value)
        if isinstance(value, types.FunctionType):
            functions.append(value)
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        visit("self", owner)
        for name, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
            visit(f"self.{name}", value)
    for f in functions:
        for name, value, _ in free_values(f):
            visit(name, value)

    state = State()
    given = {id(x) for x in tree_flatten(tuple(args))[0] if isinstance(x, torch.Tensor)}
    modules = [(n, m) for n, m in found if isinstance(m, torch.nn.Module)]
    inner = {id(s) for _, m in modules for s in m.modules() if s is not m}
    state.modules = [(n, m) for n, m in modules if id(m) not in inner]
    state.optimizers = [(n, o) for n, o in found if isinstance(o, Optimizer)]
    state.schedulers = [s for _, s in found if isinstance(s, LRScheduler)]
    state.scalers = [(n, s) for n, s in found
                     if isinstance(s, torch.amp.GradScaler) and s.is_enabled()]
    state.python = pystate.read_key(pystate.watch(fn, ()))
    for name, scaler in state.scalers if for_trace else ():
        _check_scaler(name, scaler)
    at: dict[int, int] = {}

    def add(t: torch.Tensor, name: str) -> None:
        if id(t) not in at and id(t) not in given:
            at[id(t)] = len(state.tensors)
            state.tensors.append(t)
            state.names.append(name)

    for var, module in state.modules:
        for qual, t in [*module.named_parameters(), *module.named_buffers()]:
            add(t, f"{var}.{qual}")
    for var, opt in state.optimizers:
        for i, g in enumerate(opt.param_groups):
            for k, p in enumerate(g["params"]):
                add(p, f"{var}.param_groups[{i}]['params'][{k}]")
    for var, scaler in state.scalers:
        for attr in _SCALER:
            if getattr(scaler, attr) is not None:  # made at the first scale() (for_trace=False)
                add(getattr(scaler, attr), f"{var}.{attr}")
    names_of = dict(zip(map(id, state.tensors), state.names))
    for var, opt in state.optimizers:
        for i, g in enumerate(opt.param_groups):
            for key, v in g.items():
                if isinstance(v, torch.Tensor):
                    add(v, f"{var}.param_groups[{i}][{key!r}]")
    for o, (var, opt) in enumerate(state.optimizers):
        for i, g in enumerate(opt.param_groups):
            for key in _liftable(g):  # see the docstring
                v = g.get(key)
                floats = [(None, v)] if type(v) is float else \
                    list(enumerate(v)) if type(v) is tuple and all(
                        type(x) is float for x in v) else []
                for pos, x in floats:
                    name = f"{var}.param_groups[{i}][{key!r}]" + ("" if pos is None else f"[{pos}]")
                    state.floats[(o, i, key, pos)] = name, x
                    if (o, i, key, pos) not in varying:
                        continue
                    state.lifted.append((o, i, key, pos, len(state.tensors)))
                    state.tensors.append(torch.tensor(x, dtype=torch.float64, device="cpu"))
                    state.names.append(name)
    for var, opt in state.optimizers:
        for p, s in opt.state.items():
            for key, v in s.items():
                if isinstance(v, torch.Tensor):
                    add(v, f"{var}.state[{names_of.get(id(p), 'an argument')}][{key!r}]")
    params = [j for j, t in enumerate(state.tensors) if t.requires_grad and t.is_leaf]
    for j in params:
        g = state.tensors[j].grad
        if g is not None:
            state.grad_of[len(state.tensors)] = j
            state.tensors.append(g)
            state.names.append(f"{state.names[j]}.grad")
    return state

r"""Whole-step data parallelism: ``autopar.data_parallel(step)`` runs a training step written for
one device on several, splitting the batch when the cost model says it pays.

Capture (why not ``torch.compile``): dynamo breaks a training step at ``loss.backward()`` and
the optimizer update into separate forward, backward and update graphs; sharding across those
boundaries would need the saved activations to stay sharded between graphs. Instead the whole
step is traced into one graph: ``make_fx`` runs the step on fake tensors wrapped as
functional tensors (``FunctionalTensorMode``, aot_autograd's functionalization), and the
autograd engine's backward ops and the update are recorded as functional ATen ops like the
forward ones, what the step wrote into its inputs as trailing ``copy_`` (one trace, not a plain
trace made functional after by ``torch.func.functionalize``, which refuses ``.backward()``
inside it: that second trace was about a third of the planning time; measured: see
benchmarks/NOTES.md). Those ``copy_`` are taken out of the graph: their values become outputs,
written back into the user's tensors after the graph ran.

Policy and invariants
- The step is written as for one device: its parameters are its arguments, or the parameters
  and buffers of the ``nn.Module``\ s it names, updated by hand or by the ``torch.optim``
  optimizers it names (found and lifted into the trace: :mod:`autopar.capture.state`). An
  argument that is a parameter must have ``.grad`` None on entry (else the call runs eagerly);
  a module's parameter may hold one (the step zeroes it, sets it to None or adds into it, as
  traced). After the call every ``.grad`` is what eager leaves.
- The first call whose optimizer makes its state (Adam's moments, SGD's momentum buffers)
  runs eagerly; the next call is traced. A param group's tensor values are inputs of the
  trace; its float ``lr``, ``betas`` and ``momentum`` become inputs once they change (below),
  so a scheduler stepped outside the step needs no capture per value. Its other values
  (``weight_decay``, ...) are part of the signature.
- Batch inputs: ``batch_argnums`` (positions of tensor arguments, batch dim 0), else every
  tensor argument that doesn't require grad and whose dim 0 equals the first such one's. A step
  with no parameters (inference) must name them.
- After each call, the user's tensors hold what eager would have given (up to the summation
  order of reduced gradients), on the devices eager would have used, each ``.grad`` in the
  layout autograd gives it (the parameter's strides: channels last stays channels last). The
  outputs are eager's values, detached and compact: gathered from the shards, an output that
  is a view (``logits[:, -1]``, a transpose) comes back as a tensor of its own, contiguous;
  a plain object holding tensors (a ``DynamicCache``) as a new one of its type a call
  (:func:`autopar.capture.step.capture_step`'s ``_Held``).
- k and devices: the graph is placed unsplit, and split over the home device (where the batch
  lives) and the next k-1 devices of its kind in ``devices``, for every k; the one with the
  least predicted time is the candidate, "don't split" included. Unless ``shards`` is given,
  an unsplit prediction runs the step through :func:`autopar.compile` (its own measured
  choice), and a split is kept only when a trial (:class:`autopar.choose.Trial`, each call a
  real step) measured it faster than the step as written (see :mod:`autopar.passes.shard`
  for the pass, :mod:`autopar.schedule.place` for the timing). The host may still run
  whole, unsplit ops.
- Replicas: a parameter's copy on another device is kept between calls and made again only
  when the parameter changed outside the step (its ``_version`` or storage differ from what
  the step itself left). The graph computes each replica's next value on its own device (the
  update repeated there on all-reduced gradients, see :mod:`autopar.passes.shard`), so replicas stay
  resident and current with no broadcast.
- One compiled graph per argument signature (shapes, dtypes, devices, requires_grad, the
  non-tensor arguments), state signature and caller state (grad mode, inference mode,
  autocast: the trace bakes them in). Anything that can't be captured or sharded runs
  unsplit through :func:`autopar.compile`, with one warning on the ``autopar`` logger (the
  first call that makes an optimizer's state: as written). Never a wrong result.
- A plan that fails where the step as written does not (a kernel refusing what the plan hands
  it) runs that signature unsplit from then on, with the reason logged once: the graph writes
  nothing until it has run (its outputs are written back after), so nothing of the failed
  call was applied. Where the unsplit call fails too, its error is the user's.
- At most :data:`MAX_SIGNATURES` signatures are captured and planned (as dynamo's
  ``recompile_limit``): a value that changes every call and is baked in (a float argument, a
  param group value other than ``lr``, ``betas`` and ``momentum``, which are inputs of the
  trace) would make a capture, a plan and replicas a call, and keep them all. Past the
  limit a new signature runs unsplit, said once.
- A param group's float ``lr``, ``betas`` or ``momentum`` is baked into the trace until a
  call sees it changed since the call before (a scheduler stepped outside the step); from
  then on it is an input of the trace (:mod:`autopar.capture.state`). The first call runs
  as written, so a scheduler stepped after it is seen by the first capture.
- A training step's first call runs as written where no parameter holds a ``.grad``
  (backward leaves them, so that call's signature is never seen again), as does the call
  that makes an optimizer's state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .capture.fake import relabel_devices
from .capture.fx import Unsupported
from .capture.state import State, StateNotReady, find_state
from .capture.step import ChangesPython, StepGraph, capture_step
from .choose import Trial
from .cost.model import CostModel
from .distributed.shard import replica_bytes, tensor_bytes, units
from .ir.collective import COMM
from .ir.collector import paused
from .ir.graph import INPUT, Node
from .ir.logs import first_line
from .ir.routing import cuda_indices
from .machine.detect import load_machine
from .machine.fabric import Fabric
from .machine.presets import preset_fabric
from .passes.cudagraphs import capture_rule
from .passes.dataparallel import Choice, choose, devices_for, resident, shard_devices
from .passes.fusion import fusion_devices, regions_to_fuse
from .passes.shard import NotShardable, Sharded, even_sizes, torch_device
from .runtime import Executor
from .runtime import executor as _executor
from .runtime.callerstate import CallerState
from .schedule.place import place
from .schedule.world import WorldPrediction, predict_sharded, predict_world, should_shard

__all__ = ["DataParallelStep", "StepPrediction", "WorldStepPrediction", "batch_inputs",
           "predict_step", "predict_world_step", "update_share"]

log = logging.getLogger("autopar.dataparallel")

MAX_SIGNATURES = 8
"""Signatures a step captures at most (see the module docstring)."""


def _signature(leaves: Sequence[Any], spec: Any) -> tuple:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, str(x.device), x.requires_grad)
        return ("C", type(x).__name__, x if isinstance(x, int | float | bool | str | None)
                else id(x))
    return (str(spec), tuple(one(x) for x in leaves))


@dataclass
class _Compiled:
    """One argument signature's graph, how to call it, and why it was chosen."""

    step: StepGraph
    run: Callable[[Sequence[Any]], Sequence[Any]]
    choice: Choice
    way: str | None = "autopar"  # "eager" or "autopar"; None while a trial decides
    trial: Trial | None = None
    graphs: bool = False  # GPU segments replayed as CUDA graphs: outputs are written back
    failed: BaseException | None = None  # why the plan runs no more (it failed on a call)

    @property
    def sharded(self) -> Sharded | None:
        return self.choice.sharded


class DataParallelStep:
    """The callable :func:`data_parallel` returns (see the module docstring)."""

    def __init__(self, fn: Callable, options: Any, batch_argnums: Sequence[int] | None,
                 shards: int | None = None, *, unsplit: Callable,
                 cost_model: Callable[[], CostModel], measured: bool = True,
                 name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "step")
        self.options = options  # autopar.compile's Options: devices, policy, trace, fuse
        self._unsplit = unsplit  # what runs a call that is not split
        self._cost_model = cost_model
        self.measured = measured  # False: a split is kept as predicted (a caller measures it)
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.shards = shards
        self.replica_copies = 0  # replicas made from a parameter (not by the step's broadcast)
        self._compiled: dict[tuple, _Compiled | None] = {}
        self._replicas: dict[tuple[int, str], tuple[torch.Tensor, int, int]] = {}
        self.last: _Compiled | None = None
        self.refused: str | None = None  # why every call runs unsplit, once known
        self.full: str | None = None  # why new signatures run unsplit, once known
        self.never: str | None = None  # why no call will split (it changes Python state)
        self.unsplit: dict[tuple, str] = {}  # why a signature runs unsplit (its capture, plan)
        self._why: str | None = None  # the last signature's entry of unsplit
        self.calls = 0  # calls made (a first call with no .grad held runs as written)
        # the last call's param group floats (State.floats), and those seen to change: lifted
        self._floats: dict[tuple, tuple[str, float]] | None = None
        self.varying: set[tuple] = set()

    # -- compiling --------------------------------------------------------------------------
    @paused()  # capture and planning: millions of small objects, no cycles worth a pass
    def _compile(self, fn: Callable, args: Sequence[Any], state: State) -> _Compiled:
        step = capture_step(fn, args, name=self.name, state=state)
        cost = self._cost_model()
        batch = batch_inputs(step, args, self.batch_argnums)
        shard_devices(batch, cost, self.options.devices, self.shards)  # the user's mistakes
        rule = capture_rule(self.options.cuda_graphs)
        on = [] if self.options.trace else _executor.graph_devices(list(self.options.devices),
                                                                    rule)
        try:
            choice = choose(step, batch, cost, self.options.devices,
                            policy=self.options.policy, shards=self.shards,
                            fusing=fusion_devices(self.options.devices, self.options.fuse),
                            cuda_graphs=self.options.cuda_graphs, graphed_devices=on)
            plan = choice.plan  # the plan its prediction simulated
            in_place, back = resident(step, choice.sharded, choice.graphs)
            run = Executor(plan, trace=bool(self.options.trace),
                           fuse=regions_to_fuse(plan, self.options.fuse),
                           cuda_graphs=capture_rule(choice.graphs) if choice.graphs else None,
                           in_place=in_place, transient=back)
        except (Unsupported, NotShardable):
            raise
        except Exception as e:  # planning failed: eager, as for any graph (see autopar.api)
            raise Unsupported(f"planning failed: {type(e).__name__}: {e}") from e
        log.info("autopar: %s: predicted %s; running %s", step.graph.name, choice.predicted,
                 "unsplit" if choice.sharded is None else ",".join(choice.sharded.devices))
        compiled = _Compiled(step, run, choice, graphs=choice.graphs)
        if self.shards is None:  # the user didn't ask for a split: measured against eager
            if choice.sharded is None:
                compiled.way = "eager"  # unsplit is the step as written
            elif self.measured:
                compiled.way = None
                compiled.trial = Trial({"eager": cuda_indices(self._eager_devices(args)),
                                        "autopar": cuda_indices(choice.sharded.devices)},
                                       self.name)
        return compiled

    @staticmethod
    def _eager_devices(args: Sequence[Any]) -> list[str]:
        return [str(x.device) for x in tree_flatten(tuple(args))[0]
                if isinstance(x, torch.Tensor)]

    # -- explaining -------------------------------------------------------------------------
    def explain(self) -> str:
        """What each captured signature runs: the predictions per split, the devices and shard
        sizes, the trial's verdict, and each op left unsplit with its reason and user line."""
        name = self.name
        if not self._compiled:
            return f"{name}: not called yet"
        lines = [f"{name}: {self.full}"] if self.full else []
        if self.never:
            lines.append(f"{name}: every call runs unsplit: {self.never}")
        if self.varying:
            names = self._floats or {}
            lifted = ", ".join(names[k][0] for k in sorted(self.varying) if k in names)
            lines.append(f"{name}: inputs of the trace, having changed between calls: {lifted}")
        for k, (key, c) in enumerate(self._compiled.items()):
            if c is None:
                lines.append(f"{name} [{k}]: runs unsplit, through autopar.compile: "
                             f"{self.unsplit.get(key, 'not captured')}")
                continue
            predicted = ", ".join(f"{label} {v * 1e3:.3f} ms"
                                  for label, v in c.choice.predicted.items())
            way = {"eager": "unsplit (autopar.compile's choice)", "autopar": "autopar's plan",
                   None: "trial in progress"}[c.way]
            if c.failed is not None:
                way = (f"unsplit: its plan failed: {type(c.failed).__name__}: "
                       f"{first_line(c.failed)}")
            lines.append(f"{name} [{k}]: {len(c.step.graph.ops)} ops; predicted {predicted}; "
                         f"runs {way}")
            lines.append(f"  {c.choice.label} bound: {c.choice.bound()}")
            for label, why in [*c.choice.refused.items(), *c.choice.pruned.items()]:
                lines.append(f"  not chosen: {label}: {why}")
            sh = c.sharded
            if sh is None:
                lines.append("  unsplit")
                continue
            pinned = sum(1 for d in sh.pins.values() if d not in (sh.devices[0], COMM))
            reduced = sum(1 for d in sh.pins.values() if d == COMM)
            lines.append(f"  split over {', '.join(sh.devices)} (rows {list(sh.sizes)}); "
                         f"{pinned} ops on the other shards; {len(sh.replicas)} replicas"
                         + (f"; {reduced} all-reduces" if reduced else "")
                         + (f"; GPU segments as CUDA graphs ({c.choice.graphs})"
                            if c.choice.graphs else ""))
            by_name = {n.name: n for n in c.step.graph.nodes}
            for op, why in sh.unsplit.items():
                node = by_name.get(op)
                where = f" at {node.source}" if node is not None and node.source else ""
                what = f"{op} ({node.op})" if node is not None else op
                lines.append(f"  left unsplit: {what}: {why}{where}")
        return "\n".join(lines)

    # -- calling ----------------------------------------------------------------------------
    def prepare(self, *args: Any, **kwargs: Any) -> _Compiled | str:
        """Capture and plan the signature of ``fn(*args, **kwargs)`` (once; nothing runs): its
        compiled form, or why it runs unsplit (logged once)."""
        try:
            compiled = self._prepared(*self._packed(args, kwargs))[0]
        except StateNotReady as e:
            return str(e)
        if compiled is not None:
            return compiled
        return self.never or self.refused or self.full or self._why or "not captured"

    def _check_arguments(self, args: tuple) -> None:
        """The mistakes in ``batch_argnums`` and ``shards`` that the arguments show, raised
        before a call runs anything: a call that runs as written (the first, which makes the
        optimizer's state) would otherwise apply a step and a later one raise."""
        check_batch_argnums(args, self.batch_argnums)
        if self.shards is None:
            return
        named = [args[i] for i in self.batch_argnums or ()]
        first = next((t for t in [*named, *tree_flatten(tuple(args))[0]]
                      if isinstance(t, torch.Tensor)), None)
        if first is not None:
            devices_for(self._cost_model().machine.home(first.device).name,
                        self.options.devices, self.shards)

    def _packed(self, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
        """The function and arguments that are traced: keyword arguments as a last dict."""
        if not kwargs:
            return self.fn, args
        n, fn = len(args), self.fn
        return (lambda *a: fn(*a[:n], **a[n])), (*args, kwargs)

    def _prepared(self, fn: Callable, args: tuple,
                  first: bool = False) -> tuple[_Compiled | None, list | None]:
        """The signature's compiled form and its tensors (arguments', then the state's), or
        (None, None) where it runs unsplit. ``first``: the step's first call, which raises
        :class:`StateNotReady` (runs as written) where it would capture a training step whose
        parameters hold no ``.grad``: backward leaves them, so every later call has another
        signature (SGD without momentum, Adagrad: two captures and plans, where one serves)."""
        if self.never is not None:
            return None, None
        leaves, spec = tree_flatten(tuple(args))
        try:
            state = find_state(self.fn, args, self.varying)
            was = self._floats or {}
            changed = {k for k, (_, v) in state.floats.items() if k in was and was[k][1] != v}
            self._floats = state.floats
            if changed - self.varying:  # a scheduler steps it: an input from now on
                self.varying |= changed
                state = find_state(self.fn, args, self.varying)
        except StateNotReady:  # (a GradScaler before its first scale()): this call as written
            raise
        except Unsupported as e:  # the step names something no graph can replay
            if self.refused is None:
                log.warning("autopar: running %s unsplit: %s", self.name, e)
                self.refused = str(e)
            return None, None
        # the trace bakes the caller's grad mode and autocast in: they are part of the key
        key = (_signature(leaves, spec), state.signature, CallerState.capture())
        if key not in self._compiled and len(self._compiled) >= MAX_SIGNATURES:
            if self.full is None:
                self.full = (f"{MAX_SIGNATURES} signatures captured, and this call's is "
                             "another: a value baked into the trace changes from call to call "
                             "(a float argument, a Python value the step reads, a param "
                             "group value a scheduler "
                             "steps other than lr, betas and momentum?); new signatures run "
                             "unsplit")
                log.warning("autopar: %s: %s", self.name, self.full)
            return None, None
        if first and key not in self._compiled and state.optimizers and not state.grad_of:
            raise StateNotReady("the step's first call, no parameter holding a .grad: runs as "
                                "written (its backward leaves the .grads, and its optimizer "
                                "any state it makes, for the next call to capture)")
        if key not in self._compiled:
            try:
                self._compiled[key] = self._compile(fn, args, state)
            except StateNotReady:  # this call makes the optimizer's state: the caller's
                raise
            except (Unsupported, NotShardable) as e:
                log.warning("autopar: running %s unsplit: %s", self.name, e)
                self._compiled[key] = None
                self.unsplit[key] = str(e)
                if isinstance(e, ChangesPython):  # so does every later signature's trace
                    self.never = str(e)
        compiled = self._compiled[key]
        self._why = self.unsplit.get(key)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)] + state.tensors
        return compiled, tensors

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.last = None
        self._check_arguments(args)
        self.calls += 1
        try:
            compiled, tensors = self._prepared(*self._packed(args, kwargs),
                                               first=self.calls == 1)
        except StateNotReady as e:  # this call makes the optimizer's state: trace the next
            log.info("autopar: %s", e)
            return self.fn(*args, **kwargs)
        if compiled is None or compiled.way == "eager" or any(
                tensors[j].grad is not None for j in compiled.step.arg_params):
            return self._unsplit(*args, **kwargs)
        if compiled.trial is None:
            return self._split(compiled, tensors, args, kwargs)

        def way_of(way: str) -> Callable:
            if way == "eager":
                return self.fn
            return lambda *_, **__: self._split(compiled, tensors, args, kwargs)

        out = compiled.trial.run(way_of, args, kwargs)
        won = compiled.trial.verdict() if compiled.trial is not None else None
        if won is not None:
            log.info("autopar: %s keeps %s (%s)", self.name, won, compiled.trial.summary())
            compiled.way, compiled.trial = won, None
        return out

    def _split(self, c: _Compiled, tensors: list[torch.Tensor], args: tuple,
               kwargs: dict) -> Any:
        """The call by ``c``'s plan; where the plan fails, the call unsplit and every later
        one of the signature (see the module docstring)."""
        self.last = c
        try:
            return self._run(c, tensors)
        except _PlanFailed as e:
            self.last = None
            out = self._unsplit(*args, **kwargs)  # raises the user's error where it fails too
            c.way, c.trial, c.failed = "eager", None, e.__cause__
            log.warning("autopar: %s runs unsplit from now on: its plan failed where the step "
                        "as written does not: %s: %s", self.name, type(e.__cause__).__name__,
                        first_line(e.__cause__))
            return out

    def _run(self, c: _Compiled, tensors: list[torch.Tensor]) -> Any:
        step = c.step
        replicas = c.sharded.replicas if c.sharded is not None else []
        call_args = [t.detach() for t in tensors] + step.constants + \
            [self._replica(tensors, i, d) for i, d in replicas]
        try:
            outs = list(c.run(call_args))
        except Exception as e:  # nothing written back yet: the caller runs the call unsplit
            raise _PlanFailed from e
        n, g, m = step.n_outputs, len(step.grads), len(step.mutated)
        user, grads, new = outs[:n], outs[n:n + g], outs[n + g:n + g + m]
        # written back where they are held: under CUDA graphs the outputs are a graph's static
        # buffers, which the next call overwrites, so .grads and replicas are copied into
        with torch.no_grad():
            copies = [(tensors[j], value) for j, value in zip(step.mutated, new)]
            for j, grad in zip(step.grads, grads):
                held = tensors[j].grad
                if c.graphs and _same_layout(held, grad):
                    copies.append((held, grad))
                else:
                    tensors[j].grad = _as_eager_grad(tensors[j], grad, c.graphs)
            nexts = c.sharded.replica_outputs if c.sharded is not None else []
            kept = []
            for (j, device), fresh in zip(nexts, outs[n + g + m:], strict=True):
                where = torch.device(torch_device(device))
                if fresh.device != where:  # the graph delivered it to eager's device: move it
                    fresh = fresh.to(where)
                got = self._replicas.get((j, device))
                if c.graphs and got is not None and _same_layout(got[0], fresh):
                    copies.append((got[0], fresh))
                    fresh = got[0]
                kept.append((j, device, fresh))
            _copy_all(copies)
        for j in step.cleared:
            tensors[j].grad = None
        for j, device, fresh in kept:  # after the write-back: the versions it left
            self._keep_replica(j, device, fresh, tensors[j])
        return tree_unflatten(user, step.out_spec)

    def refresh(self) -> None:
        """Forget the replicas: the next call copies every parameter again. Needed after a
        write the step can't see (through ``p.data``, which leaves ``p._version`` as it was)."""
        self._replicas.clear()

    def _replica(self, tensors: list[torch.Tensor], j: int, device: str) -> torch.Tensor:
        t = tensors[j]
        got = self._replicas.get((j, device))
        if got is not None and got[1] == t._version and got[2] == t.data_ptr():
            return got[0]
        fresh = t.detach().to(torch_device(device))
        self.replica_copies += 1
        self._keep_replica(j, device, fresh, t)
        return fresh

    def _keep_replica(self, j: int, device: str, fresh: torch.Tensor, t: torch.Tensor) -> None:
        """``fresh`` is ``t``'s replica on ``device`` while ``t``'s version and storage stay."""
        self._replicas[(j, device)] = (fresh, t._version, t.data_ptr())


class _PlanFailed(Exception):
    """A plan's program raised (its ``__cause__``) before any of the call was written back."""


def _same_layout(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape and a.stride() == b.stride() and \
        a.dtype == b.dtype and a.device == b.device


def _as_eager_grad(param: torch.Tensor, grad: torch.Tensor, copy: bool) -> torch.Tensor:
    """``grad`` in the layout autograd gives ``param``'s ``.grad`` (its ``AccumulateGrad``): the
    parameter's strides where it is dense and non-overlapping (a channels-last convolution's
    weight), else contiguous: ``torch.empty_like``'s rule. The plan's gradient is a
    collective's or a gather's, compact; ``copy``: a new tensor even where the layout is
    already right (under CUDA graphs ``grad`` is a static buffer the next replay overwrites)."""
    if grad.stride() != param.stride():
        want = torch.empty_like(param, dtype=grad.dtype, device=grad.device)
        if want.stride() != grad.stride():
            return want.copy_(grad)
    return grad.clone() if copy else grad


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair, as one ``torch._foreach_copy_`` per (device, dtype):
    a launch per ~110 tensors, not one each (GPT-2's AdamW step writes back 3 x 148)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for dst, src in pairs:
        dsts, srcs = groups.setdefault((dst.device, dst.dtype, src.device, src.dtype), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


def check_batch_argnums(args: Sequence[Any], batch_argnums: Sequence[int] | None) -> None:
    """Raise TypeError where ``batch_argnums`` names a position of ``args`` that holds no
    tensor."""
    for i in batch_argnums or ():
        if not 0 <= i < len(args) or not isinstance(args[i], torch.Tensor):
            raise TypeError(f"batch_argnums names argument {i}, which is not a tensor "
                            f"(the step got {len(args)} arguments)")


def batch_inputs(step: StepGraph, args: Sequence[Any],
                 batch_argnums: Sequence[int] | None) -> dict[Node, int]:
    """The graph inputs split along dim 0: those of ``batch_argnums`` (positions of tensor
    arguments), else every tensor argument that doesn't require grad whose dim 0 equals the
    first such one's (see the module docstring); a step whose parameters are all frozen
    modules' (state, not arguments) splits its tensor arguments likewise."""
    inputs = step.graph.inputs
    tensors = [x for x in tree_flatten(tuple(args))[0] if isinstance(x, torch.Tensor)]
    if batch_argnums is not None:
        check_batch_argnums(args, batch_argnums)
        picked = []
        for i in batch_argnums:
            # every position of that tensor (one tensor passed twice: ids and labels)
            picked += [j for j, t in enumerate(tensors) if t is args[i]]
        return {inputs[j]: 0 for j in picked}
    if not step.params and len(inputs) <= step.n_args:  # a frozen module's are state
        raise TypeError("the step has no parameters (tensors that require grad, or a "
                        "module's): name its batch arguments with batch_argnums=(...)")
    rest = [j for j, t in enumerate(tensors)
            if j < step.n_args and j not in step.params and t.dim() >= 1]
    if not rest:
        raise NotShardable("no tensor argument without requires_grad to split")
    n = tensors[rest[0]].shape[0]
    return {inputs[j]: 0 for j in rest if tensors[j].shape[0] == n}


@dataclass
class StepPrediction:
    """:func:`predict_step`'s answer: the choice, eager's predicted seconds (every op where
    eager runs it, each its own kernel) and the simulated Timeline of the chosen plan as the
    executor runs it (fused where ``fuse`` says)."""

    choice: Choice
    eager_s: float

    @property
    def timeline(self) -> Any:
        """The chosen candidate's simulated Timeline, as :func:`choose` predicted it."""
        return self.choice.timeline

    @property
    def predicted_s(self) -> float:
        """The chosen candidate's predicted seconds, as :func:`choose` ranked it."""
        return self.choice.predicted[self.choice.label]


def relabel_step(step: StepGraph, state: State, device: str) -> None:
    """``step``'s graph, traced on CPU tensors, made to live on ``device``, as if its tensors
    had been there: but for what torch.optim keeps on the host (its step counts), the float
    param group values lifted into inputs (``lr``, ``betas``: made on the host each call)
    and the 0-dim tensors the trace made (``torch.tensor(beta)`` in torch.optim)."""
    inputs = step.graph.inputs
    counts = [inputs[step.n_args + j] for j in state.host_step_counts()]
    counts += [inputs[step.n_args + j] for *_, j in state.lifted]
    made = inputs[len(inputs) - len(step.constants):] if step.constants else ()
    counts += [n for n in made if n.meta is not None and not n.meta.shape]
    relabel_devices(step.graph, "cpu", device, keep=counts)


def _captured(fn: Callable, args: Sequence[Any], machine: Any,
              inputs_on: str | None) -> tuple[StepGraph, CostModel]:
    """``fn(*args)`` traced as :func:`data_parallel` would, its tensors taken to live on
    ``inputs_on``, and ``machine``'s cost model."""
    state = find_state(fn, args)
    if inputs_on is not None and inputs_on.startswith("cuda"):
        state.foreach = True  # torch.optim's default for CUDA tensors
    step = capture_step(fn, args, state=state)
    if inputs_on is not None:
        relabel_step(step, state, inputs_on)
    return step, CostModel(load_machine(machine))


def _predicted(step: StepGraph, args: Sequence[Any], cost: CostModel,
               batch_argnums: Sequence[int] | None, shards: int | None, fuse: bool | str,
               cuda_graphs: bool | str) -> StepPrediction:
    devices = [d.name for d in cost.machine.devices]
    fusing = fusion_devices(devices, fuse)
    choice = choose(step, batch_inputs(step, args, batch_argnums), cost, devices,
                    shards=shards, fusing=fusing, cuda_graphs=cuda_graphs,
                    graphed_devices=_executor.graph_devices(devices,
                                                            capture_rule(cuda_graphs)))
    eager = place(step.graph, cost, policy="single", devices=devices)
    return StepPrediction(choice, eager.predicted_s)


@paused()
def predict_step(fn: Callable, args: Sequence[Any], machine: Any,
                 inputs_on: str | None = "cuda:0", batch_argnums: Sequence[int] | None = None,
                 shards: int | None = None, fuse: bool | str = "auto",
                 cuda_graphs: bool | str = "auto") -> StepPrediction:
    """What :func:`data_parallel` would do with ``fn(*args)`` on ``machine`` (a preset name or a
    Machine), without running it: tensors built on the CPU are taken to live on ``inputs_on``.
    ``fuse`` and ``cuda_graphs`` as :func:`data_parallel`'s (``"auto"``: the GPUs' programs
    fused, their segments replayed as CUDA graphs where that pays)."""
    step, cost = _captured(fn, args, machine, inputs_on)
    return _predicted(step, args, cost, batch_argnums, shards, fuse, cuda_graphs)


@dataclass
class WorldStepPrediction:
    """:func:`predict_world_step`'s answer: one rank's step in a world of processes, against
    one GPU running the whole batch."""

    #: the best one-GPU way on the whole batch (autopar's unsplit prediction)
    one_gpu_s: float
    #: eager on one GPU, every op its own kernel, on the whole batch
    eager_s: float
    #: the rank's step (compute on its share, the all-reduce backward leaves, the update)
    world: WorldPrediction
    #: the world's GPUs and links
    fabric: Fabric
    #: "strong": the ranks share the batch; "weak": each rank takes a whole batch of its own
    scaling: str = "strong"
    #: a replica's bytes (parameters, gradients, optimizer state) and a rank's, sharded
    replica_bytes: float = 0.0
    sharded_bytes: float = 0.0
    #: one GPU's memory, and whether the model is sharded there (FSDP2; ``world`` is then
    #: the sharded step, ``other`` the replicated one, and the other way round)
    gpu_bytes: float = 0.0
    sharded: bool = False
    other: WorldPrediction | None = None

    @property
    def _work(self) -> int:
        return self.fabric.ranks if self.scaling == "weak" else 1

    @property
    def ratio(self) -> float:
        """Speed-up over the best one-GPU way (in samples a second where scaling is weak)."""
        return self._work * self.one_gpu_s / self.world.step_s

    @property
    def ratio_eager(self) -> float:
        """Speed-up over eager on one GPU (in samples a second where scaling is weak)."""
        return self._work * self.eager_s / self.world.step_s


def update_share(step: StepGraph, cost: CostModel, device: str = "cuda:0") -> tuple[float, int]:
    """The share of a traced step's op-by-op time on ``device`` its update takes (every op
    downstream of a gradient), and the bytes of the gradients a world all-reduces."""
    graph = step.graph
    grads = graph.outputs[step.n_outputs:step.n_outputs + len(step.grads)]
    users = graph.users()
    after: set[Node] = set()
    todo = [u for g in grads if isinstance(g, Node) for u in users.get(g, ())]
    while todo:
        n = todo.pop()
        if n not in after:
            after.add(n)
            todo += users.get(n, ())
    ops = [n for n in graph.nodes if n.op != INPUT]
    total = sum(cost.node_time(n, device) for n in ops)
    update = sum(cost.node_time(n, device) for n in ops if n in after)
    grad_bytes = sum(g.meta.nbytes for g in grads if isinstance(g, Node) and g.meta is not None)
    return (update / total if total else 0.0), grad_bytes


def predict_world_step(fn: Callable, args: Sequence[Any], machine: str,
                       batch_argnums: Sequence[int], gpus: int | None = None,
                       scaling: str = "strong") -> WorldStepPrediction:
    """One rank's step of ``fn(*args)`` under ``torchrun`` over preset ``machine``'s world
    (its nodes; ``gpus`` a node, all by default): its share predicted on one GPU, the
    gradients' all-reduce by :func:`autopar.schedule.world.predict_world`. ``scaling``:
    "strong", ``args`` hold the global batch the ranks share; "weak", each rank takes a batch
    like ``args``' (DDP's benchmarks)."""
    if scaling not in ("strong", "weak"):
        raise ValueError(f"scaling must be 'strong' or 'weak', not {scaling!r}")
    fabric = preset_fabric(machine, gpus=gpus)
    with paused():
        step, cost = _captured(fn, args, machine, "cuda:0")  # one trace of the whole batch
        share, grad_bytes = update_share(step, cost)
        whole = _predicted(step, args, cost, batch_argnums, 1, "auto", "auto")
    one_gpu = whole.choice.predicted["unsplit"]
    rank_s = one_gpu
    if scaling == "strong":
        rows = args[batch_argnums[0]].shape[0]
        mine = even_sizes(rows, fabric.ranks)[0]  # the largest share: the slowest rank
        local = [a[:mine] if i in batch_argnums else a for i, a in enumerate(args)]
        rank = predict_step(fn, local, machine, batch_argnums=batch_argnums, shards=1)
        rank_s = rank.choice.predicted["unsplit"]
    memory = _replica_memory(fn, args, fabric.ranks)
    gpu_bytes = float(cost.machine.profile.device("cuda:0").memory_bytes)
    replicated = predict_world(rank_s, share * rank_s, grad_bytes, fabric)
    sharded = predict_sharded(rank_s, share * rank_s, grad_bytes, fabric, memory[2])
    shard = should_shard(memory[0], gpu_bytes)
    return WorldStepPrediction(one_gpu, whole.eager_s, sharded if shard else replicated, fabric,
                               scaling, memory[0], memory[1], gpu_bytes, shard,
                               replicated if shard else sharded)


def _replica_memory(fn: Callable, args: Sequence[Any], ranks: int) -> tuple[float, float, int]:
    """(a replica's bytes, a rank's bytes sharded over ``ranks``, FSDP2's blocks) for the
    models and optimizers ``fn`` holds (:mod:`autopar.distributed.shard`)."""
    state = find_state(fn, args, for_trace=False)
    trained = list({id(p): p for _, m in state.modules for p in m.parameters()
                    if p.requires_grad}.values())
    replica = replica_bytes(trained, [opt for _, opt in state.optimizers])
    blocks = [u for _, m in state.modules for u in units(m)]
    largest = max((tensor_bytes(u.parameters()) for u in blocks), default=tensor_bytes(trained))
    return replica, replica / ranks + 2 * largest, max(1, len(blocks))

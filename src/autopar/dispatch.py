"""The measured choice at run time: :class:`Dispatcher`, what ``autopar.compile`` returns.

Per argument signature it runs the way the measured choice (:mod:`autopar.choose`) kept: the
function itself (eager), ``torch.compile(fn)``'s default (Inductor), its CUDA graphs,
autopar's graphs, or, for inference calls where two or more devices of the batch's kind are
named, the call with its batch split over them (:mod:`autopar.dataparallel`, tried where the
model predicts the split pays: :meth:`Dispatcher._split_candidate`). autopar's way is
``torch.compile(fn, backend=<autopar>)``: every graph dynamo captures goes through
:class:`~autopar.pipeline.Runner`.

Shapes: the first call's are static; when a later call brings new ones and dynamo makes the
graph dynamic, each concrete signature gets its own static graph at its first call
(:mod:`autopar.capture.shapes`). It is traced with ``.item()`` and tensor slice bounds kept in
the graph (dynamo's ``capture_scalar_outputs``, switched on around each call), so that they
are placed instead of breaking the graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .capture import pystate
from .capture.direct import Direct, layout_check, positional_entry
from .capture.dynamo import (
    WaySwitch,
    any_autocast_enabled,
    with_own_code,
)
from .capture.optim import OptimizerForms, dynamo_changes_optimizers
from .choose import (
    OWN_SIGNATURES,
    WAYS,
    Backward,
    Family,
    Steps,
    Trial,
    candidates,
    family_of,
    family_ways,
    launch_bound,
    results_differ,
)
from .dataparallel import DataParallelStep
from .ir.locks import Gate
from .ir.logs import first_line, quiet
from .ir.ops import PLAIN_VALUES
from .ir.routing import cuda_indices
from .ir.units import fmt_seconds
from .pipeline import Runner, _profiler, _range
from .schedule.timeline import Timeline

__all__ = ["SPLIT_MIN_S", "Dispatcher", "dispatcher_of"]

trials_log = logging.getLogger("autopar.trials")


def _of_kind(devices: Sequence[str], kind: str | None) -> int:
    """How many of ``devices`` are of ``kind`` ("cpu", "cuda"): a batch of that kind may be
    split where two or more are."""
    return sum(d.split(":")[0] == kind for d in devices)


SPLIT_MIN_S = 2e-3
"""An inference call predicted shorter than this is not split: capturing and planning the
split costs seconds on a big model, which a shorter call would take thousands of calls to
earn back."""


def _inductor_alone(fn: Callable, name: str) -> Callable:
    """The ``inductor`` and ``cudagraphs`` ways where no trace is shared
    (``guards="arguments"``): ``torch.compile(fn)`` and ``torch.compile(fn,
    mode="reduce-overhead")`` of their own (of a copy of a function's code:
    :func:`~autopar.capture.dynamo.with_own_code`), the latter's outputs cloned out of its
    graphs' memory (a later replay overwrites them; eager's caller may still hold them)."""
    if name not in ("inductor", "cudagraphs"):
        raise ValueError(f"the {name} way needs a shared trace (autopar.compile's)")
    compiled = torch.compile(with_own_code(fn),
                             mode="reduce-overhead" if name == "cudagraphs" else None)
    way = quiet(compiled.forward if isinstance(fn, torch.nn.Module) else compiled)
    if name == "inductor":
        return way

    def cloned(*args: Any, **kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, torch.clone, way(*args, **kwargs))
    return cloned


def _switched_on(switch: WaySwitch, compiled: Callable, form: str) -> Callable:
    """A way of a shared trace: ``compiled`` with its graphs' ``form`` switched on."""
    def way(*args: Any, **kwargs: Any) -> Any:
        switch.form = form
        try:
            return compiled(*args, **kwargs)
        finally:
            switch.form = "autopar"
    return way


def _signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple | None:
    """What decides a call's plan, as far as autopar keys it: each tensor argument's shape,
    dtype and device (in lists and tuples too), each plain argument's value, and the grad
    mode. None (no key) for any other argument, or a tensor that autograd would record.
    (A plain call is eager's, so a key that misses something, such as strides, can only miss
    a speed-up, never change a result. It is kept cheap, one flat tuple (its cost a tensor:
    benchmarks/NOTES.md); a list or tuple adds its type and length before its items.)"""
    grad = torch.is_grad_enabled()
    key: list[Any] = [grad]
    if not _key_into(key, args, grad):
        return None
    if kwargs:
        key.append(tuple(kwargs))
        if not _key_into(key, kwargs.values(), grad):
            return None
    return tuple(key)


def _key_into(key: list[Any], values: Any, grad: bool) -> bool:
    add = key.append
    for v in values:
        if isinstance(v, torch.Tensor):
            if grad and v.requires_grad:
                return False
            add(v.shape)
            add(v.dtype)
            add(v.get_device())
        elif isinstance(v, PLAIN_VALUES):
            add(type(v))
            add(v)
        elif isinstance(v, list | tuple):
            add(type(v))
            add(len(v))
            if not _key_into(key, v, grad):
                return False
        else:
            return False
    return True


def _tensors_in(values: Sequence[Any], out: list[torch.Tensor]) -> bool:
    """Append the tensors of ``values`` (in lists and tuples too) to ``out`` in order; False if
    anything else is among them."""
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif not (isinstance(v, list | tuple) and _tensors_in(v, out)):
            return False
    return True


def _meta(t: torch.Tensor) -> tuple:
    """What :func:`_signature` keys a tensor by."""
    return (t.shape, t.dtype, t.get_device())


def _held(args: tuple) -> tuple[list[weakref.ref], list[tuple]] | None:
    """Weak references to the tensors of ``args`` (in lists and tuples too), in order, and
    each one's metadata, what :func:`_same_signature` compares a later call with; None where
    there are none or anything else is among them."""
    flat: list[torch.Tensor] = []
    if not args or not _tensors_in(args, flat):
        return None
    return [weakref.ref(a) for a in flat], [_meta(a) for a in flat]


def _same_signature(values: Sequence[Any], refs: Sequence[Any], metas: Sequence[tuple],
                    i: int, grad: bool) -> int:
    """Whether ``values`` (lists and tuples walked in order) have the signature of the tensors
    ``refs[i:]`` refer to: each value is that very tensor (compared by identity, allocating
    nothing) or a tensor with its shape, dtype and device (``metas``) that autograd would not
    record. The index after the last one, or -1."""
    n = len(refs)
    for v in values:
        if i < n and refs[i]() is v:  # a dead reference gives None
            i += 1
        elif isinstance(v, torch.Tensor):
            if i >= n or (grad and v.requires_grad) or _meta(v) != metas[i]:
                return -1
            i += 1
        elif isinstance(v, list | tuple):
            i = _same_signature(v, refs, metas, i, grad)
            if i < 0:
                return -1
        else:
            return -1
    return i


_grad_enabled = torch.is_grad_enabled


PLAIN_ENTRIES = 8
"""Argument layouts kept as eager that get a plain entry (:meth:`Dispatcher._plain_entry`)."""
PLAIN_SWITCHES = 16
"""Plain entries routed in turn after which none is any more: signatures that alternate make
each call miss the other's entry and route anew, slower than no entry at all (measured: see
benchmarks/NOTES.md)."""

_MISS = object()  # an argument not given (a plain entry's default)


class _Route:
    """What a :class:`Dispatcher`'s call runs: ``head`` (a :class:`Direct` is one too)."""

    __slots__ = ("head",)

    def __init__(self, head: Callable) -> None:
        self.head = head


def _transformed() -> bool:
    """Whether a ``torch.func`` transform or activation checkpointing's saved-tensor hooks
    (``torch.utils.checkpoint``'s, in its forward or its recomputation) are in force in this
    thread. Other hooks (``torch.autograd.graph.save_on_cpu``) see each call's tensors saved
    as any other way's, and are not counted."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


class _Unsettled:
    """A call :meth:`Dispatcher._settled` left to the lock (nothing of it ran): its key."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


class Dispatcher:
    """What :func:`compile` returns for a function (and puts in a module's ``forward``): each
    call goes the way the measured choice (:mod:`autopar.choose`) kept for its argument
    signature (:func:`_signature`; arguments that can't be keyed share one entry).

    A new signature goes through autopar first (``autopar``: capture, place, plan), so that
    the candidates can be pruned by what capture found; then, with more than one candidate,
    its next calls are a :class:`~autopar.choose.Trial`; the verdict is kept and logged.
    Once one compiled way serves every signature seen and no trial is open, calls go straight
    to it without a key (``only``): a new shape then runs that way, correctly, unchosen.
    Shapes that vary: past ``OWN_SIGNATURES`` signatures of one :class:`~autopar.choose.Family`
    (equal but for their tensors' sizes), a new signature is not captured: it runs the
    family's verdict, or its trial of :func:`~autopar.choose.family_ways` while undecided.

    A call with the very tensors of the latest plain (``eager``) call, held by weak
    references (in lists and tuples too: no other arguments, the same grad mode), is plain
    without building its key; a tensor that is not the same object is compared by what the
    key holds of it (shape, dtype, device; not one autograd records), so a new batch each
    call with the same weights checks one tensor's metadata. That check allocates nothing: an
    allocating one (``tuple(map(id, args))``) measured about ten times the identity loop's
    cost between a GPU workload's launches (benchmarks/NOTES.md, cf4708b). A tensor
    whose shape was changed in place (``resize_``) since keeps its signature: at most a
    missed choice, never a wrong result, since every way computes eager's function.
    """

    def __init__(self, fn: Callable, compiled: Callable, runner: Runner,
                 make_way: Callable[[str], Callable],
                 key_extra: Callable[[], Any] | None = None,
                 switch: WaySwitch | None = None,
                 split: DataParallelStep | None = None,
                 make_alone: Callable[[str], Callable] | None = None) -> None:
        self.fn = fn  #: the eager way: the function (or the module's ``__call__``) itself
        self.compiled = compiled  #: the autopar way
        self.runner = runner
        self._make_way = make_way  # builds a compiled way (inductor, cudagraphs) at first use
        # ...and a torch.compile of its own (_inductor_alone): a training call's cudagraphs way
        self._make_alone = make_alone or make_way
        self.switch = switch  # the shared trace's switch: inductor and cudagraphs are its forms
        self.split = split  # the split way: the call with its batch split (None: never)
        self.name = _name(fn)  # for the log and the profiler's ranges
        self._built: dict[str, Callable] = {}  # those ways, once built
        self.verdicts: dict[Any, list[str]] = {}  #: signature -> each trial's medians, in order
        #: signature -> [its first call's start, its calls so far], until its way is kept
        self._settling: dict[Any, list] = {}
        #: signature -> (calls, seconds) from its first call to its way kept (the trial's
        #: price, in ``explain``)
        self.settled: dict[Any, tuple[int, float]] = {}
        self.last_trial: Trial | None = None  #: the trial decided last (its calls' times)
        self.key_extra = key_extra  # what else decides a call's graphs (a module's .training)
        self.kept: dict[Any, str] = {}  #: signature -> the way that runs it
        self.trials: dict[Any, Trial] = {}  #: signature -> its open trial
        #: the function's steps (forwards before one backward), followed while a call is not
        #: kept: a step's calls run one way, whatever their signatures (:class:`Steps`)
        self.steps = Steps()
        #: the way every signature called under grad mode takes once a signature whose
        #: outputs autograd records was kept and the graphs write in place (None: not yet, or
        #: never needed)
        self.step_way: str | None = None
        #: family -> its signatures seen; the family's trial and verdict are keyed by the
        #: Family itself, in ``trials`` and ``kept``
        self.families: dict[Family, dict[Any, None]] = {}
        self._by_family: set[Any] = set()  # signatures kept as their family's verdict
        self._checked: set[tuple[Any, str]] = set()  # (signature, way) whose results were checked
        #: signature -> the stage of a training call's trials on a GPU ("first": eager's and
        #: autopar's; "graphs": CUDA graphs'; "no graphs": Inductor's after CUDA graphs
        #: failed or lost) and the GPUs its compiled ways touch (:meth:`_next_way`)
        self._later: dict[Any, tuple[str, frozenset[int]]] = {}
        #: what the function's capturing call changed besides its tensors (Python state, a
        #: random generator's), once seen: then no call is repeated to check its results
        self.impure: str | None = None
        self.only: Callable | None = None  #: the one way every call takes, once settled
        self._route: Any = _Route(self._call)  # what a call runs: its ``head`` (``__call__``)
        # the latest plain call: its grad mode, weak references to its tensors (in order),
        # and each tensor's metadata
        self._last_grad: bool | None = None
        self._last_refs: list[weakref.ref] = []
        self._last_metas: list[tuple] = []
        self._trial_refs: tuple[list, list] = ([], [])  # eager's turn in a trial: its tensors
        self._plain_entries: dict[Any, Callable] = {}  # kept-eager layouts -> their entries
        self._switches = 0  # plain entries routed in place of another (PLAIN_SWITCHES)
        self._said_beside = False  # _beside_autograd's warning given
        #: the optimizers the function steps, as built and as dynamo's trace left them: the
        #: eager way runs them as built (:mod:`autopar.capture.optim`); None: none found yet
        self.forms: OptimizerForms | None = None
        self._forms_looked = False
        # threads: one at a time past a kept way (capture, trial, verdict); where a split may
        # be captured (it swaps the module's parameters), no call in flight meanwhile
        self._lock = threading.RLock()
        self._gate = Gate() if split is not None else None
        functools.update_wrapper(self, fn)

    @property
    def plain_signatures(self) -> set:
        """The signatures whose calls are plain."""
        return {k for k, w in self.kept.items() if w == "eager"}

    def kept_way(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> str | None:
        """The way kept for calls with these arguments (None while undecided)."""
        if self.only is not None:  # one way serves every call
            return next(iter(self.kept.values()))
        return self.kept.get(self._key(args, kwargs or {}))

    def _key(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        key = _signature(args, kwargs)
        if key is not None and self.key_extra is not None:
            key = (*key, self.key_extra())
        return key

    def way(self, name: str) -> Callable:
        """The callable of way ``name``; where the function steps optimizers that dynamo
        changed, it first puts them in that way's form (eager's or the compiled code's)."""
        way = self._way(name)
        forms = self.forms
        if forms is None:
            return way
        enter = forms.eager if name == "eager" else forms.compiled

        def in_form(*args: Any, **kwargs: Any) -> Any:
            enter()
            return way(*args, **kwargs)
        return in_form

    def _as_kept(self, name: str) -> Callable:
        """Way ``name``'s callable as a call kept on it enters it (what a trial times): a
        Direct (``guards="arguments"``) at its head, as the Dispatcher's route does, past the
        Direct's own frame (about a seventh of a one-op call); eager after the check a plain
        call pays (:meth:`_plain_checked`). Tiny calls are decided by less than a
        microsecond, so a trial that timed another path than the kept one ranked them the
        wrong way round (measured: see benchmarks/NOTES.md)."""
        if name == "eager":
            return self._plain_checked
        way = self.way(name)
        return way.head if isinstance(way, Direct) else way

    def _plain_checked(self, *args: Any, **kwargs: Any) -> Any:
        """Eager's way after the check a repeated call of a signature kept as eager pays
        (its tensors against the latest plain call's, here the same ones: ``_trial_refs``)."""
        refs, metas = self._trial_refs
        _same_signature(args, refs, metas, 0, _grad_enabled())
        return self.way("eager")(*args, **kwargs)

    def _way(self, name: str) -> Callable:
        if name == "eager":
            return self.fn
        if name == "autopar":
            return self.compiled
        if name == "split" and self.split is not None:
            return self.split
        if name == "cudagraphs" and not self._inference():
            # the shared trace replays inference graphs only (GraphedCall): a training call's
            # CUDA graphs are cudagraph trees', torch.compile(mode="reduce-overhead") of its own
            name, build = "cudagraphs (training)", functools.partial(self._make_alone,
                                                                    "cudagraphs")
        else:
            build = functools.partial(self._make_way, name)
        way = self._built.get(name)
        if way is None:
            way = self._built[name] = build()
        return way

    # A call is a call of ``self._route.head``: ``__call__`` is a property whose getter is C
    # (CPython's call slot binds a class's ``__call__`` through its descriptor, then calls
    # what that returns), so a settled call enters its way with no frame of the Dispatcher's
    # (a frame's cost saved on every call: see benchmarks/NOTES.md). The route is ``_call``
    # until one way serves every call (``_keep``): then that way, or, for a Direct, the Direct
    # itself, whose ``head`` is always its latest entry.
    __call__ = property(operator.attrgetter("_route.head"))

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        gate = self._gate
        if gate is None:
            out = self._settled(args, kwargs)
        else:  # a split's capture in another thread swaps the module: not meanwhile
            gate.enter()
            try:
                out = self._settled(args, kwargs)
            finally:
                gate.leave()
        if type(out) is not _Unsettled:
            return out
        with self._lock:  # one thread at a time captures, tries and decides
            return self._unsettled(out.key, args, kwargs)

    def _settled(self, args: tuple, kwargs: dict) -> Any:
        """A call of a signature whose way is kept, else its :class:`_Unsettled` (a kept one's
        too while the steps follow kept calls: :meth:`_following`)."""
        refs = self._last_refs
        if refs and not kwargs and self._last_grad == _grad_enabled() and \
                _same_signature(args, refs, self._last_metas, 0, self._last_grad) == len(refs):
            if self.forms is not None:
                self.forms.eager()
            return self.fn(*args)  # the latest plain call's tensors, or new ones like them
        key = self._key(args, kwargs)
        way = self.kept.get(key)
        if way is not None and self._following():
            return _Unsettled(key)
        if way == "eager":
            return self._plain(args, kwargs, remember=key is not None)
        if way is not None:
            return self.way(way)(*args, **kwargs)
        return _Unsettled(key)

    def _unsettled(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """A call of a signature not kept yet: its trial's, its family's, or its capture. A
        call that begins a step first takes the verdicts of the trials of calls autograd
        records (:meth:`_step_verdicts`)."""
        if self.only is not None or (key in self.kept and not self._following()):
            return self._kept_call(key, args, kwargs)  # (decided while this thread waited)
        if _transformed():
            return self._beside_autograd(args, kwargs)
        settling = self._settling.get(key)
        if settling is not None:
            settling[1] += 1
        steps, grad = self.steps, _grad_enabled()
        if grad:  # (a call under no_grad does not count towards a step's calls)
            steps.begin()
            if steps.new:
                self._step_verdicts(args, kwargs)
        if self.only is not None:
            return self.only(*args, **kwargs)
        within = steps.way is not None and steps.within()
        if key in self.kept:  # followed: it may begin a step another signature's trial is in,
            way = steps.way if within else self.kept[key]  # or fall within one (a step's
            out = self._run(way, args, kwargs)  # calls run one way)
            steps.called(way, Backward.of(out, ()))
            return out
        trial = self.trials.get(key)
        if trial is not None:
            return self._tried(key, trial, args, kwargs)
        if self.runner.writes and (within or (self.step_way is not None and
                                              self._in_steps(key))):
            return self._in_step(key, args, kwargs)
        family = self._varying(key)
        if family is not None:
            return self._in_family(key, family, args, kwargs)
        runner = self.runner
        first = len(runner.executors)
        if not self._forms_looked and _grad_enabled() and dynamo_changes_optimizers():
            self._forms_looked = True  # the optimizers as built, before dynamo traces them
            self.forms = OptimizerForms.of(self.fn, args)
            if self.forms is not None:  # plain calls switch forms: through _call from now on
                self._route = _Route(self._call)
        if self.forms is not None:
            self.forms.compiled()
        self._settling.setdefault(key, [time.perf_counter(), 1])
        failed = None
        try:  # what the capture needs of the arguments (a sparse tensor has no strides)
            before = self._versions(args, kwargs)
            places = self._places() if self.impure is None else None  # (once a signature)
            world = None if places is None else pystate.world(places, (args, kwargs))
        except Exception as e:  # (eager's call runs outside this handler: its own traceback)
            failed = e
        if failed is not None:  # nothing of the call ran yet: eager may run it
            return self._eager_instead(key, failed, args, kwargs)
        # an error of the capturing call itself is raised as it is: part of the call may
        # have run (before a graph break), so it is not run again
        out = self.compiled(*args, **kwargs)  # a new signature: autopar captures it first
        back = Backward.of(out, ())
        steps.called("autopar", back)
        if places is not None and pystate.world(places, (args, kwargs)) != world:
            self.impure = "the call changes Python state or draws from a random generator"
            trials_log.info("autopar: %s: %s: its calls are not repeated to check them",
                            self.name, self.impure)
        # under guards="arguments" autopar's way skips dynamo (capture.direct): a way of its
        # own even where its graphs are eager's ops (W1: dynamo already folded the bounds)
        ways = candidates(autopar_differs=bool(runner.planned or runner.folded
                                               or isinstance(self.compiled, Direct)),
                          inductor_can=runner.inductor_can)
        ways = tuple(w for w in ways if w in runner.options.candidates and w != "cudagraphs")
        if self.switch is not None and self.switch.failed is not None and "inductor" in ways:
            trials_log.warning("autopar: %s: the inductor way is left out: Inductor failed on "
                               "a graph (%s)", self.name, self.switch.failed)
            ways = tuple(w for w in ways if w != "inductor")
        if self._repeatable() and self._versions(args, kwargs) == before:
            # the capturing call's results (autopar's) are eager's?
            # (dynamo's trace of TransformerEncoder skips eager's fast path, whose padded
            # rows are zeros); each way's first trial call is checked again, as it runs there
            want = self.fn(*args, **kwargs)
            off = results_differ(out, want, low_precision=any_autocast_enabled())
            if off is not None:
                trials_log.warning("autopar: %s: the capturing call's results are not eager's "
                                   "(%s): eager's are returned, and autopar's way is left out "
                                   "for %s", self.name, off, _describe(key))
                out = want
                ways = tuple(w for w in ways if w != "autopar") or ("eager",)
                self.verdicts.setdefault(key, []).append(
                    f"autopar left out (the capturing call's results differ from eager's: "
                    f"{off})")
            del want
        # no call of the module in flight while a split's capture swaps its parameters
        with self._gate.exclusive() if self._gate is not None else contextlib.nullcontext():
            split = self._split_candidate(key, args, kwargs, runner.executors[first:])
        if split is not None:
            ways = (*ways, "split")
        eager_gpus, ours = self._trial_gpus(args, kwargs) if len(ways) > 1 else ((), ())
        if eager_gpus and "inductor" in ways and "cudagraphs" in runner.options.candidates \
                and not self._inference():
            # a training call on a GPU: Inductor's form, or its CUDA graphs, after eager's
            # calls say which (_next_way): a form never tried is never lowered
            ways = tuple(w for w in ways if w != "inductor")
            self._later[key] = ("first", eager_gpus)
        if ways == ("inductor",) and self.switch is not None:
            failures = self.switch.failures
            self.switch.compile_pending()  # kept untimed: whether Inductor fails, known now
            if self.switch.failures > failures:
                trials_log.warning("autopar: %s: the inductor way is left out: Inductor failed "
                                   "on a graph (%s)", self.name, self.switch.last_failure)
                ways = ()
        if len(ways) <= 1 and key not in self._later:
            trials_log.debug("autopar: %s: %s runs %s: nothing else to try", self.name,
                             _describe(key), ways[0] if ways else "autopar")
            if back is not None and runner.writes:
                self._one_way_for_steps(key, ways[0] if ways else "autopar")
            self._keep(key, ways[0] if ways else "autopar")
        else:
            gpus = {w: ours if w == "autopar" else eager_gpus for w in ways}
            if split is not None:
                gpus["split"] = split
            self._open(key, Trial(gpus, name=self.name, steps=self.steps))
            trials_log.info("autopar: %s: timing calls %s for %s", self.name,
                            ", ".join(ways), _describe(key))
        return out

    def _eager_instead(self, key: Any, error: Exception, args: tuple, kwargs: dict) -> Any:
        """A new signature whose capture could not begin (its arguments' metadata raised):
        eager's call, and eager kept for it, where eager succeeds, said once; where eager
        raises too, eager's own error."""
        out = self.fn(*args, **kwargs)
        reason = f"{type(error).__name__}: {first_line(error)}"
        trials_log.warning("autopar: %s: capturing %s failed where eager runs (%s); it runs "
                           "eagerly", self.name, _describe(key), reason)
        self.verdicts.setdefault(key, []).append(
            f"eager (autopar's capture failed where eager runs: {reason})")
        self._keep(key, "eager")
        self.steps.called("eager", Backward.of(out, ()))
        return out

    def _kept_call(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """A call of a signature kept (or of any, where one way serves every call)."""
        if self.only is not None:
            return self.only(*args, **kwargs)
        return self._run(self.kept[key], args, kwargs)

    def _run(self, way: str, args: tuple, kwargs: dict) -> Any:
        """A call run ``way``, past the Dispatcher's keyed paths (eager's: :meth:`_plain`)."""
        if way == "eager":
            return self._plain(args, kwargs, remember=False)
        return self.way(way)(*args, **kwargs)

    def _step_verdicts(self, args: tuple, kwargs: dict) -> None:
        """As a call begins a step, the verdicts of the open trials whose calls autograd
        recorded, kept where they have one: a verdict kept within a step would run the step's
        later forwards the winner, its first ones another way (:class:`~autopar.choose.Steps`)."""
        for key, trial in list(self.trials.items()):
            if trial.recorded and self.trials.get(key) is trial:
                self._verdict(key, trial, None, args, kwargs, check=False)

    def _open(self, key: Any, trial: Trial) -> None:
        """``trial`` opens for ``key``; where the steps now follow kept calls (:meth:`_following`),
        the plain fast paths are taken off."""
        self.trials[key] = trial
        if self._following():
            self._route = _Route(self._call)
            self._last_refs = []

    def _in_steps(self, key: Any) -> bool:
        """Whether calls of signature ``key`` may fall within steps, so take the steps' way
        (``step_way``) where a graph writes in place: under grad mode, or of a module in
        training mode (a no_grad forward between a step's forward and its backward writes
        batch norm's running statistics too); a call that can't be keyed holds a tensor that
        requires grad."""
        return key is None or key[0] is True or (self.key_extra is not None and
                                                  key[-1] is True)

    def _following(self) -> bool:
        """Whether the steps follow kept signatures' calls too: while a trial is open, where
        the graphs write in place (a kept eager forward then a trial's compiled call in one
        step fails the backward; :class:`~autopar.choose.Steps`). Their plain fast paths
        (the latest plain call's tensors, a plain entry) are then off (:meth:`_plain`)."""
        return bool(self.trials) and self.runner.writes

    def _in_step(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """A new signature's call, of a function whose graphs write in place (batch norm's
        running statistics: where none does, ways mix in a step safely, and each signature
        keeps a way of its own), where its way is its steps': the way every signature under
        grad mode, or within a step, takes (``step_way``, once there is one), kept; else,
        within a step another call began, that call's way, nothing captured or kept (a
        capture runs autopar's way: compiled code, whose writes after an eager forward of the
        step fail its backward, under no_grad too). Its signature is captured at a call
        outside a step, or takes ``step_way`` once there is one (gradient accumulation's
        smaller last micro-batch is never outside one)."""
        way = self.step_way
        if way is not None:
            self.verdicts.setdefault(key, []).append(
                f"{way} (the way of every forward of this function's steps)")
            self._keep(key, way)
        else:
            way = self.steps.way
        out = self._run(way, args, kwargs)
        self.steps.called(way, Backward.of(out, ()))
        return out

    def _trial_gpus(self, args: tuple, kwargs: dict) -> tuple[frozenset[int], frozenset[int]]:
        """The GPUs a trial times for eager's and Inductor's calls, and for autopar's: those
        the graphs touch, and those holding the call's tensors (a graph dynamo handed
        autopar that it ran eagerly, as it can't represent it, is in no plan: timed by the
        plans' GPUs alone, HF text models under bf16 autocast, whose cuDNN attention returns
        sequence lengths, went untimed on the GPU, so their launch-bound calls never tried CUDA
        graphs)."""
        runner = self.runner
        touched = runner.gpus_touched()
        eager, ours = touched if touched is not None else (runner.gpus, runner.gpus)
        held = cuda_indices(str(t.device) for t in tree_flatten((args, kwargs))[0]
                            if isinstance(t, torch.Tensor))
        return eager | held, ours | held

    def _beside_autograd(self, args: tuple, kwargs: dict) -> Any:
        """A new signature's call under a ``torch.func`` transform or activation
        checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``): eager's,
        nothing captured or tried. A trial's next call may take another way than this one,
        and checkpoint's recomputation of the call must save what its forward saved (another
        way saved other tensors: CheckpointError); capture's snapshot of the random
        generators fails under a transform. A signature kept from calls outside them serves
        these too."""
        if not self._said_beside:
            self._said_beside = True
            trials_log.warning(
                "autopar: %s: calls under activation checkpointing or a "
                "torch.func transform run eagerly until calls outside them have chosen a way; "
                "to compile a checkpointed block, compile the function that calls "
                "checkpoint", self.name)
        return self._plain(args, kwargs, remember=False)

    def _varying(self, key: Any) -> Family | None:
        """The family of a new signature ``key`` where that family's sizes vary (it has had
        ``OWN_SIGNATURES`` signatures before this one) and a way of its own can serve it
        (:func:`~autopar.choose.family_ways` among the candidates), else None: ``key`` is
        captured and tried on its own."""
        if key is None:
            return None
        family = family_of(key)
        seen = self.families.setdefault(family, {})
        seen[key] = None
        if len(seen) <= OWN_SIGNATURES or not self._family_ways():
            return None
        return family

    def _family_ways(self) -> tuple[str, ...]:
        inductor = self.runner.inductor_can and (self.switch is None or
                                                 self.switch.failed is None)
        return tuple(w for w in family_ways(inductor) if w in self.runner.options.candidates)

    def _in_family(self, key: Any, family: Family, args: tuple, kwargs: dict) -> Any:
        """A new signature of a family whose sizes vary: its verdict, else its trial."""
        way = self.kept.get(family)
        if way is None and family not in self.trials:
            ways = self._family_ways()
            trials_log.info("autopar: %s: %s: the sizes vary; new ones run %s", self.name,
                            self._describe_family(family), " or ".join(ways))
            if len(ways) == 1:
                way = ways[0]
                self.verdicts[family] = [f"{way} (the only way for any size)"]
                self._keep(family, way)
            else:
                gpus = self._trial_gpus(args, kwargs)[0]
                self._open(family, Trial({w: gpus for w in ways}, name=self.name,
                                         steps=self.steps))
        if way is None:
            return self._tried(family, self.trials[family], args, kwargs)
        self._by_family.add(key)
        self._keep(key, way)  # its next calls are a kept signature's
        if way == "eager":
            return self._plain(args, kwargs, remember=True)
        return self.way(way)(*args, **kwargs)

    def _plain(self, args: tuple, kwargs: dict, remember: bool) -> Any:
        """A call of a signature kept as eager: the function itself, its optimizers as built;
        its tensors remembered (``remember``, no keyword arguments) for the next call's check,
        and the route set to the signature's plain entry where it has one (:meth:`_plain_entry`)."""
        if remember and not kwargs and not self._following():
            self._remember(args)
            if self.only is None and self.forms is None and self._gate is None and \
                    self._switches < PLAIN_SWITCHES:
                entry = self._plain_entry(args)
                if entry is not None:
                    head = self._route.head  # another signature's entry missed: a switch
                    self._switches += head is not entry and head != self._call
                    self._route = _Route(entry if self._switches < PLAIN_SWITCHES
                                         else self._call)
        if self.forms is not None:
            self.forms.eager()
        return self.fn(*args, **kwargs)

    def _split_candidate(self, key: Any, args: tuple, kwargs: dict,
                         executors: Sequence[Any]) -> frozenset[int] | None:
        """The GPU indices the split way touches where it is worth a trial, else None, and
        then, where two or more devices of the batch's kind are named, why not (in the
        signature's verdicts: ``explain`` says it; a call predicted too short to split only
        where the candidates were named, not ``"auto"``: every small call would say it).

        Tried for inference calls (grad off, or no graph reading a tensor that requires grad:
        a frozen model under grad mode; no graph writing in place) whose graphs the model
        predicts at ``SPLIT_MIN_S`` or more a call, with two or more devices of the batch's
        kind named; the split's own plan (:func:`autopar.passes.dataparallel.choose`: unsplit
        and split over k devices, the fastest predicted kept) must predict a split. Capture and
        planning cost seconds on a big model: the first call of such a signature pays them."""
        split = self.split
        if split is None:
            return None
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if _of_kind(self.runner.options.devices,
                    tensors[0].device.type if tensors else None) < 2:
            return None
        predicted = sum(e.plan.placement.predicted_s for e in executors)
        if predicted < SPLIT_MIN_S:
            why: Any = (f"the call is predicted at {fmt_seconds(predicted)}, under the "
                        f"{fmt_seconds(SPLIT_MIN_S)} a split needs to pay for its copies")
            said = self.runner.options.candidates != WAYS
        else:
            why, said = self._not_split(split, args, kwargs), True
        if isinstance(why, str):
            if said:
                self.verdicts.setdefault(key, []).append(f"split not tried ({why})")
            return None
        return cuda_indices([*why.sharded.devices, *(str(t.device) for t in tensors)])

    def _not_split(self, split: Any, args: tuple, kwargs: dict) -> Any:
        """Why this call, long enough, is not split (a phrase), else its split's compiled
        form."""
        if not self._inference():
            return "not an inference call: it reads tensors that require grad"
        if self.runner.writes:
            return "the call writes a tensor in place"
        try:
            compiled = split.prepare(*args, **kwargs)
        except (TypeError, ValueError) as e:  # no batch to split (batch_inputs, shard_devices)
            return f"{type(e).__name__}: {first_line(e)}"
        if isinstance(compiled, str):
            return compiled
        if compiled.sharded is None:
            return "the split's plan predicts no split faster than one device"
        return compiled

    def _tried(self, key: Any, trial: Trial, args: tuple, kwargs: dict) -> Any:
        way = trial.next_way()
        check = way not in (None, "eager") and (key, way) not in self._checked
        before = self._versions(args, kwargs) if check else None
        failures = self.switch.failures if self.switch is not None else 0
        try:
            if way == "eager":  # the tensors a kept call's check compares (see _as_kept)
                self._trial_refs = (None if kwargs else _held(args)) or ([], [])
            out = trial.run(self._as_kept, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # failed compiling: nothing ran
            way = trial.ran
            if way in (None, "eager"):
                raise
            trial.drop(way, f"{type(e).__name__}: {first_line(e)}")
            trials_log.warning("autopar: %s: the %s way failed where eager does not, and is "
                               "left out: %s", self.name, way, trial.dropped[way])
            out = self.fn(*args, **kwargs)
        way = trial.ran  # the way called: a switch may wait out a step's forwards
        if self.switch is not None and self.switch.failures > failures and \
                way in ("inductor", "cudagraphs") and way not in trial.dropped:
            # Inductor failed on a graph this call ran (its form is compiled at its first
            # call: capture.dynamo's _Deferred), which ran autopar's form instead
            trial.drop(way, f"Inductor failed on a graph ({self.switch.last_failure})")
            trials_log.warning("autopar: %s: the %s way is left out: %s", self.name, way,
                               trial.dropped[way])
        if check and way not in trial.dropped and self._repeatable():
            # a first call that can be repeated: eager's?
            self._checked.add((key, way))
            if self._versions(args, kwargs) != before:  # it wrote a tensor: not repeatable
                return self._verdict(key, trial, out, args, kwargs)
            why, want = self._wrong(way, out, args, kwargs)
            if why is not None:
                trial.drop(way, why)
                trials_log.warning("autopar: %s: the %s way is left out: %s", self.name, way,
                                   why)
                out = want
                live = [w for w in trial.ways if w not in trial.dropped]
                if len(live) == 1:  # nothing left to compare: kept at once
                    del self.trials[key]
                    self.verdicts.setdefault(key, []).append(f"{live[0]} ({trial.summary()})")
                    self._keep(key, live[0])
                    return out
        return self._verdict(key, trial, out, args, kwargs)

    def _repeatable(self) -> bool:
        """Whether calling the function again on this call's arguments gives the same results:
        an inference call whose graphs neither write in place nor draw random numbers, of a
        function whose capturing calls changed no Python state and drew from no generator
        (:func:`autopar.capture.pystate.world`: a module that keeps state between calls,
        ``random.random()``, a ``torch.Generator`` argument)."""
        return self.impure is None and self._inference() and not self.runner.writes and \
            not self.runner.random

    def _places(self) -> list:
        """Where the function may keep Python state (:func:`autopar.capture.pystate.watch`):
        its free values, and a module's forward's and the module's own attributes."""
        owner = getattr(self.fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return pystate.watch(owner.forward, [("self", owner)])
        return pystate.watch(self.fn, [])

    def _wrong(self, way: str, out: Any, args: tuple, kwargs: dict,
               eager: bool = True) -> tuple[str | None, Any]:
        """Why ``way``'s result ``out`` of this call is not to be trusted, and then eager's
        result (``eager``: else None), or (None, None): it differs from eager's
        (:func:`results_differ`), or a second call of the way on the same arguments differs
        from the first by more than ``RESULT_TOL`` (a 16-bit output ``RESULT_TOL_LOW``): a
        race, not rounding (torch 2.11: ``torch.compile``'s code for HF's ViT under bf16
        autocast gave other values on each call, where its fp32 code and eager were bitwise
        steady; see benchmarks/NOTES.md). No more than two results are alive at once (a big
        model's logits)."""
        want = self.fn(*args, **kwargs)
        why = results_differ(out, want, low_precision=any_autocast_enabled())
        if why is not None:
            return f"its results differ from eager's: {why}", want
        del want
        before = self._versions(args, kwargs)
        again = self.way(way)(*args, **kwargs)
        if self._versions(args, kwargs) != before:
            return None, None
        why = results_differ(again, out)
        del again
        if why is None:
            return None, None
        return (f"its results vary from call to call on the same arguments: {why}",
                self.fn(*args, **kwargs) if eager else None)

    def _differs_now(self, way: str, args: tuple, kwargs: dict) -> str | None:
        """Why the trial's winner is not to be trusted on this call's arguments (``_wrong``),
        or None (it is, or the call can't be repeated): checked again when kept, not only on
        the way's first call (Inductor's form of a bf16 ViT was right on its first call and off
        after a trial: see benchmarks/NOTES.md)."""
        if way == "eager" or not self._repeatable():
            return None
        before = self._versions(args, kwargs)
        got = self.way(way)(*args, **kwargs)
        if self._versions(args, kwargs) != before:
            return None
        return self._wrong(way, got, args, kwargs, eager=False)[0]

    def _verdict(self, key: Any, trial: Trial, out: Any, args: tuple, kwargs: dict,
                 check: bool = True) -> Any:
        """The trial's verdict, where it has one, kept (or its next trial begun); ``out``
        returned. ``check``: the winner's results checked once more on ``args``, the call of
        ``key`` just made (:meth:`_differs_now`); not for another signature's call."""
        won = trial.verdict()
        why = None if won is None or not check else self._differs_now(won, args, kwargs)
        if why is not None:
            trial.drop(won, f"when kept, {why}")
            trials_log.warning("autopar: %s: the %s way is left out at the end of its trial: "
                               "%s", self.name, won, why)
            trial.times.pop(won, None)
            won = min(trial.times, key=lambda w: (statistics.median(trial.times[w]),
                                                  trial.ways.index(w))) \
                if trial.times else "eager"  # the function itself is right whatever was tried
        if won is not None:
            del self.trials[key]
            trials_log.info("autopar: %s: %s kept for %s (medians: %s)", self.name, won,
                            self._describe(key), trial.summary())
            self.verdicts.setdefault(key, []).append(f"{won} ({trial.summary()})")
            self.last_trial = trial
            nxt = None if isinstance(key, Family) else self._next_way(key, trial, won)
            if nxt is not None:
                way, gpus = nxt
                self._open(key, Trial({won: trial.gpus[won], way: gpus}, name=self.name,
                                      steps=self.steps))
                return out
            if _profiler._is_profiler_enabled:  # the verdict, as a mark in the profiler's trace
                with _range(f"autopar:verdict {self.name} {won}"):
                    pass
            if isinstance(key, Family):
                self._adopt(key, won)
            if trial.recorded and self.runner.writes:
                self._one_way_for_steps(key, won)
            self._keep(key, won)
        return out

    def _one_way_for_steps(self, key: Any, way: str) -> None:
        """A signature whose calls autograd records is kept, by a trial or as its only
        candidate, and the function's graphs write in place: ``way`` runs every signature's
        calls that may fall within steps (:meth:`_in_steps`) from now on, so that no step
        mixes ways (:class:`~autopar.choose.Steps`; a kept signature's calls are not
        followed); the open trials of such signatures end with it, and those kept
        otherwise take it. (A step of several signatures, each
        with a way of its own, failed in the backward on every step where eager's came
        first.)"""
        self.step_way = way
        others = [k for k, t in self.trials.items() if t.recorded or self._in_steps(k)]
        others += [k for k, w in self.kept.items() if w != way and self._in_steps(k)]
        for other in others:
            if other == key:
                continue
            self.trials.pop(other, None)
            self._later.pop(other, None)
            trials_log.info("autopar: %s: %s takes %s, the way of the steps it shares with %s",
                            self.name, self._describe(other), way, self._describe(key))
            self.verdicts.setdefault(other, []).append(
                f"{way} (the way of every forward of this function's steps)")
            self._keep(other, way)

    def _adopt(self, family: Family, way: str) -> None:
        """A family's first signatures whose own trials still wait for calls take the family's
        verdict: where sizes vary, one size seldom comes back, and its trial's eager calls
        and the Dispatcher's keyed path (no single way) would last for good (BERT, lengths
        64-128: a captured length came back 4 times in 240 calls)."""
        for member in self.families.get(family, ()):
            if member in self.trials and member not in self.kept:
                del self.trials[member]
                trials_log.info("autopar: %s: %s takes its family's verdict, %s, before its "
                                "own trial ended", self.name, self._describe(member), way)
                self._by_family.add(member)
                self._keep(member, way)

    def timelines(self) -> list[Timeline]:
        """The latest measured timeline of each graph of autopar's way, in capture order: what
        ``trace=True`` records (empty without ``trace``). Each is one call's ops and copies on
        each device's lanes, with their start and end
        (:func:`autopar.report.trace.save_chrome_trace` writes one for Perfetto,
        :func:`~autopar.report.trace.save_gantt` draws one)."""
        return [ex.last_timeline for ex in self.runner.executors
                if ex.last_timeline is not None]

    def explain(self) -> str:
        """What runs each argument signature seen: the way kept and each trial's medians (a
        second trial where Inductor's calls were launch-bound), or the trial in progress."""
        if not self.kept and not self.trials:
            return f"{self.name}: not called yet"
        lines = []
        for key, way in self.kept.items():
            if key in self._by_family:
                continue  # said once, on its family's line
            why = "; then ".join(self.verdicts.get(key, [])) or "the only candidate"
            settled = self.settled.get(key)
            took = f"; settled in {settled[0]} call{'s' * (settled[0] != 1)}, " \
                f"{settled[1]:.2f} s" if settled else ""
            lines.append(f"{self.name}, {self._describe(key)}: runs {way}: {why}{took}")
        for key, trial in self.trials.items():
            done = "; ".join(self.verdicts.get(key, []))
            lines.append(f"{self.name}, {self._describe(key)}: timing {', '.join(trial.ways)}"
                         + (f" (after {done})" if done else ""))
        if self.only is not None and len(self.kept) > 1:
            lines.append(f"{self.name}: every call runs {next(iter(self.kept.values()))} (one "
                         "way for all: later signatures are not keyed)")
        if isinstance(self.compiled, Direct) and self.compiled.entries:
            lines.append(f"  guards='arguments': {self.compiled.describe()}")
        if "split" in self.kept.values() and self.split is not None:
            lines.append(self.split.explain())
        failed = self.switch.failed if self.switch is not None else None
        if failed:
            lines.append(f"  Inductor failed on a graph: {failed}")
        forms = self.forms.describe() if self.forms is not None else None
        if forms:
            lines.append(forms)
        return "\n".join(lines)

    def _describe(self, key: Any) -> str:
        return self._describe_family(key) if isinstance(key, Family) else _describe(key)

    def _describe_family(self, family: Family) -> str:
        """A family for the log: each tensor's sizes over the signatures seen (``(2, 8..38)``),
        and how many of them ran the family's verdict."""
        seen = [[k for k in key if isinstance(k, torch.Size)]
                for key in self.families.get(family, ())]
        shapes = []
        for sizes in zip(*seen):
            dims = [sorted({s[d] for s in sizes}) for d in range(len(sizes[0]))]
            shapes.append("(" + ", ".join(str(v[0]) if len(v) == 1 else f"{v[0]}..{v[-1]}"
                                          for v in dims) + ")")
        served = sum(k in self._by_family for k in self.families.get(family, ()))
        return (f"shapes {', '.join(shapes)} that vary" if shapes else "these arguments") + \
            (f" ({served} signatures ran its verdict)" if served else "")

    def _versions(self, args: tuple, kwargs: dict) -> list[tuple]:
        """The version counter and layout of every tensor a call could write in place: its
        arguments (in containers too) and, for a module, its parameters and buffers. A call
        that changed one (aot_autograd's epilogue, an eager fallback's in-place op, an
        ``unsqueeze_`` of an argument) must not be repeated to check its results."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        owner = getattr(self.fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            tensors += [*owner.parameters(), *owner.buffers()]
        return [(pystate.version_of(t), t.shape, t.stride(), t.storage_offset())
                for t in tensors]

    def _next_way(self, key: Any, trial: Trial, won: str) -> tuple[str, frozenset[int]] | None:
        """The way a decided trial's winner ``won`` is timed against next, and the GPUs it
        touches, or None: the trial is the last (see :mod:`autopar.choose`).

        A training call on a GPU is tried first without Inductor (``_later``). Where eager's
        calls were launch-bound, Inductor's code as CUDA graphs comes next (cudagraph trees:
        one lowering, where Inductor's form and then its graphs would be two); where they
        were not, or the CUDA graphs failed or lost, Inductor's form. After a trial of
        Inductor's form whose calls were launch-bound, its CUDA graphs
        (:meth:`_graphs_may_pay`), unless they were tried already."""
        later = self._later.pop(key, None)
        if later is not None:
            stage, gpus = later
            # (the way, why, and the stage after its trial: None goes on as after any trial
            # of Inductor's form)
            if stage == "first" and launch_bound(trial, "eager"):
                way, why, then = "cudagraphs", "eager's calls are launch-bound", "graphs"
            elif stage == "first":
                way, why, then = "inductor", "eager's calls are not launch-bound", None
            elif stage == "graphs" and "cudagraphs" in trial.dropped:
                way, why, then = "inductor", "its CUDA graphs failed", "no graphs"
            elif stage == "graphs" and won != "cudagraphs":  # re-recorded, copies: try plain
                way, why, then = ("inductor", f"its CUDA graphs were slower than {won}",
                                  "no graphs")
            else:  # CUDA graphs timed and kept; or Inductor's form after them: not again
                return None
            if then is not None:
                self._later[key] = (then, gpus)
            trials_log.info("autopar: %s: %s: timing Inductor's %s against %s", self.name, why,
                            "code as CUDA graphs" if way == "cudagraphs" else "form", won)
            return way, gpus
        if self._graphs_may_pay(trial):
            host, gpu = (fmt_seconds(statistics.median(t["inductor"]))
                         for t in (trial.host, trial.gpu))
            trials_log.info("autopar: %s: Inductor's calls are launch-bound (host %s, GPU "
                            "%s a call): timing them as CUDA graphs against %s", self.name,
                            host, gpu, won)
            return "cudagraphs", trial.gpus["inductor"]
        return None

    def _graphs_may_pay(self, trial: Trial) -> bool:
        """Whether a decided trial calls for a second one, of its winner against CUDA graphs
        of Inductor's code (see :mod:`autopar.choose`): Inductor's calls were launch-bound,
        and the call is an inference one whose graphs write nothing in place (the shared
        trace's replay) or a training one (cudagraph trees, which keep parameters, buffers and
        optimizer state as static inputs written in place)."""
        return "cudagraphs" not in trial.ways and "inductor" in trial.times and \
            "cudagraphs" in self.runner.options.candidates and \
            (not self._inference() or not self.runner.writes) and \
            launch_bound(trial, "inductor")

    def _inference(self) -> bool:
        """Whether this call is an inference one: grad off, or every graph captured so far an
        inference graph of aot_autograd's (under grad mode, nothing it read required grad:
        a model whose parameters have none)."""
        return not _grad_enabled() or (self.runner.graphs > 0 and not self.runner.training)

    def _keep(self, key: Any, way: str) -> None:
        self.kept[key] = way
        settling = self._settling.pop(key, None)
        if settling is not None:
            self.settled[key] = (settling[1], time.perf_counter() - settling[0])
        if way != "eager":  # a plain entry routes eager's layouts only: _plain sets it again
            self._route = _Route(self._call)
        if not self.trials and len(set(self.kept.values())) == 1 and way != "eager":
            self.only = self.way(way)  # one compiled way serves every call: no key needed
            self._route = self.only if isinstance(self.only, Direct) else _Route(self.only)

    def _plain_entry(self, args: tuple) -> Callable | None:
        """A generated function that calls the function itself where its arguments have
        ``args``' layout (dynamo's ``TensorGuards``: shape, strides, dtype, device,
        ``requires_grad``), under the same grad mode (and module ``training``), else goes
        the Dispatcher's way: a kept-eager call's check in C, one frame (cheaper than
        :func:`_same_signature`'s loop; measured: see benchmarks/NOTES.md). One per signature
        (at most ``PLAIN_ENTRIES``); None for arguments other than strided tensors (a sparse
        one has no strides to check)."""
        if not args or len(args) > 32 or not all(
                type(a) is torch.Tensor and a.layout is torch.strided for a in args):
            return None
        key = tuple((a.shape, a.stride(), a.dtype, a.device, a.requires_grad) for a in args)
        extra = self.key_extra() if self.key_extra is not None else None
        key = (torch.is_grad_enabled(), extra, key)
        entry = self._plain_entries.get(key)
        if entry is None and len(self._plain_entries) < PLAIN_ENTRIES:
            given = ", ".join(f"a{i}" for i in range(len(args)))
            namespace = {"_MISS": _MISS, "_grad": torch.is_grad_enabled, "_call": self._call,
                         "_fn": self.fn, "_extra": self.key_extra, "_match": layout_check(args)}
            also = f"_extra() != {extra!r} or " if self.key_extra is not None else ""
            header, came, miss = positional_entry("plain", len(args), "_call")
            exec(f"{header}\n    if {came}_grad() is not {key[0]} or {also}not _match({given}):"
                 f"\n{miss}\n    return _fn({given})\n", namespace)
            entry = self._plain_entries[key] = namespace["plain"]
        return entry

    def _remember(self, args: tuple) -> None:
        held = _held(args)
        if held is not None:
            self._last_grad = torch.is_grad_enabled()
            self._last_refs, self._last_metas = held


def dispatcher_of(fn: Any) -> Dispatcher | None:
    """The :class:`Dispatcher` of what :func:`compile` returned (a module's is its forward)."""
    for f in (fn, getattr(fn, "forward", None)):
        if isinstance(f, Dispatcher):
            return f
    return None


def _name(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)  # a module's __call__: the module's class
    if isinstance(owner, torch.nn.Module):
        return type(owner).__name__
    return getattr(fn, "__name__", None) or type(fn).__name__


def _describe(key: Any) -> str:
    """A signature for the log: its shapes."""
    if key is None:
        return "calls that can't be keyed"
    shapes = [tuple(k) for k in key if isinstance(k, torch.Size)]
    return "shapes " + ", ".join(map(str, shapes)) if shapes else "these arguments"

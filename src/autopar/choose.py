"""The measured choice: which way runs a function's calls, decided per argument signature.

One place decides "is autopar's plan better than what the user would otherwise run?". The
rules in full, with the measurements behind them: docs/design.md, "The measured choice: its
rules and why".

Policy
- The ways (:data:`WAYS`): ``eager`` (the function itself, no dynamo), ``inductor``
  (``torch.compile``'s default), ``autopar`` (placed, folded, fused plans), ``cudagraphs``
  (Inductor's graphs replayed as CUDA graphs; cudagraph trees for a training call) and
  ``split`` (an inference batch split over devices). The compiled ways share one dynamo trace.
- Predictions prune, measurement decides: a way is a candidate only where it can differ from
  eager's (:func:`candidates`); a lone candidate is kept untimed. ``cudagraphs`` is tried only
  where a GPU trial measured calls launch-bound (:func:`launch_bound`), as compiling again
  costs first-call time that pays only there.
- A trial (:class:`Trial`) goes round the candidates in turns: an untimed call, then
  ``TURN_CALLS`` counted ones; each way at least ``TRIAL_CALLS`` calls and ``TRIAL_MIN_S``
  seconds, at most ``TRIAL_MAX_CALLS``; past each way's ``TRIAL_CALLS``, the trial stops at
  ``TRIAL_BUDGET_CALLS`` calls or ``TRIAL_BUDGET_S`` of counted calls, whichever comes first
  (``AUTOPAR_LONG_TRIAL=1`` lifts that bound). A call's time is the longer of its host time and the
  GPU work it queued (CUDA events, no sync). The fastest median keeps the signature.
- What a call does is what is timed: a forward whose outputs autograd records is timed with
  its backward (:class:`Backward`), as forwards alone rank ways by the wrong margins.
- Shapes that vary: after ``OWN_SIGNATURES`` of a :class:`Family`, its new signatures share
  one trial of the ways that serve any size (:func:`family_ways`), not a capture each.

Invariants
- Every way computes eager's results within the tolerance between eager and a fused kernel
  (:func:`results_differ`): a way that fails where eager would not, or whose checked result
  differs, is dropped for that signature and the call runs eagerly.
- A step's forwards (the calls before one backward pass) run one way (:class:`Steps`): eager's
  saved tensors and a compiled in-place update do not mix within a backward.

Map of extension points
- a new way: :data:`WAYS`, :func:`candidates` and :func:`family_ways` here; its builder in
  :meth:`autopar.dispatch.Dispatcher._way`; its staging in
  :meth:`~autopar.dispatch.Dispatcher._next_way`.
- when a way is worth timing: :func:`launch_bound`, :data:`LAUNCH_BOUND`,
  :meth:`autopar.dispatch.Dispatcher._split_candidate`.
- how long a trial runs and what it counts: the ``TRIAL_*`` and ``TURN_CALLS`` constants,
  :meth:`Trial.next_way`, :meth:`Trial.verdict`.
- what counts as the same result: :func:`results_differ`, :data:`RESULT_TOL`,
  :data:`RESULT_TOL_LOW`; where it is checked: :meth:`autopar.dispatch.Dispatcher._wrong`.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .ir.compare import outputs_differ
from .ir.units import fmt_seconds
from .machine.host import cpu_fusion_unavailable
from .runtime.learn import traced_calls

__all__ = ["BACKWARD_WAIT_CALLS", "LAUNCH_BOUND", "OWN_SIGNATURES", "RESULT_TOL",
           "RESULT_TOL_LOW", "TRIAL_BUDGET_CALLS", "TRIAL_BUDGET_S", "TRIAL_CALLS", "TURN_CALLS",
           "WAYS", "Backward", "Family", "Steps", "Trial", "candidates", "family_of",
           "family_ways", "launch_bound", "results_differ"]

log = logging.getLogger("autopar.trials")

WAYS = ("eager", "inductor", "autopar", "cudagraphs", "split")

LAUNCH_BOUND = 0.8
"""A way's calls are launch-bound where their host time is at least this share of their GPU
time: the GPU ran as fast as the host launched (GPU-bound calls queue ahead: host time far
below the GPU's)."""

RESULT_TOL = 2e-3
"""A way's outputs may differ from eager's by this relative error (in norm) at full precision:
a fused kernel's other summation order, not another formula."""
RESULT_TOL_LOW = 5e-2
"""...and by this much under autocast or for 16-bit outputs (bfloat16 keeps 8 bits)."""


def results_differ(got: Any, want: Any, low_precision: bool = False) -> str | None:
    """How ``got`` (a way's result) differs from ``want`` (eager's) beyond the tolerance, or
    None: the same structure, tensors of the same shape and dtype, floating ones within
    ``RESULT_TOL`` (``RESULT_TOL_LOW`` where ``low_precision`` or the output is 16-bit) in
    relative norm, others equal (:func:`autopar.ir.compare.outputs_differ`)."""
    if low_precision:
        return outputs_differ(got, want, RESULT_TOL_LOW)
    return outputs_differ(got, want, RESULT_TOL, RESULT_TOL_LOW)

TRIAL_CALLS = 5
"""Counted calls of each way a signature's trial makes at least. The first call after a switch
from another way is neither timed nor counted: caches, memory and kernels loaded on first use
are another way's then, and such a call ran several times slower than the next (measured: see
benchmarks/NOTES.md and docs/design.md, "The measured choice")."""

TURN_CALLS = 3
"""Counted calls a turn makes after its untimed first, one after another: a call timed right
after a switch runs in caches the other way filled, and the way with more Python code loses
more there, 2-2.5x its time in a loop (measured: see benchmarks/NOTES.md)."""

TRIAL_MIN_S = 0.05
"""Host seconds of counted calls each way needs before its median is trusted: five samples
of a 1 ms call are not enough to tell two ways 10% apart (measured: see
benchmarks/NOTES.md)."""

TRIAL_MAX_CALLS = 50
"""...but no more calls than this of any way."""

TRIAL_BUDGET_CALLS = 60
TRIAL_BUDGET_S = 2.0
"""A trial's bound, once each way has its ``TRIAL_CALLS``: its calls (untimed ones too) and
the host seconds of its counted calls (the calls' own time: not a first call's compile).
Where the bound stops a way short of ``TRIAL_MIN_S``, its median rests on fewer samples;
``AUTOPAR_LONG_TRIAL=1`` lifts the bound for a user who prefers a surer verdict to a shorter
trial."""

_clock = time.perf_counter  # the trial's host clock (tests replace it)
_profiler = torch.autograd.profiler  # ``_profiler._is_profiler_enabled``: a global's read
_range = torch.autograd.profiler.record_function


BACKWARD_WAIT_CALLS = 2
"""Calls of the function begun after a counted call whose backward has not ended, after which
that call counts its forward alone (two: ``loss = f(a) + f(b)`` differentiates a call after
the next one began; as many as a step was seen to span, where more). A backward that began
and raised never ends (the engine drops its final callbacks): without this bound the trial
would wait for it for good."""

_FIRST_STEP_CALLS = 16
"""Calls a step may span, at least, before a switch of ways no longer waits for its backward
(an accumulation of up to that many forwards, or as many as a step was seen to span, is not
split; forwards never differentiated delay a switch so many calls, once)."""

_PENDING_CALLS = 64
"""Calls after which a backward not over is no longer followed (``later`` stays past
``BACKWARD_WAIT_CALLS``): a forward whose outputs are never differentiated."""

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class Backward:
    """The backward pass of one counted call whose outputs autograd records (see the module
    docstring): host seconds and, on each GPU of ``gpus``, CUDA events from the moment the
    gradients of the call's outputs arrive (a pre-hook on their autograd nodes, the first to
    run) to the end of that backward pass (the engine's final callback)."""

    __slots__ = ("after", "gpus", "host", "later", "marks", "seen", "start")

    def __init__(self, gpus: Sequence[int]) -> None:
        self.gpus = tuple(gpus)
        self.start: float | None = None  #: the host clock when its gradients arrived
        self.host: float | None = None  #: host seconds to the end of the pass, once over
        self.marks: list[tuple[Any, Any]] = []  #: (begin, end) CUDA events per GPU
        self.later = 0  #: calls of the function begun since, while it had not ended
        self.after = 0  #: ...of them, those begun before it began
        self.seen = False  #: its beginning seen by the steps (a step ended: :class:`Steps`)

    @classmethod
    def of(cls, out: Any, gpus: Sequence[int]) -> Backward | None:
        """The backward of a call that returned ``out``, hooked, or None where autograd records
        none of its outputs (inference, or a whole training step returning a detached loss)."""
        nodes = {id(t.grad_fn): t.grad_fn for t in tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        if not nodes:
            return None
        back = cls(gpus)
        for node in nodes.values():
            node.register_prehook(back._begin)
        return back

    def _begin(self, grads: Any) -> None:
        if self.start is not None:
            return  # another output's node, in the same pass
        self.start = _clock()
        self.after = self.later  # calls begun since its own: its step's later forwards
        self.marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in self.gpus]
        for (begin, _), i in zip(self.marks, self.gpus):
            begin.record(torch.cuda.current_stream(i))
        _queue_callback(self._end)

    def _end(self) -> None:
        self.host = _clock() - self.start  # type: ignore[operator]
        for (_, end), i in zip(self.marks, self.gpus):
            end.record(torch.cuda.current_stream(i))

    def waited(self, calls: int) -> bool:
        """Whether it is over, or will never end: not begun, or begun and raised (``calls``
        calls later)."""
        return self.host is not None or self.later >= calls

    def seconds(self) -> tuple[float, float]:
        """Its host seconds and the longest GPU seconds (0, 0 where it never began)."""
        if self.host is None:
            return 0.0, 0.0
        return self.host, max((b.elapsed_time(e) / 1e3 for b, e in self.marks), default=0.0)


class Steps:
    """A function's steps, followed across all its signatures: a *step* is the forwards made
    before one backward pass that reaches them (gradient accumulation: several calls, maybe of
    several signatures, a smaller last micro-batch; an RNN cell's calls, its first taking
    ``h0`` without grad), and it begins at a call whose outputs autograd records, the first
    such since a backward began. A step's calls must run one way, whatever their signatures:
    an eager forward then a compiled one failed in the backward, eager's batch-norm node
    having saved the running statistics the compiled update then wrote (their version
    counter moved). Shared by the function's trials and its Dispatcher, which calls
    :meth:`begin` as each call it follows begins (those not kept; kept ones too while a trial
    is open where a graph writes in place) and :meth:`called` with the way it ran.

    ``way`` is the way the step's first call ran; ``span`` the most calls a step was seen to
    span (None until a backward was seen begun); :meth:`within` whether a call falls inside
    the step."""

    __slots__ = ("first", "new", "pending", "span", "way")

    def __init__(self) -> None:
        self.first: Backward | None = None  #: the backward of the step's first call
        self.way: str | None = None  #: ...and the way that call ran
        self.pending: list[Backward] = []  #: calls' backwards not over
        self.span: int | None = None
        self.new = True  #: whether the next call that autograd records starts a step

    def begin(self) -> None:
        """A call under grad mode begins: each backward not over counts it; one that began
        since the last call ends the step (it spanned the calls begun before it began, and
        one)."""
        pending = []
        for back in self.pending:
            if back.host is None:
                back.later += 1
            if back.start is not None and not back.seen:
                back.seen = self.new = True
                self.span = max(self.span or 1, back.after + 1)
            if back.host is None and back.later < _PENDING_CALLS:
                pending.append(back)
        self.pending = pending

    def called(self, way: str, back: Backward | None) -> None:
        """The call ran ``way``; ``back``: its backward, followed until it begins (None: autograd
        records none of its outputs, it is in no step)."""
        if back is None:
            return
        if self.new:
            self.first, self.way, self.new = back, way, False
        self.pending.append(back)

    def within(self) -> bool:
        """Whether the call begun last falls within the step its first call began: that call's
        backward has not begun (forwards accumulate), and fewer calls have begun since than
        a step was seen to span or ``_FIRST_STEP_CALLS``, whichever is more (calls never
        differentiated are one long step that ends so)."""
        first = self.first
        return first is not None and first.start is None and \
            first.later < max(self.span or 1, _FIRST_STEP_CALLS)


def candidates(autopar_differs: bool, inductor_can: bool) -> tuple[str, ...]:
    """The ways worth a trial, in the order a trial runs them (see the module docstring)."""
    ways = ["eager"]
    if inductor_can:
        ways.append("inductor")
    if autopar_differs:
        ways.append("autopar")
    return tuple(ways)


OWN_SIGNATURES = 2
"""Signatures of a family captured and tried each on its own; the family's later new ones
share one trial and its verdict (see the module docstring)."""


class Family(tuple):
    """The key of a family of signatures (:func:`family_of`): a signature key with each
    tensor's shape replaced by its rank. A type of its own, so that it never equals a
    signature's key and the Dispatcher can tell its trials and verdicts apart."""

    __slots__ = ()


def family_of(key: tuple) -> Family:
    """The family of a signature ``key`` (``autopar.api``'s flat tuple, in which each tensor
    is its ``torch.Size``, dtype and device): the same with each size replaced by its rank."""
    return Family(len(k) if type(k) is torch.Size else k for k in key)


def family_ways(inductor_can: bool) -> tuple[str, ...]:
    """The ways a family of varying shapes is tried with, in trial order (see the module
    docstring): those that serve a new size with no new capture, plan or recording."""
    return ("eager", "inductor") if inductor_can else ("eager",)


def launch_bound(trial: Trial, way: str) -> bool:
    """Whether ``way``'s counted calls in a decided ``trial`` touched a GPU and kept it waiting
    on the host (see ``LAUNCH_BOUND``)."""
    gpu = trial.gpu.get(way)
    if not gpu or not any(gpu):
        return False
    return statistics.median(trial.host[way]) >= LAUNCH_BOUND * statistics.median(gpu)


def inductor_compiles_for(devices: Sequence[str], fuse: bool | str) -> bool:
    """Whether ``torch.compile``'s default (Inductor) is a candidate on ``devices``."""
    if fuse is False:
        return False
    if any(d.startswith("cuda") for d in devices):
        return True
    return cpu_fusion_unavailable() is None


class Trial:
    """Times a signature's calls round the ways named in ``gpus`` (way -> the GPU indices it
    touches: those timed with events; a GPU the way leaves idle is not timed, its events would
    measure only the host's pace).

    ``run`` calls the next way: a call that follows another way's (or is a way's first) is
    untimed, the next one of that way timed and counted (``calls``), with its backward where
    autograd records its outputs (:class:`Backward`). ``verdict`` is None until every way's
    counted calls are in, their backward passes over (or never to come) and their GPU work
    completed, then the fastest way. Calls made while the verdict waits go to the way called
    last, untimed, so that the events waited for are a fixed set. Under ``torch.profiler``
    each call is a range ``autopar:trial <name> <way>`` (``name``: the function's, for the
    trace)."""

    def __init__(self, gpus: Mapping[str, Sequence[int]], name: str = "fn",
                 steps: Steps | None = None) -> None:
        self.name = name
        self.ways = tuple(gpus)
        self.gpus = {w: tuple(g) for w, g in gpus.items()}
        # the counted ones: (way, host seconds, (begin, end) CUDA events, Backward or None)
        self.calls: list[tuple[str, float, list[tuple[Any, Any]], Backward | None]] = []
        self.times: dict[str, list[float]] = {}  # counted seconds by way, once decided
        self.host: dict[str, list[float]] = {}  # ...of them, the host's
        self.gpu: dict[str, list[float]] = {}  # ...and the GPUs' (the longest; 0 for none)
        self.dropped: dict[str, str] = {}  # way -> why it failed
        self._turn: str | None = None  # the way whose turn's first call was made
        self._left = 0  # ...and the counted calls left in that turn
        self._last: str | None = None  # the way called last
        self._made = 0  # calls made, untimed ones too
        self._bounded = os.environ.get("AUTOPAR_LONG_TRIAL", "") in ("", "0")
        self.ran: str | None = None  #: the way the latest call of ``run`` called
        self.recorded = False  #: whether autograd recorded outputs of a call of it
        # the function's steps: its Dispatcher's, shared with its other trials (which then
        # begins each call), or the trial's own
        self._own = steps is None
        self.steps = Steps() if steps is None else steps

    def next_way(self) -> str | None:
        """The way whose turn it is (the turn begun, else the fewest counted calls of those
        still timed), or None once all are timed: each way has ``TRIAL_CALLS`` counted calls,
        adding up to ``TRIAL_MIN_S`` of host time, or ``TRIAL_MAX_CALLS`` of them, or the
        trial's bound reached (``TRIAL_BUDGET_CALLS``, ``TRIAL_BUDGET_S``)."""
        host: dict[str, list[float]] = {w: [] for w in self.ways if w not in self.dropped}
        spent = 0.0
        for way, seconds, *_ in self.calls:
            spent += seconds
            if way in host:
                host[way].append(seconds)
        within = not self._bounded or (self._made < TRIAL_BUDGET_CALLS
                                       and spent < TRIAL_BUDGET_S)
        live = [w for w, t in host.items() if len(t) < TRIAL_CALLS or (
            within and len(t) < TRIAL_MAX_CALLS and sum(t) < TRIAL_MIN_S)]
        if self._turn in live:
            return self._turn
        return min(live, key=lambda w: len(host[w])) if live else None

    def run(self, way_of: Callable[[str], Callable], args: Sequence[Any],
            kwargs: Mapping[str, Any]) -> Any:
        """Call the way whose turn it is (``way_of(name)`` gives its callable); ``ran`` says
        which was called. Within a step (:meth:`Steps.within`), a call runs the way the step's
        first call ran, untimed, whatever its own turn: a step's calls run one way (an eager
        forward then a compiled one, their backward after, fails where eager saved a
        batch-norm buffer the compiled form's update then wrote), so a switch waits for the
        step's backward."""
        steps = self.steps
        if self._own and torch.is_grad_enabled():  # (a call under no_grad does not count
            steps.begin()  # towards a step's calls: it runs the step's way, though)
        way = self.next_way()
        if steps.way is not None and way != steps.way and steps.within():
            return self._untimed(way_of, steps.way, args, kwargs)  # another way's step
        if way is None:  # waiting for the timed calls' GPU work: the way called last
            return self._untimed(way_of, self._last or self.ways[0], args, kwargs)
        if way != self._last:  # a switch: this call warms the way up, untimed
            self._turn = way
            self._left = TURN_CALLS
            return self._untimed(way_of, way, args, kwargs)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                  torch.cuda.current_stream(i)) for i in self.gpus[way]]
        for begin, _, stream in marks:
            begin.record(stream)
        traced = traced_calls()
        start = _clock()
        self.ran = way
        out = self._call(way_of(way), way, args, kwargs)
        host = _clock() - start
        if traced_calls() != traced:  # a plan traced this call to learn its ops' times
            self._stepped(way, Backward.of(out, ()))  # (autopar.runtime.learn): its time is
            return out  # not the way's; not counted
        self._left -= 1
        if self._left <= 0:
            self._turn = None
        for _, end, stream in marks:
            end.record(stream)
        self.calls.append((way, host, [(b, e) for b, e, _ in marks],
                           self._stepped(way, Backward.of(out, self.gpus[way]))))
        return out

    def _stepped(self, way: str, back: Backward | None) -> Backward | None:
        """``back``, the latest call's backward (of way ``way``), to the function's steps."""
        self.steps.called(way, back)
        self.recorded |= back is not None
        return back

    def _untimed(self, way_of: Callable[[str], Callable], way: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any]) -> Any:
        self.ran = self._last = way
        out = self._call(way_of(way), way, args, kwargs)
        self._stepped(way, Backward.of(out, ()))  # whether a step's backward is still to come
        return out

    def _call(self, fn: Callable, way: str, args: Sequence[Any],
              kwargs: Mapping[str, Any]) -> Any:
        self._made += 1  # the trial's bound
        if _profiler._is_profiler_enabled:
            with _range(f"autopar:trial {self.name} {way}"):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def drop(self, way: str, why: str) -> None:
        """Take ``way`` out of the trial (it failed where eager would not)."""
        self.dropped[way] = why
        self.calls = [c for c in self.calls if c[0] != way]
        if self._turn == way:
            self._turn = None

    def verdict(self) -> str | None:
        """None while calls remain (or their GPU work is still queued); then the way with the
        fastest median of its counted calls."""
        if self.next_way() is not None or (self.recorded and self.steps.within()):
            return None  # (a step's calls run one way: the winner from the next step on)
        wait = min(max(BACKWARD_WAIT_CALLS, self.steps.span or 1), _PENDING_CALLS)  # a step's
        if not all(back is None or back.waited(wait) for *_, back in self.calls):
            return None  # a backward still to come
        if not all(end.query() for _, _, marks, back in reversed(self.calls)
                   for _, end in [*marks, *(back.marks if back is not None else ())]):
            return None
        times: dict[str, list[float]] = {}
        for way, host, marks, back in self.calls:
            gpu = max((b.elapsed_time(e) / 1e3 for b, e in marks), default=0.0)
            back_host, back_gpu = back.seconds() if back is not None else (0.0, 0.0)
            times.setdefault(way, []).append(max(host, gpu) + max(back_host, back_gpu))
            self.host.setdefault(way, []).append(host + back_host)
            self.gpu.setdefault(way, []).append(gpu + back_gpu)
        self.times = times
        return min(times, key=lambda w: (statistics.median(times[w]), self.ways.index(w)))

    def summary(self) -> str:
        """Each way's median, for the log: ``eager 4.1 ms, inductor 2.2 ms (host 0.3 ms, GPU
        2.2 ms)``: a way timed on a GPU adds its host and GPU medians (a call counts the
        longer of the two)."""
        parts = []
        for w, t in self.times.items():
            part = f"{w} {fmt_seconds(statistics.median(t))}"
            if any(self.gpu.get(w, ())):
                part += (f" (host {fmt_seconds(statistics.median(self.host[w]))}, "
                         f"GPU {fmt_seconds(statistics.median(self.gpu[w]))})")
            parts.append(part)
        parts += [f"{w} left out ({why})" for w, why in self.dropped.items()]
        return ", ".join(parts)

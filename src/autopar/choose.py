"""The measured choice: which way runs a function's calls, decided per argument signature.

Policy (one place decides "is autopar's plan better than what the user would otherwise run?")
- The ways (candidates) of a function compiled by :func:`autopar.compile`:

  ``eager``     the function itself, plain Python: no dynamo, eager's ops;
  ``inductor``  ``torch.compile(fn)`` with its defaults: the graphs fused whole by Inductor on
                eager's placement (what a user would otherwise pick);
  ``autopar``   autopar's graphs: placed plans, folded constants, fused regions;
  ``cudagraphs`` Inductor's graphs replayed as CUDA graphs (what ``mode="reduce-overhead"``
                does, without compiling again: :class:`autopar.runtime.cudagraphs.GraphedCall`
                captures Inductor's function), outputs cloned out of the graphs' memory;
                under ``guards="arguments"``, where no trace is shared, and for a training
                call (the replay takes inference graphs only),
                ``torch.compile(fn, mode="reduce-overhead")`` itself (cudagraph trees:
                forward, backward and optimizer graphs, parameters, buffers and optimizer
                state as static inputs written in place), outputs cloned.

  ``split``     an inference call with its batch split over two or more devices of its kind,
                replicas resident (:class:`autopar.dataparallel.DataParallelStep`).

  ``inductor`` and ``cudagraphs`` are forms of the trace autopar's way made (one dynamo
  trace serves the three compiled ways: :class:`autopar.capture.dynamo.WaySwitch`).

- Predictions prune, measurement decides (:func:`candidates`):
  ``autopar`` is a candidate only where it can differ from eager's sequence: a graph runs on
  the executor (placed off eager's devices, overlapped, fused, or replayed as a CUDA graph)
  or capture folded constants; where Inductor is a candidate, a plan of eager's placement
  with nothing to overlap fuses no regions of its own (the whole graph fused is the better
  candidate: :class:`autopar.api.Runner`);
  otherwise its calls are eager's ops plus dynamo's per-call cost. ``inductor`` is one where
  Inductor compiles for the devices involved (any GPU; the host only with a C++ compiler) and
  fusion is allowed (``fuse`` not False). A lone candidate is kept without timing.
  ``cudagraphs`` is tried only after a trial on a GPU in which ``inductor``'s calls measured
  launch-bound (:func:`launch_bound`: the host's time a
  call at least ``LAUNCH_BOUND`` of the GPU's, so the GPU waited on launches), of inference
  calls (grad off, or no graph reading a tensor that requires grad) whose graphs write
  nothing in place, or of training calls, in a second trial against that trial's winner:
  compiling it again costs first-call time only where it can pay (ResNet-18 at batch 1 on
  one H200: eager 1.34 ms, Inductor 1.57, reduce-overhead 1.14; AdamW steps of BERT, GPT-2
  and HF's ResNet, small configs, batch 8: reduce-overhead 2.12, 2.58 and 2.04 ms against
  the better of eager and Inductor's 6.15, 5.64 and 5.11, 2026-12-02).
  A training call on a GPU is staged the other way round, as its CUDA graphs are a lowering
  of their own (cudagraph trees, ``torch.compile(mode="reduce-overhead")``) that Inductor's
  form would only add to (GPT-2's AdamW step on one H100: autopar's first calls 1.83×
  ``torch.compile``'s, 2026-12-05): its first trial leaves ``inductor`` out; where eager's
  calls were launch-bound, the winner is timed against ``cudagraphs`` (Inductor's form of
  the shared trace, compiled at its first call, is then never lowered), and where they were
  not, or the CUDA graphs failed or lost, against ``inductor`` (then ``cudagraphs`` as above
  where not tried yet) (:meth:`autopar.api.Dispatcher._next_way`). Eager's launch-bound
  calls stand for Inductor's: its CUDA graphs run Inductor's kernels without their launches,
  so where they win, Inductor's plain form would not have won either.
  ``split`` joins the first trial of an inference call where two or more devices of
  the batch's kind are named and the model predicts the split faster than not splitting
  (:meth:`autopar.api.Dispatcher._split_candidate`): kept only if measured faster.
- Shapes that vary. A *family* is the signatures that are equal but for their tensors'
  sizes (:func:`family_of`: ranks, dtypes, devices, plain values and grad mode kept). The
  first ``OWN_SIGNATURES`` of a family are each captured and tried as above (a training
  batch and the smaller last one; a fixed eval batch). A later new one says the sizes vary
  (variable-length batches, an eval loop over any length): capturing and trying each would
  cost a capture a call (GPT-2, tiny config, 2-core VM: ~200 ms a new length in inference,
  ~500 ms in training, against eager's 1-10 ms and ``torch.compile``'s 1-10 ms once its graph
  is dynamic; benchmarks/NOTES.md, 2026-12-04). So the family gets one trial of the ways that
  serve any size with no new work (:func:`family_ways`): eager, and inductor (the shared
  trace, which dynamo made dynamic at the family's second signature, compiled once by
  Inductor for every size), calls of any new size going round them; its verdict runs every
  new signature of the family from then on. Not in it: autopar's way (a plan is made per
  size) and CUDA graphs (one is recorded per size).
- A trial (:class:`Trial`): the next calls of a new signature go round the candidates; each
  turn is a call of a way neither timed nor counted (after a switch, caches, memory and
  first-use kernels are the last way's; a way's first turn also compiles), then
  ``TURN_CALLS`` counted ones in a row (a call right after the warm-up still runs partly in
  the other way's caches), and
  each way is counted for at least ``TRIAL_CALLS`` calls and ``TRIAL_MIN_S`` (at most
  ``TRIAL_MAX_CALLS``). A call's time is the longer of its host time and, on each GPU the way
  touches, the GPU work it queued (CUDA events, no sync). The fastest median keeps the
  signature. Every way is a correct one (eager, or dynamo-guarded compiled code), so a trial
  changes speed, never results beyond the tolerance between eager and a fused kernel.
- What a call does is what is timed: a training step written as one function (forward,
  backward, optimizer step) is timed whole. A call whose outputs autograd records (a
  module's forward in a training loop: ``model = autopar.compile(model)``, the optimizer
  outside) commits to its backward too, which runs later, in the caller's ``backward()``:
  a counted call of it is timed from the moment the gradients of its outputs arrive to the
  end of that backward pass (:class:`Backward`: a pre-hook on the outputs' autograd nodes,
  a callback at the end of the pass), and its time is its forward's plus that. A forward
  alone is a share of the step that differs from way to way (tiny configs on the 2-core VM,
  eager against ``torch.compile``: BERT's forward 7.28 against 2.15 ms, its training step
  16.88 against 13.68; Llama's 4.00 against 1.92, 8.94 against 5.07; benchmarks/NOTES.md,
  2026-12-04), so forwards rank ways by the wrong margins. A call whose backward has not
  ended by the time two more calls of the function have begun (an output never
  differentiated, or a backward that raised: a user's hook, a bad batch) counts its forward
  alone.
- A step's forwards run one way (:class:`Steps`): a *step* is the calls made before one
  backward pass (gradient accumulation; an RNN cell unrolled), of any signatures, and an
  eager forward then a compiled one of a model with batch norm failed in the backward
  (eager's node had saved the running statistics the compiled update then wrote). The
  function's trials share its steps: within a step each call runs the way its first call
  ran, so a switch of ways waits for the step's backward however many forwards came first
  (at least ``_FIRST_STEP_CALLS``; a step longer than any seen was split before), and a
  verdict is kept as a call begins a step. Where the function's graphs write in place (the
  hazard: batch norm's running statistics; elsewhere ways mix in a step safely and each
  signature keeps its own), a new signature within a step runs that way, not captured (a
  capture runs compiled code), and the first signature of calls autograd records to be
  kept (by its trial, or as its only candidate) gives its way to every signature whose calls
  may fall within steps (under grad mode, or of a module in training mode), open trials and
  kept ones included, as a kept signature's calls are not followed once no trial is open (a
  step of two signatures with ways of their own, a smaller last micro-batch, failed so on
  every step). Calls under ``no_grad`` within a step run its way too (a compiled one's writes
  after an eager forward fail alike), but do not count towards the calls it may span.
- A way that fails where eager would not (an internal or compile error before the function
  ran) is dropped for that signature, with the reason logged once, and the call runs eagerly.
- A way whose results are not eager's is dropped too: on a way's first call, where calling the
  function again changes nothing (an inference call as above, no captured graph writes in
  place, and the call changed no tensor's version counter: its arguments', a module's
  parameters' and buffers'), eager runs on the same arguments and the outputs are compared
  (:func:`results_differ`: relative error in norm over ``RESULT_TOL``, ``RESULT_TOL_LOW``
  under autocast or for 16-bit outputs); the call returns eager's. The trial's winner is
  checked so once more when kept (Inductor's form of a bf16 ViT on one H200 was right on its
  first call and off after a trial): a winner that differs is dropped and the next fastest
  kept. Training steps are not checked here (a second call would step again).
  Not seen: Python side effects of the function (a counter in a global object), which that
  one call then makes twice.

Glossary: a *way* is a name above; ``Trial.calls`` the counted calls ``(way, host_s,
[(begin, end) CUDA events], Backward or None)``; ``Trial.times`` each way's counted seconds
once decided.
"""

from __future__ import annotations

import logging
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
           "RESULT_TOL_LOW", "TRIAL_CALLS", "TURN_CALLS", "WAYS", "Backward", "Family", "Steps",
           "Trial", "candidates", "family_of", "family_ways", "launch_bound", "results_differ"]

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
"""Counted calls of each way a signature's trial makes at least. Each is the second of a pair:
the first call after a switch from another way is neither timed nor counted (caches, memory
and kernels loaded on first use are another way's then: on the 2-core VM a compiled BERT
training step took 2.5 ms a call alone and 6.3 ms right after an eager one; on 2xH200, W2's
first plain call took 42 ms, the next ones 40-100 us)."""

TURN_CALLS = 3
"""Counted calls a turn makes after its untimed first, one after another: a call timed right
after a switch runs in caches the other way filled, and the way with more Python code loses
more there (2-core VM, trial medians of a turn of one counted call against calls in a loop:
W1 in the mode 13.6 against 6.7 us, eager 35.6 against 16; on one H200 the tiny chain kept a
way at 72.9 us a call where autopar's own measured 28.8 in a loop; benchmarks/NOTES.md,
2026-12-01 (e))."""

TRIAL_MIN_S = 0.05
"""Host seconds of counted calls each way needs before its median is trusted: five samples
of a 1 ms call are not enough (on one H200, EfficientNet-B0 kept Inductor's way at 5.75 ms a
call, measured beside eager's 5.22 ms; benchmarks/NOTES.md, 2026-12-01)."""

TRIAL_MAX_CALLS = 50
"""...but no more calls than this of any way."""

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
        self.ran: str | None = None  #: the way the latest call of ``run`` called
        self.recorded = False  #: whether autograd recorded outputs of a call of it
        # the function's steps: its Dispatcher's, shared with its other trials (which then
        # begins each call), or the trial's own
        self._own = steps is None
        self.steps = Steps() if steps is None else steps

    def next_way(self) -> str | None:
        """The way whose turn it is (the turn begun, else the fewest counted calls of those
        still timed), or None once all are timed: each way has ``TRIAL_CALLS`` counted calls,
        adding up to ``TRIAL_MIN_S`` of host time, or ``TRIAL_MAX_CALLS`` of them."""
        host: dict[str, list[float]] = {w: [] for w in self.ways if w not in self.dropped}
        for way, seconds, *_ in self.calls:
            if way in host:
                host[way].append(seconds)
        live = [w for w, t in host.items() if len(t) < TRIAL_CALLS or (
            len(t) < TRIAL_MAX_CALLS and sum(t) < TRIAL_MIN_S)]
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

"""Learning the host's op times from a plan's first calls: the mechanism. Which plans learn is
the Runner's decision (:meth:`autopar.pipeline.Runner.learns`).

Why: the cost model prices a host op from curves calibrated on a few kernels (``sum``,
``full``, ``exp``, ``mm``: :mod:`autopar.machine.calibrate`); many of the ops real models put
on the host run well below those rates (a bool ``where`` or a ``le`` took about five times what
its bytes priced it at), and a plan that put GPT-2's mask ops on the host ran twice as long as
the same graph all on the GPU (measured: see benchmarks/NOTES.md). The model's history
(:class:`~autopar.cost.model.History`) replaces an op's estimate by its measured median once it
holds enough samples; a :class:`Learner` feeds it.

Mechanism
- Calls ``LEARN_FROM`` to ``LEARN_FROM + LEARN_CALLS - 1`` of the executor (the first call
  warms caches and allocators) run a traced twin of it (the same plan and fused regions;
  copies timed on their side streams, no CUDA-graph segments), which returns the same values.
  Then the learner detaches itself: later calls pay nothing (the executor's check of
  ``learning`` is one attribute read, on its multi-device path only). A trial does not count
  a call in which a plan traced (:func:`traced_calls`): traced, a call syncs the GPUs and
  times every copy on a side stream, so its time is not the plan's.
- Each host op's span (its wall time on the thread that ran it) goes to
  :meth:`~autopar.cost.model.CostModel.observe`; not fused regions (a span of many ops), not
  GPU ops (in a launch-bound program a GPU op's span includes the wait for its own launch).
  The history is saved beside the profile once every traced call is over (threads may finish
  them in any order), merged with what the file holds by then (other functions' and
  processes' learning: :meth:`~autopar.cost.model.History.save`). A failure to save is
  logged, never raised. The twin is let go then.
- Plans made afterwards (other graphs and sizes of the process, every later process) price
  those ops at what they cost. A plan already made is not made again: the measured choice
  (:mod:`autopar.choose`) decides whether it runs at all.
- A twin that can't be built (its fused regions fail to compile) ends learning for that plan;
  the call runs untraced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..ir.graph import op_name

__all__ = ["LEARN_CALLS", "LEARN_FROM", "Learner", "traced_calls"]

log = logging.getLogger("autopar.runtime")

LEARN_FROM = 2
LEARN_CALLS = 5
"""Traced calls per plan. The history trusts an op's median once ``History.min_samples`` (3)
samples survive its outlier test (a modified z-score over 3.5, the spread floored at 5% of the
median): of three samples, one 25% off the others was dropped and the op stayed unlearned (a
loaded 2-core VM), so five."""


_traced = [0]  # traced calls learners have made in this process


def traced_calls() -> int:
    """How many calls learners have traced in this process: a trial that sees it change during
    a call leaves that call uncounted (:class:`autopar.choose.Trial`), since a traced call's
    time is not the plan's."""
    return _traced[0]


class Learner:
    """The first calls of one executor's plan (see the module docstring); ``twin()`` builds
    the traced twin. Untraced calls are the executor's own (its events-ordered call)."""

    def __init__(self, executor: Any, cost: Any, twin: Callable[[], Any]) -> None:
        self.executor = executor
        self.cost = cost
        self._make_twin = twin
        self._twin: Any = None  # built at the first traced call; False: it could not be
        self._lock = threading.Lock()
        self.calls = 0
        self._finished = 0  # traced calls over
        self.observed = 0  # host op times recorded so far

    def __call__(self, args: Sequence[Any]) -> Any:
        with self._lock:
            self.calls += 1
            turn = self.calls
            learning = LEARN_FROM <= turn < LEARN_FROM + LEARN_CALLS
            if learning and self._twin is None:  # built once, whatever the threads calling
                try:
                    self._twin = self._make_twin()
                except Exception as e:  # learning is optional; the call is not
                    log.debug("autopar: no traced twin of %s (%s: %s); not learning its op "
                              "times", self.executor.plan.graph.name, type(e).__name__, e)
                    self._twin = False
            twin = self._twin if learning else None
            if turn >= LEARN_FROM + LEARN_CALLS - 1 or twin is False:
                self.executor.learning = None  # later calls go straight to the executor
        if not twin:
            return self.executor._events_call(args)
        _traced[0] += 1
        try:
            out = twin(args)
            self._observe(twin)
        finally:
            with self._lock:
                self._finished += 1
                last = self._finished == LEARN_CALLS
                if last:
                    self._twin = None
        if last:  # every traced call has observed (threads finish in any order): save once
            self._save()
        return out

    def _observe(self, twin: Any) -> None:
        timeline = twin.last_timeline
        if timeline is None:
            return
        nodes = self.executor.plan.graph.nodes
        for span in timeline.spans:
            if span.kind != "op" or span.node is None or not span.lane.startswith("cpu"):
                continue
            node = nodes[span.node]
            if node.is_input or span.name != op_name(node.op):  # a fused region's span
                continue
            self.cost.observe(node, span.lane, span.duration)
            self.observed += 1

    def _save(self) -> None:
        history = self.cost.history
        if history.path is None or not self.observed:
            return
        try:
            history.save()
        except OSError as e:
            log.info("autopar: could not save the op-time history to %s: %s", history.path, e)

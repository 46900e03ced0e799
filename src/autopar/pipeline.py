"""The compile pipeline: each graph dynamo captures is placed, planned and handed to the
executor (:class:`Runner`, the GraphRunner of ``autopar.compile``'s own way).

Policy
- Anything autopar can't represent runs eagerly for that graph (:mod:`autopar.capture.fx`).
- A plan that fails where eager does not makes its graph run as eager's sequence of ops from
  then on, the reason logged once (:class:`_FallsBack`): never a wrong result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .choose import inductor_compiles_for
from .cost.model import CostModel
from .ir.graph import LOCAL_SCALAR_DENSE, Graph
from .ir.logs import first_line
from .ir.routing import cuda_indices
from .ir.units import fmt_seconds
from .machine.detect import load_machine
from .options import Options
from .passes.cudagraphs import capture_rule
from .passes.fusion import fusion_devices, prefer_fused, regions_to_fuse
from .report.trace import save_chrome_trace
from .runtime import Executor, SequentialRunner
from .runtime.learn import Learner
from .schedule.place import place, places_by_cost
from .schedule.plan import make_plan
from .schedule.simulate import runs_as_eager
from .schedule.steps import Plan, Send

__all__ = ["Runner", "make_runner"]

log = logging.getLogger("autopar.placement")

_profiler = torch.autograd.profiler  # ``_profiler._is_profiler_enabled``: a global's read
_range = torch.autograd.profiler.record_function

class Runner:
    """The GraphRunner for some options: ``runner(graph, phase) -> run(args) -> outputs``.

    Each graph is placed (policy over ``options.devices``), planned and handed to the
    executor. If any of that fails, the graph runs sequentially on eager's devices and the
    reason is logged once: never a wrong result. A plan that is eager's own placement with
    nothing to overlap runs as eager's sequence of ops too
    (:func:`~autopar.schedule.simulate.runs_as_eager`); its executor stays in ``executors`` with
    ``runs_as`` saying so. One machine and cost model serve every graph.
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self._cost: Any = None
        self.executors: list[Any] = []  # every graph's executor, in the order they were built
        self.graphs = 0  # graphs handed to this runner
        # ...of them, those capture had already computed part of (autopar.capture.fold)
        self.folded = 0
        self.reads_scalars = False  # whether any of them reads a value to the host (.item())
        # whether any of them writes a tensor in place (an op's write, or aot_autograd's
        # epilogue into an input or buffer): a call is then not repeatable
        self.writes = False
        # whether any of them is a forward or backward graph (aot_autograd saw an input that
        # requires grad, under grad mode): a call is then a training one whatever grad mode
        self.training = False
        self.random = False  # whether any of them draws random numbers (dropout in training)
        self.gpus = cuda_indices(options.devices)  # GPU indices autopar may use
        self.inductor_can = inductor_compiles_for(options.devices, options.fuse)
        self.inductor_candidate = self.inductor_can and "inductor" in options.candidates
        # On eager's placement with nothing to overlap, fusing regions would repeat what
        # Inductor's form of the same trace does (compiled twice). Under guards="arguments"
        # the inductor way is torch.compile's own (dynamo's frame every call) and autopar's
        # is the one that skips it: there a plan of eager's placement fuses (unfused, a chain
        # of small ops lost to the inductor way; fused past dynamo, it beat it: measured, see
        # benchmarks/NOTES.md)
        self.eager_like_unfused = self.inductor_candidate and options.guards != "arguments"

    def learns(self, plan: Plan) -> bool:
        """Whether ``plan``'s first calls are traced to learn its host ops' times
        (:mod:`autopar.runtime.learn`): it puts ops on a CPU worker and on another device (a
        GPU, or a second worker), where the host's prices decide what runs where; the machine
        is this host with a measured profile (a defaults profile is a stopgap, replaced at the
        next calibration; a preset's numbers are another machine's, which this host's times
        would not improve); and the calls are not traced already (``trace``)."""
        machine = self.cost_model().machine
        devices = set(plan.programs)
        return not self.options.trace and machine.profile_path is not None and \
            machine.profile.source.startswith("measured") and \
            len(devices) > 1 and any(d.startswith("cpu") for d in devices)

    def planned_s(self) -> float:
        """The predicted seconds of one call of every graph the executor runs."""
        return sum(e.plan.placement.predicted_s for e in self.executors
                   if e.runs_as == "executor")

    def gpus_touched(self) -> tuple[frozenset[int], frozenset[int]] | None:
        """GPU indices eager's code touches in this runner's graphs, and those autopar's calls
        touch (a plan's programs, copy destinations and output devices; eager's for a graph
        run as eager's sequence); None where a graph has no executor (planning failed)."""
        if len(self.executors) < self.graphs:
            return None
        eager: set[str] = set()
        ours: set[str] = set()
        for e in self.executors:
            plan = e.plan
            mine = {n.device for n in plan.graph.nodes if n.device}
            eager |= mine
            if e.runs_as != "executor":
                ours |= mine
                continue
            for device, steps in plan.programs.items():
                if steps:
                    ours.add(device)
                ours.update(s.dst for s in steps if isinstance(s, Send))
            ours.update(d for _, d in plan.outputs if d is not None)
        return cuda_indices(eager), cuda_indices(ours)

    @property
    def planned(self) -> int:
        """Of the graphs handed to this runner, how many the executor runs (the others run as
        eager does: :func:`~autopar.schedule.simulate.runs_as_eager`, or placement failed)."""
        return sum(e.runs_as == "executor" for e in self.executors)

    def cost_model(self) -> Any:
        """The cost model, resolving (and if need be calibrating) the machine on first use."""
        if self._cost is None:
            workers = sum(d.startswith("cpu") for d in self.options.devices) or 1
            with unset_fake_temporarily():  # a backend runs inside tracing: measure for real
                machine = load_machine(self.options.machine, cpu_workers=workers)
            self._cost = CostModel(machine)
        return self._cost

    def __call__(self, graph: Graph, phase: str) -> Callable:
        options = self.options
        self.graphs += 1
        self.folded += graph.folded
        self.reads_scalars = self.reads_scalars or any(
            n.op is LOCAL_SCALAR_DENSE for n in graph.ops)
        self.writes = self.writes or graph.writes_inputs or any(n.writes for n in graph.ops)
        self.training = self.training or phase != "inference"
        self.random = self.random or graph.draws_random
        try:
            cost = self.cost_model()
            placement = place(graph, cost, policy=options.policy, devices=options.devices)
            plan = make_plan(placement, cost)
            if places_by_cost(options.policy):  # priced op by op; fusion changes that
                fusing = fusion_devices(options.devices, options.fuse)
                plan = prefer_fused(plan, graph, cost, options.devices, fusing)
            eager_like = not options.trace and runs_as_eager(plan, cost, options.devices) \
                if self.eager_like_unfused else None  # else asked below, only if need be
            fuse = regions_to_fuse(plan, False if eager_like else options.fuse)
            executor = Executor(plan, trace=bool(options.trace), fuse=fuse,
                                cuda_graphs=capture_rule(options.cuda_graphs))
            as_eager = not (options.trace or executor.fused or executor.segments) and (
                runs_as_eager(plan, cost, options.devices) if eager_like is None else eager_like)
        except Exception as e:
            where = next((n.source for n in graph.ops if n.source), None)
            log.warning("autopar: running %s%s on eager's devices: planning failed: %s: %s",
                        graph.name, f" (from {where})" if where else "", type(e).__name__,
                        first_line(e))
            return SequentialRunner(graph)
        if log.isEnabledFor(logging.INFO) or _profiler._is_profiler_enabled:
            counts: dict[str, int] = {}
            for n in graph.ops:  # the plan's placement: fusion may have changed place()'s
                counts[plan.placement.device[n]] = counts.get(plan.placement.device[n], 0) + 1
            placed = ", ".join(f"{d} {k}" for d, k in sorted(counts.items()))
            log.info("autopar: %s: %d ops placed (%s) by %s, predicted %s a call",
                     graph.name, len(graph.ops), placed, options.policy,
                     fmt_seconds(plan.placement.predicted_s))
            if _profiler._is_profiler_enabled:  # the chosen plan, as a mark in the profiler's trace
                with _range(f"autopar:plan {graph.name}: {placed}"):
                    pass
        log.debug("autopar: %s\n%s", graph.name, plan)
        self.executors.append(executor)
        if not as_eager and executor.solo is None and self.learns(plan):
            executor.learning = Learner(executor, cost, lambda: Executor(plan, trace=True,
                                                                         fuse=fuse))
        if as_eager:
            log.info("autopar: %s runs as eager does: the plan is eager's placement with "
                     "nothing to overlap", graph.name)
            executor.runs_as = "eager's sequence"
            return SequentialRunner(graph, plan)
        run = _tracing(executor, options.trace) if isinstance(options.trace, str) else executor
        if any(n.writes for n in graph.ops):
            return run  # a failure may have applied part of the call: it is the user's to see
        return _FallsBack(run, graph)


class _FallsBack:
    """A functional graph's runner that, where autopar's program fails, runs the graph as
    eager's sequence of ops from then on, with the reason logged once. A graph that writes
    nothing has applied nothing when it fails, so running it again is safe; where eager's
    sequence fails too, that error is the user's, raised as eager raises it."""

    def __init__(self, run: Callable, graph: Graph) -> None:
        self.run = run
        self.graph = graph
        self.eager: Callable | None = None
        if hasattr(run, "on_failure"):  # a failure inside the runner's own fast call too
            run.on_failure = self._failed  # (its ``unchecked``: autopar.capture.direct)

    def __getattr__(self, name: str) -> Any:  # what the runner it wraps says (plan, segments)
        return getattr(self.run, name)

    def __call__(self, args: Sequence[Any]) -> Any:
        if self.eager is not None:
            return self.eager(args)
        try:
            return self.run(args)
        except Exception as e:
            return self._failed(args, e)

    def _failed(self, args: Sequence[Any], error: Exception) -> Any:
        eager = self.eager
        if eager is None:
            eager = SequentialRunner(self.graph)
            out = eager(args)  # raises the user's error where eager fails too
            self.eager = eager
            log.warning("autopar: %s runs as eager's sequence from now on: its plan failed "
                        "where eager does not: %s: %s", self.graph.name, type(error).__name__,
                        first_line(error))
            return out
        return eager(args)


def make_runner(options: Options) -> Runner:
    """The GraphRunner for these options (see :class:`Runner`)."""
    return Runner(options)


def _tracing(executor: Any, path: str) -> Callable:
    """Run ``executor`` and write the Chrome trace of its latest call to ``path``."""
    def run(args: Sequence[Any]) -> Any:
        out = executor(args)
        if executor.last_timeline is not None:
            save_chrome_trace(executor.last_timeline, path, executor.plan.graph)
        return out

    return run

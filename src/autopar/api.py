"""The front door: ``autopar.compile(fn, **options)`` and option validation.

Policy
- Options are validated eagerly, before anything is traced: an unknown option, a malformed device
  string or a device this machine doesn't have raises at ``autopar.compile`` time with a message
  that says what was wrong and what to write instead.
- ``devices="auto"`` means every GPU of this machine plus the host; a CPU-only machine gets two
  logical CPU workers (``cpu:0``, ``cpu:1``) from four cores up
  (:func:`autopar.machine.model.default_cpu_workers` says why not below).
- The compiled callable is ``torch.compile(fn, backend=<autopar>)``: every graph dynamo
  captures goes through :func:`make_runner` (place, plan, run); anything autopar can't
  represent runs eagerly for that graph (see :mod:`autopar.capture.fx`). Shapes: the first call's
  are static; when a later call brings new ones and dynamo makes the graph dynamic, each
  concrete signature gets its own static graph at its first call (:mod:`autopar.capture.shapes`).
  (``dynamic=False`` would do the same through dynamo, at ~4 us a call: it patches dynamo's
  config around every call, while a static graph costs autopar nothing after capture.) It is
  traced with
  ``.item()`` and tensor slice bounds kept in the graph (dynamo's ``capture_scalar_outputs``,
  switched on around each call), so that they are placed instead of breaking the graph.
- Nothing to gain, nothing added: while every graph autopar built for a function runs as eager
  does (:func:`~autopar.schedule.simulate.runs_as_eager`: eager's placement, nothing to overlap,
  nothing fused), a call whose argument signature was seen before calls the function itself, without
  dynamo (:func:`_plain_when_nothing_to_gain`): dynamo's own per-call cost is more than a
  small function's whole eager call on a GPU host. Where capture folded constants, or a placed
  plan predicts a call under a millisecond, a few calls each way are timed first, and the
  faster way keeps that signature.
  Modules, traced functions and calls whose tensors autograd records always go through dynamo.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .capture.dynamo import capturing_scalars, make_backend
from .cost.model import CostModel
from .ir.graph import LOCAL_SCALAR_DENSE, Graph
from .machine.detect import load_machine
from .machine.model import default_cpu_workers
from .passes.cudagraphs import capture_rule
from .passes.fusion import fusion_devices, prefer_fused, regions_to_fuse
from .report.trace import save_chrome_trace
from .runtime import Executor, SequentialRunner
from .schedule.place import place
from .schedule.plan import make_plan
from .schedule.simulate import TRIAL_MAX_S, runs_as_eager
from .schedule.steps import Send

__all__ = ["Options", "compile", "parse_devices"]

log = logging.getLogger("autopar")

POLICIES = ("heft", "single", "round_robin")
_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
MAX_CPU_WORKERS = 64


def parse_devices(devices: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalize a device spec to a tuple of autopar device names, checking they exist.

    Accepts "auto", a comma-separated string ("cuda:0,cuda:1", "cpu:0, cpu:1") or a list.
    "cpu" means cpu:0 and "cuda" means cuda:0.
    """
    if devices is None or devices == "auto":
        gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        workers = 1 if gpus else default_cpu_workers(os.cpu_count() or 1)
        cpus = [f"cpu:{i}" for i in range(workers)]
        return tuple(cpus + gpus)
    if isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
    elif isinstance(devices, Sequence):
        items = [str(d).strip() for d in devices]
    else:
        raise TypeError(
            f"devices must be 'auto', a comma-separated string or a list of device names, "
            f"not {type(devices).__name__}")
    if not items:
        raise ValueError("devices is empty: name at least one device, e.g. devices='cpu:0'")
    out: list[str] = []
    n_gpus = torch.cuda.device_count()
    for item in items:
        m = _DEVICE.match(item)
        if m is None:
            raise ValueError(
                f"malformed device {item!r}: write 'cpu:N' (a logical CPU worker) or 'cuda:N', "
                "e.g. devices=['cpu:0', 'cuda:0']")
        kind, index = m.group(1), int(m.group(2) or 0)
        if kind == "cuda" and index >= n_gpus:
            have = ", ".join(f"cuda:{i}" for i in range(n_gpus)) or "no CUDA devices"
            raise ValueError(f"device {item!r} does not exist: this machine has {have}")
        if kind == "cpu" and index >= MAX_CPU_WORKERS:
            raise ValueError(f"device {item!r}: at most {MAX_CPU_WORKERS} logical CPU workers")
        name = f"{kind}:{index}"
        if name in out:
            raise ValueError(f"device {name!r} is named twice in devices={devices!r}")
        out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class Options:
    """Validated options of :func:`compile` (and of ``torch.compile(..., options=...)``)."""

    devices: tuple[str, ...] = ()
    policy: str = "heft"
    machine: Any = None  # None: this machine (calibrated or defaults); or a Machine
    trace: bool | str = False  # True: record timelines; a path: also write a Chrome trace there
    fuse: bool | str = "auto"  # Inductor fuses each device's regions: "auto" on GPUs, True: all
    cuda_graphs: bool | str = "auto"  # replay GPU segments as CUDA graphs (static shapes)

    @staticmethod
    def parse(options: dict[str, Any]) -> Options:
        known = {f.name for f in fields(Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown autopar option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(sorted(known))}")
        policy = options.get("policy", "heft")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        devices = parse_devices(options.get("devices", "auto"))
        trace = options.get("trace", os.environ.get("AUTOPAR_TRACE") or False)
        if not isinstance(trace, bool | str | os.PathLike):
            raise TypeError(f"trace must be True, False or a file path, not {type(trace).__name__}")
        fuse = _tristate(options, "fuse")
        cuda_graphs = _tristate(options, "cuda_graphs")
        return Options(devices=devices, policy=policy, machine=options.get("machine"),
                       trace=os.fspath(trace) if isinstance(trace, os.PathLike) else trace,
                       fuse=fuse, cuda_graphs=cuda_graphs)


def _tristate(options: dict[str, Any], name: str) -> bool | str:
    value = options.get(name, "auto")
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"{name} must be 'auto', True or False, not {value!r}")


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
        return _cuda_indices(eager), _cuda_indices(ours)

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
        try:
            cost = self.cost_model()
            placement = place(graph, cost, policy=options.policy, devices=options.devices)
            plan = make_plan(placement, cost)
            if options.policy == "heft":  # HEFT prices ops one by one; fusion changes that
                fusing = fusion_devices(options.devices, options.fuse)
                plan = prefer_fused(plan, graph, cost, options.devices, fusing)
            executor = Executor(plan, trace=bool(options.trace),
                                fuse=regions_to_fuse(plan, options.fuse),
                                cuda_graphs=capture_rule(options.cuda_graphs),
                                cpu_threads=cost.machine.cpu_threads)
            as_eager = not (options.trace or executor.fused or executor.segments) and \
                runs_as_eager(plan, cost, options.devices)
        except Exception as e:
            log.warning("autopar: running %s on eager's devices: planning failed: %s: %s",
                        graph.name, type(e).__name__, e)
            return SequentialRunner(graph)
        log.debug("autopar: %s\n%s", graph.name, plan)
        self.executors.append(executor)
        if as_eager:
            log.debug("autopar: %s runs as eager does: the plan is eager's placement with "
                      "nothing to overlap", graph.name)
            executor.runs_as = "eager's sequence"
            return SequentialRunner(graph, plan)
        if isinstance(options.trace, str):
            return _tracing(executor, options.trace)
        return executor


def _cuda_indices(devices: Iterable[str]) -> frozenset[int]:
    return frozenset(torch.device(d).index or 0 for d in devices if d.startswith("cuda"))


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


def compile(fn: Callable, **options: Any) -> Callable:
    """Compile ``fn`` (a function or ``nn.Module``) to run with autopar.

    Options: ``devices`` ("auto", "cpu:0,cpu:1", ["cuda:0", "cuda:1"]), ``policy`` ("heft",
    "single", "round_robin"), ``machine`` (None: this machine's calibrated profile; a Machine
    to plan with other numbers), ``trace`` (True records timelines; a path also writes the
    latest call's Chrome trace there; default ``$AUTOPAR_TRACE``), ``fuse`` ("auto": Inductor
    compiles the fusible regions of GPU programs; True: of every program, CPU workers too;
    False: every op runs as its own ATen call), ``cuda_graphs`` ("auto": GPU segments with
    static shapes are replayed as CUDA graphs where that pays; True: every capturable one;
    False: never).
    """
    if not callable(fn):
        raise TypeError(
            f"autopar.compile expects a function or nn.Module, got {type(fn).__name__}")

    opts = Options.parse(options)
    runner = make_runner(opts)
    runner.cost_model()  # resolve (and if need be calibrate) the machine now, not mid-trace
    compiled = capturing_scalars(torch.compile(fn, backend=make_backend(runner)),
                                 needed=lambda: not runner.graphs or runner.reads_scalars)
    if isinstance(fn, torch.nn.Module) or opts.trace:
        return compiled
    return _plain_when_nothing_to_gain(fn, compiled, runner)


_PLAIN = (int, float, bool, str, type(None))


def _signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple | None:
    """What decides a call's plan, as far as autopar keys it: each tensor argument's shape,
    dtype and device (in lists and tuples too), each plain argument's value, and the grad
    mode. None (no key) for any other argument, or a tensor that autograd would record.
    (A plain call is eager's, so a key that misses something, such as strides, can only miss
    a speed-up, never change a result. It is kept cheap, one flat tuple: ~0.55 us a tensor on
    a 2-core VM; a list or tuple adds its type and length before its items.)"""
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
        elif isinstance(v, _PLAIN):
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


TRIAL_CALLS = 6
"""Calls of each way a signature is timed (see :func:`_plain_when_nothing_to_gain`); the first
of each way warms up and is not counted."""

_clock = time.perf_counter  # the trial's host clock (tests replace it)
_grad_enabled = torch.is_grad_enabled


class _Trial:
    """Times a signature's calls both ways, alternating: through ``compiled`` and plain.

    The first call each way warms up and is not counted (caches, kernels loaded on first use:
    on 2xH200, W2's first plain call took 42 ms, the next ones 40-100 us).
    A call's time is the longer of its host time and, on each GPU the way touches (``gpus``
    plain, ``compiled_gpus`` through ``compiled``), the time between CUDA events recorded on
    the current stream before and after it: the GPU work it queued, without syncing anything.
    A GPU the way leaves idle is not timed: on 2xH200, timed with events on both GPUs, the
    host-only plan of W3/100x200x100 with host data measured 3.1-5.5 ms a call during its
    trial (35 us once timed by the suite), and the plain call won the trial. A verdict waits
    for those events to complete; calls made meanwhile go through ``compiled``, untimed, so
    that the events waited for are a fixed set (a timed call records new ones, which the GPU
    has not reached when the verdict is asked for right after it)."""

    def __init__(self, gpus: Sequence[int] = (), compiled_gpus: Sequence[int] | None = None
                 ) -> None:
        self.gpus = tuple(gpus)
        self.compiled_gpus = self.gpus if compiled_gpus is None else tuple(compiled_gpus)
        self.calls: list[tuple[bool, float, list[tuple[Any, Any]]]] = []
        self.times: dict[bool, list[float]] = {}  # seconds of the timed calls, by plain-ness

    def _count(self, as_plain: bool) -> int:
        return sum(c[0] == as_plain for c in self.calls)

    def _all_timed(self) -> bool:  # plain calls come second: their count is the last to reach
        return self._count(True) >= TRIAL_CALLS

    def run(self, fn: Callable, compiled: Callable, args: Any, kwargs: Any) -> Any:
        if self._all_timed():  # waiting for their GPU work
            return compiled(*args, **kwargs)
        as_plain = self._count(True) < self._count(False)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                  torch.cuda.current_stream(i))
                 for i in (self.gpus if as_plain else self.compiled_gpus)]
        for begin, _, stream in marks:
            begin.record(stream)
        start = _clock()
        out = (fn if as_plain else compiled)(*args, **kwargs)
        host = _clock() - start
        for _, end, stream in marks:
            end.record(stream)
        self.calls.append((as_plain, host, [(b, e) for b, e, _ in marks]))
        return out

    def verdict(self) -> bool | None:
        """None while calls remain (or their GPU work is still queued); then whether the
        plain call was faster (medians)."""
        if not self._all_timed():
            return None
        if not all(end.query() for _, _, marks in reversed(self.calls) for _, end in marks):
            return None
        times: dict[bool, list[float]] = {True: [], False: []}
        for as_plain, host, marks in self.calls[2:]:  # the first call of each way warms up
            gpu = max((b.elapsed_time(e) / 1e3 for b, e in marks), default=0.0)
            times[as_plain].append(max(host, gpu))
        self.times = times
        return statistics.median(times[True]) < statistics.median(times[False])


def _rounded(seconds: list[float]) -> list[float]:
    return [float(f"{t:.3g}") for t in seconds]


def _plain_when_nothing_to_gain(fn: Callable, compiled: Callable, runner: Runner) -> Callable:
    """``compiled``, except that a call whose signature (:func:`_signature`) was seen before
    calls ``fn`` itself while every graph autopar built for the function runs as eager does
    (:func:`~autopar.schedule.simulate.runs_as_eager`, or graphs autopar can't represent): running
    it through dynamo would only add dynamo's own per-call cost (tens of microseconds on a GPU
    host, more than a small function's whole eager call) to eager's sequence of ops. Graph
    breaks, and calls dynamo runs without any graph (a frame it skips, e.g. one another
    ``torch.compile`` of the same function found nothing to capture in), don't matter: dynamo
    then runs the function's own Python, as a plain call does. Each new signature goes through
    ``compiled`` once, so a shape that autopar can speed up is placed; the decision is per
    signature, not per global state the function reads (a closed-over flag that changes the
    graph is not seen: such a call runs eagerly, correct, unplaced).

    Where the plain call might still win, the next ``2 * TRIAL_CALLS`` calls of a signature
    alternate between both ways, timed (:class:`_Trial`: host time, and the GPU work each
    call queued, measured with CUDA events, no sync), and the faster median keeps that
    signature from then on: where capture folded constants (:mod:`autopar.capture.fold`: ``a1 * A +
    a1 ** 2`` computed as ``A * 10.0 + 100.0``, which the plain call computes again), and
    where a placed plan predicts a call under ``TRIAL_MAX_S``, so that dynamo's per-call cost
    is a large part of it (W2 on 2xH200: 44.5 us through dynamo and a fused kernel, 28.1 us
    eager; W3/5x10x5 with host data: 20 us on the host through dynamo, 53 us eager). Both ways
    give eager's values (folding is bit for bit eager's; a placed plan, within the op's
    tolerance across devices). A cost model that mispredicts this host then costs at most the
    trial's calls.

    A call with the very tensors of the latest plain call (the same objects, held by weak
    references, in lists and tuples too: no other arguments, the same grad mode) is plain
    without building its key (two_tower passes ten tensors, its key costs 6 us). That
    check allocates nothing: on 2xH200 an allocating one (``tuple(map(id, args))``, 0.22 us
    alone) measured 2.5-4 us a call when run between a GPU workload's launches, the identity
    loop ~0.3 us. A tensor that is not the same object is compared by what the key holds of
    it (shape, dtype, device; not one autograd records): a new batch each call with the same
    weights checks one tensor's metadata, not all of them. A tensor whose shape was changed in
    place (``resize_``, ``t_``) since then keeps its signature, and lists and tuples are not
    told apart: such a call stays plain, eager's result, at most a missed placement.
    """
    plain: set[tuple] = set()
    trials: dict[tuple, _Trial] = {}
    # the latest plain call's grad mode, weak references to its tensors (in lists and tuples
    # too, in order) and each tensor's metadata
    last: list[Any] = [None, (), ()]

    def remember(args: tuple) -> None:
        flat: list[torch.Tensor] = []
        if args and _tensors_in(args, flat):
            last[:] = [torch.is_grad_enabled(), [weakref.ref(a) for a in flat],
                       [_meta(a) for a in flat]]

    gpus = _cuda_indices(runner.options.devices)
    placed = [False]  # once a graph runs on the executor, no call is plain again: no key needed

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if placed[0]:
            return compiled(*args, **kwargs)
        refs = last[1]
        if refs and not kwargs and last[0] == _grad_enabled() and \
                _same_signature(args, refs, last[2], 0, last[0]) == len(refs):
            return fn(*args)  # the latest plain call's tensors, or new ones like them
        key = _signature(args, kwargs)
        if key is not None and key in plain:
            if not kwargs:
                remember(args)
            return fn(*args, **kwargs)
        trial = trials.get(key) if key is not None else None
        if trial is not None:
            out = trial.run(fn, compiled, args, kwargs)
            won = trial.verdict()
            if won is not None:
                del trials[key]
                log.debug("autopar: %s: plain calls %s for %s (seconds, plain %s, through "
                          "autopar %s)", getattr(fn, "__name__", fn),
                          "faster" if won else "slower", key,
                          _rounded(trial.times[True]), _rounded(trial.times[False]))
                if won:
                    plain.add(key)
                elif not trials and not plain:
                    placed[0] = True  # the only signature goes through dynamo: no key needed
            return out
        out = compiled(*args, **kwargs)
        if runner.planned and (key is None or runner.planned_s() > TRIAL_MAX_S):
            placed[0] = True
        elif key is not None:
            if runner.folded or runner.planned:
                touched = runner.gpus_touched()
                trials[key] = _Trial(*touched) if touched is not None else _Trial(gpus)
            else:
                plain.add(key)
        return out

    call.autopar_runner = runner  # type: ignore[attr-defined]
    call.plain_signatures = plain  # type: ignore[attr-defined]
    call.timed_signatures = trials  # type: ignore[attr-defined]
    return call

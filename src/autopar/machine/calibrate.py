"""Measure this host: the numbers of a :class:`~autopar.machine.model.Profile`.

What is measured, per device
- ``launch_s``: host time to issue one tiny op (``aten.add`` on one element) through the ATen
  dispatcher, as autopar's runtime calls ops. On a GPU this is the kernel-launch cost (the queue
  never fills: the kernel is shorter than its launch); ``launch_by_kind["matmul"]`` is the same
  for a tiny ``aten.mm`` (cuBLAS costs more host time).
- ``min_kernel_s``: device time of that tiny op (GPU: CUDA events around back-to-back kernels
  queued behind a ``torch.cuda._sleep`` so launch gaps do not count).
- curves (see :data:`autopar.machine.model.CURVES`), the work time of one op (host: wall time less
  ``launch_s``; GPU: kernel time): ``matmul``, float32 FLOP/s of square ``aten.mm`` over a range of
  sizes, tf32 off; ``read``, bytes/s of ``aten.sum`` over 2n floats; ``write``, bytes/s of the
  4n-byte output of ``aten.add`` on two n-float arrays (allocated as eager does), its 8n bytes of
  reading taken off (on the host, these and ``exp`` streamed as in a program,
  ``STREAM_BYTES``: operands taken in turn from 256 MB of arrays, outputs kept alive a while,
  and ``write`` from ``aten.full``);
  ``exp``, elements/s of
  ``aten.exp`` (its whole time: where it is no slower than its bytes, it adds nothing);
  ``conv``, float32 FLOP/s of a 3x3 ``aten.convolution`` (stride 1, same padding, batch 8, as
  many channels out as in) over a range of channel counts and image sides (on the 2-core VM a
  small convolution runs 1.3-4.7x below the matmul curve at its FLOPs, a big one 2x above it).
  One size per other dtype (tf32, float16, bfloat16, float64) gives that dtype's ratio to
  float32.
- links: host<->GPU pinned (into a pre-allocated pinned buffer) and pageable (``.to()`` /
  ``.cpu()`` with fresh host memory, as eager code does), GPU<->GPU; a few sizes each, kept as
  samples (pageable copies of fresh memory slow down sharply past 32 MB, where glibc stops
  reusing freed blocks); latency is the time of the smallest copy, bandwidth the slope between
  the smallest and the largest.
- ``host_sync_s``: ``torch.cuda.synchronize()`` on an idle GPU; ``event_wait_s``: host cost of
  an event record plus a stream wait (without GPUs, one thread hand-off through a queue).

Policy
- Every timing is the median of repetitions (MEASURED.md's method); each repetition times a batch
  long enough (~1 ms) for the clock and the sync to be negligible. A disturbed size (on a loaded
  host an OpenMP team waiting for a descheduled thread loses a whole scheduler quantum) comes
  out slower than a bigger size, and the curve normalisation of :mod:`autopar.machine.model` then
  lowers it to the bigger one.
- Budgets: each measurement has a time budget, and a curve stops at sizes its points predict
  to take over ``max_op_s``, so quick mode ends within about 20 s even on a slow host or 8 GPUs
  (10 s on 2x H200); full mode measures more sizes, longer, and every GPU and link (90 s there).
  Quick mode measures the first GPU of each model and gives its numbers (and its host links')
  to the others of that model, and measures one GPU pair with peer access and one without,
  whose numbers every pair of the same kind takes.
- CPU curves are measured with torch's current thread count, recorded as ``threads``, and again
  with one thread (``"<curve>@1t"``, matmuls up to 1024^3), so that a CPU worker owning some of
  the threads can be costed between the two (:class:`~autopar.machine.model.DeviceProfile`).
- Trust: each measurement goes on past its budget (up to twice it) while the last
  ``STABLE_LAST`` samples spread by more than ``STABLE_SPREAD`` of their median; the spread of
  each step (the median of its measurements' spreads) is kept in ``Profile.quality``. A busy
  host is said in ``quality["busy"]``: other processes using over ``BUSY_OTHERS`` of the cores
  while measuring (``/proc/stat`` less this process's own time), a load average over
  ``BUSY_LOAD`` per core before
  measuring, a reference loop that ran ``BUSY_DRIFT`` slower or faster at the end than at the
  start, or steps whose spread stays over ``BUSY_SPREAD``. :func:`autopar.machine.detect.detect`
  then keeps an earlier good profile instead (``--force`` saves this one).
- Nothing here decides anything: it returns a Profile; :func:`autopar.machine.detect.detect` caches
  it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autopar.ir.units import fmt_seconds
from autopar.machine.host import host_info
from autopar.machine.model import (
    DeviceProfile,
    GiB,
    LinkProfile,
    Profile,
    _now,
    fingerprint_of,
    link_key,
)

__all__ = ["BUSY_OTHERS", "MODES", "Progress", "calibrate", "console_progress", "cpu_busy",
           "other_cpu_share", "profile_tables"]

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called before each measuring step and once at the end."""


@dataclass(frozen=True)
class _Mode:
    budget_s: float  # time budget of one measurement (at least min_reps are taken regardless)
    min_reps: int
    cpu_mm: tuple[int, ...]  # square matmul sizes
    gpu_mm: tuple[int, ...]
    cpu_add: tuple[int, ...]  # elementwise sizes, elements
    gpu_add: tuple[int, ...]
    copy_bytes: tuple[int, ...]
    peer_bytes: tuple[int, ...]
    every_gpu: bool
    max_op_s: float  # skip curve sizes predicted to take longer than this per op


MODES: dict[str, _Mode] = {
    "quick": _Mode(
        budget_s=0.06, min_reps=3, max_op_s=0.05, every_gpu=False,
        cpu_mm=(4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
        gpu_mm=(8, 32, 128, 256, 512, 1024, 2048, 4096),
        cpu_add=(256, 4096, 65536, 2**20, 2**22, 2**24),
        gpu_add=(2**12, 2**16, 2**20, 2**24, 2**27),
        copy_bytes=(2**12, 2**18, 2**22, 2**24, 2**26), peer_bytes=(2**12, 2**26)),
    "full": _Mode(
        budget_s=0.5, min_reps=5, max_op_s=0.5, every_gpu=True,
        cpu_mm=(4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096),
        gpu_mm=(8, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192),
        cpu_add=(64, 256, 1024, 4096, 16384, 65536, 2**18, 2**20, 2**22, 2**24, 2**26),
        gpu_add=(2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28),
        copy_bytes=(2**10, 2**12, 2**16, 2**18, 2**20, 2**22, 2**24, 2**25, 2**26, 2**28),
        peer_bytes=(2**12, 2**20, 2**24, 2**26, 2**28)),
    # a seconds-long run of every code path, for tests: the numbers are rough
    "smoke": _Mode(
        budget_s=0.005, min_reps=2, max_op_s=0.01, every_gpu=False,
        cpu_mm=(4, 64, 256), gpu_mm=(8, 256), cpu_add=(256, 65536), gpu_add=(2**12, 2**20),
        copy_bytes=(2**12, 2**20), peer_bytes=(2**12, 2**20)),
}

_BATCH_S = 1e-3  # a timed batch lasts about this long: clock and sync do not matter
STABLE_LAST = 5  # samples whose spread says a measurement is stable
STABLE_SPREAD = 0.10  # (max - min) / median of those
BUSY_LOAD = 0.75  # load average per core before measuring
BUSY_DRIFT = 0.30  # reference loop, end against start
BUSY_SPREAD = 0.25  # median spread of a step
BUSY_OTHERS = 0.25  # share of the cores other processes (or the hypervisor) used meanwhile
_spreads: dict[str, list[float]] = {}  # step -> its measurements' spreads (while calibrating)
_step = [""]
aten = torch.ops.aten


# -- timing ----------------------------------------------------------------------------------
def _batch_size(fn: Callable[[], Any], sync: Callable[[], None]) -> int:
    """Calls per timed batch: enough for ``_BATCH_S``, judged from growing trial batches so
    that the sync ending a batch is not mistaken for the cost of a call."""
    fn()  # warm-up: first-call costs (allocations, library handles) are not the op's
    sync()
    k = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        took = time.perf_counter() - t0
        if took >= _BATCH_S / 4 or k >= 4096:
            return max(1, min(10_000, int(k * _BATCH_S / max(took, 1e-9))))
        k *= 4


def _repeat(timed_batch: Callable[[], float], mode: _Mode, budget_s: float | None) -> float:
    """The median of repeated batch timings (see the module docstring)."""
    budget = mode.budget_s if budget_s is None else budget_s
    deadline = time.perf_counter() + budget
    samples: list[float] = []
    while len(samples) < mode.min_reps or (time.perf_counter() < deadline and len(samples) < 200):
        samples.append(timed_batch())
    deadline += budget  # unstable: go on, up to twice the budget
    while _spread(samples) > STABLE_SPREAD and time.perf_counter() < deadline and \
            len(samples) < 400:
        samples.append(timed_batch())
    _spreads.setdefault(_step[0], []).append(_spread(samples))
    return statistics.median(samples)


def _spread(samples: list[float]) -> float:
    """(max - min) / median of the last ``STABLE_LAST`` samples (of all, if fewer)."""
    last = samples[-STABLE_LAST:]
    mid = statistics.median(last)
    return (max(last) - min(last)) / mid if mid > 0 else 0.0


def _load_per_core() -> float:
    """The 1-minute load average per core (0 where the OS has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


def cpu_busy() -> tuple[float, float, float] | None:
    """(wall clock, seconds the host's CPUs were busy (steal included), seconds this process
    ran) now, from ``/proc/stat`` (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle, iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0.0  # counted in user already
    own = os.times()
    return time.perf_counter(), (sum(fields) - idle - guest) / tick, own.user + own.system


def other_cpu_share(start: tuple[float, float, float] | None) -> float:
    """The share of the host's cores that other processes (and the hypervisor's steal) used
    since ``start`` (a :func:`cpu_busy` reading): a competitor running all along, which
    neither the load before nor the reference loop's drift sees."""
    end = cpu_busy()
    if start is None or end is None or end[0] <= start[0]:
        return 0.0
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, others / ((end[0] - start[0]) * (os.cpu_count() or 1)))


def _reference_s() -> float:
    """Seconds of a fixed pure-Python loop (best of 7): timed at the start and the end."""
    best = math.inf
    for _ in range(7):
        t0 = time.perf_counter()
        sum(range(100_000))
        best = min(best, time.perf_counter() - t0)
    return best


def _quality(load: float, drift: float, others: float = 0.0) -> dict[str, Any]:
    """``Profile.quality`` from this calibration's spreads, the load before, the drift of
    the reference loop and the share of the cores others used meanwhile; ``busy`` says why
    the host was judged busy ("" if it was not)."""
    spread = {step: round(statistics.median(s), 4) for step, s in _spreads.items() if s}
    why = []
    if load > BUSY_LOAD:
        why.append(f"load average {load:.2f} per core")
    if others > BUSY_OTHERS:
        why.append(f"other processes used {others:.0%} of the cores while measuring")
    if abs(drift) > BUSY_DRIFT:
        why.append(f"a reference loop ran {abs(drift):.0%} "
                   f"{'slower' if drift > 0 else 'faster'} at the end than at the start")
    noisy = [step for step, s in spread.items() if s > BUSY_SPREAD]
    if noisy:
        why.append(f"samples spread over {BUSY_SPREAD:.0%} in {', '.join(noisy)}")
    return {"spread": spread, "load": round(load, 3), "drift": round(drift, 3),
            "others": round(others, 3), "busy": "; ".join(why)}


def host_time(fn: Callable[[], Any], mode: _Mode, sync: Callable[[], None] = lambda: None,
              budget_s: float | None = None) -> float:
    """Wall seconds per call of ``fn`` (``sync`` waits for any device work it queued)."""
    inner = _batch_size(fn, sync)

    def batch() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        return (time.perf_counter() - t0) / inner

    return _repeat(batch, mode, budget_s)


class _GpuClock:
    """Device time of GPU work from CUDA events, with the stream kept busy during the launches
    (a ``torch.cuda._sleep`` queued first) so that host launch gaps are not counted."""

    def __init__(self, index: int, launch_s: float) -> None:
        self.index = index
        self.launch_s = launch_s
        self.cycles_per_s = self._sleep_rate()

    def _sleep_rate(self) -> float:
        cycles = 2_000_000
        rates = []
        with torch.cuda.device(self.index):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            for _ in range(3):
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                rates.append(cycles / (start.elapsed_time(end) * 1e-3))
        return statistics.median(rates)

    def time(self, fn: Callable[[], Any], mode: _Mode, budget_s: float | None = None) -> float:
        with torch.cuda.device(self.index):
            inner = _batch_size(fn, torch.cuda.synchronize)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            cover_s = inner * self.launch_s * 2 + 100e-6

            def batch() -> float:
                torch.cuda._sleep(int(cover_s * self.cycles_per_s))
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) * 1e-3 / inner

            return _repeat(batch, mode, budget_s)


# -- the steps -------------------------------------------------------------------------------
def _mm_flops(n: int) -> float:
    return 2.0 * n**3


def _rand(n: int, *shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    return torch.rand(*(shape or (n,)), dtype=dtype, device=device)


def _reference(mm_curve: tuple[tuple[float, float], ...], n: int) -> tuple[int, float]:
    """The largest measured square matmul size up to ``n``, and its float32 rate: the size
    other dtypes are compared at."""
    flops, rate = max((p for p in mm_curve if p[0] <= _mm_flops(n)), default=mm_curve[0])
    return round((flops / 2) ** (1 / 3)), rate


def _dtype_peaks(measure: Callable[[torch.dtype, int], float], n: int, fp32_peak: float,
                 dtypes: dict[str, torch.dtype]) -> dict[str, float]:
    """Peak FLOP/s of each dtype: its speed relative to float32 at size ``n``, times the float32
    peak. float32 is timed again right before each dtype, so that each ratio is of two
    measurements taken under the same conditions (a float32 rate from the curve, minutes
    earlier, made float64's figure differ by 23-44% between two runs on the 2-core VM)."""
    out = {"float32": fp32_peak}
    for name, dt in dtypes.items():
        fp32_s = measure(torch.float32, n)
        out[name] = fp32_s / measure(dt, n) * fp32_peak
    return out


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


Timer = Callable[[Callable[[], Any]], float]
"""Seconds of work of one call of a function (host: wall time less dispatch; GPU: kernel time)."""


CONV_SIZES = ((4, 4), (4, 8), (8, 16), (16, 16), (16, 32), (32, 32), (64, 28), (64, 56), (128, 28),
              (256, 14), (256, 28), (512, 14))
"""(channels, image side) of the ``conv`` curve's convolutions (batch 8, 3x3)."""


def _conv_flops(c: int, side: int) -> float:
    return 2.0 * 8 * c * c * 9 * side * side


STREAM_BYTES = 256 << 20
"""The host's ``read`` op takes its operands in turn from this many bytes of arrays (at most
``STREAM_PAIRS`` of them), and its ``write`` and ``exp`` ops keep their latest outputs alive, up to
``HELD_OUTPUTS`` of them and ``HELD_BYTES`` in all, as a program's live values are: a program
reads what earlier ops wrote, not one array in cache, and its outputs land in memory the
allocator must map afresh. Timed as one array over and over, a host op of 128 KB-4 MB ran 1.3-4x
faster than in a program, and plans put memory-bound ops on the host that ran slower there than
on the GPU (measured: see benchmarks/NOTES.md)."""
STREAM_PAIRS = 1024  # (the whole quick calibration peaks at ~0.8 GB resident on the VM, 12 s)
HELD_OUTPUTS = 16
HELD_BYTES = 128 << 20


class _Operands:
    """Operands of a ``sum`` and an ``add`` of n floats, streamed or not (see ``STREAM_BYTES``):
    each call takes the next of a ring of views of one buffer, made up front. ``fresh``: n
    floats written into fresh memory (``full``, nothing read), and ``exp`` of the next operand,
    their outputs kept until ``HELD_OUTPUTS`` are alive, then all let go (a call's values freed
    at its end). Unstreamed: one pair."""

    @staticmethod
    def _counts(n: int, streamed: bool) -> tuple[int, int]:
        """Operand pairs of size ``n`` in the ring, and outputs held at most."""
        pairs = max(2, min(STREAM_PAIRS, STREAM_BYTES // (8 * n))) if streamed else 1
        return pairs, max(1, min(HELD_OUTPUTS, HELD_BYTES // (4 * n)))

    @staticmethod
    def nbytes(n: int, streamed: bool) -> int:
        """Bytes the operands and held outputs of size ``n`` take at most."""
        if not streamed:
            return 12 * n
        pairs, held = _Operands._counts(n, streamed)
        return 8 * n * pairs + 4 * n * held

    def __init__(self, n: int, device: str, streamed: bool) -> None:
        pairs, self._held_max = self._counts(n, streamed)
        buf = torch.rand(2 * n * pairs, device=device)
        both = [buf[2 * k * n:(2 * k + 2) * n] for k in range(pairs)]
        self.first = both[0][:n]
        self._n = n
        self._both = itertools.cycle(both)
        self._pairs = itertools.cycle([(b[:n], b[n:]) for b in both])
        self._held: list[torch.Tensor] = []

    def sum(self) -> Any:
        return aten.sum.default(next(self._both))

    def add(self) -> Any:
        return aten.add.Tensor(*next(self._pairs))

    def fresh(self) -> None:
        self._hold(aten.full.default([self._n], 1.0))

    def exp(self) -> None:
        self._hold(aten.exp.default(next(self._pairs)[0]))

    def _hold(self, out: torch.Tensor) -> None:
        held = self._held
        held.append(out)
        if len(held) >= self._held_max:
            held.clear()


def _curves(timer: Timer, device: str, mm_sizes: tuple[int, ...], add_sizes: tuple[int, ...],
            max_bytes: float, max_op_s: float, streamed: bool = False
            ) -> dict[str, tuple[tuple[float, float], ...]]:
    """The ``matmul``, ``read``, ``write``, ``exp`` and ``conv`` curves of a device (see
    autopar.machine.model.CURVES).

    ``read`` from ``sum`` over 2n floats (8n bytes read); ``write``, what producing 4n fresh bytes
    costs: ``add`` of two n-float arrays less the time of reading its 8n bytes, or, ``streamed``
    (the host: operands and outputs as a program has them, ``STREAM_BYTES``), ``full`` of n
    floats into memory kept alive a while (streamed, each op less its time on one float: its
    own dispatch and bookkeeping, not memory; on the 2-core VM, streamed ``sum`` and ``full`` add
    up to ``add`` within 25%; add less sum swung from 0 to 100 us at 4 MB). Sizes
    whose op the curve so far predicts to take over ``max_op_s`` are skipped.
    """
    def too_slow(points: list[tuple[float, float]], size: float) -> bool:
        """Would an op of ``size`` outlast ``max_op_s``? Judged by the most hopeful linear
        extrapolation from the measured points: fixed overheads make the small ones pessimistic
        and a disturbed measurement is slow, so neither stops the sweep early."""
        guess = min((size / rate for _, rate in points), default=0.0)
        return guess > max_op_s

    mm: list[tuple[float, float]] = []
    for n in mm_sizes:
        if too_slow(mm, _mm_flops(n)):
            break  # a slow host: the curve's last rate stands for the bigger sizes
        a, b = _rand(n, n, n, device=device), _rand(n, n, n, device=device)
        mm.append((_mm_flops(n), _mm_flops(n) / timer(lambda a=a, b=b: aten.mm(a, b))))
    read: list[tuple[float, float]] = []
    write: list[tuple[float, float]] = []
    exp: list[tuple[float, float]] = []
    # what a streamed op on one float costs past ``timer``'s own floor (``add``'s dispatch):
    # its own dispatch and the holding of its output, not memory (``full``: 1.45 us of every
    # write up to 4 KB on an H100's host, which priced a 5x10x5 matmul at 3.5 us against 1.9;
    # ``sum`` 0.5 us)
    one = _Operands(1, device, streamed) if streamed else None
    floors = {"sum": timer(one.sum), "fresh": timer(one.fresh), "exp": timer(one.exp)} \
        if one is not None else {}
    del one

    def less_floor(name: str, t: float) -> float:
        return max(t - floors.get(name, 0.0), 0.1 * t)

    for n in add_sizes:
        if max(20 * n, _Operands.nbytes(n, streamed)) > max_bytes or too_slow(write, 4.0 * n):
            break
        ops = _Operands(n, device, streamed)
        t_read = less_floor("sum", timer(ops.sum))
        if streamed:  # measured alone: add less sum swung 0-100 us at 4 MB (the VM)
            t_write = less_floor("fresh", timer(ops.fresh))
        else:
            t_add = timer(ops.add)
            t_write = max(t_add - t_read, 0.1 * t_add)
        read.append((8.0 * n, 8.0 * n / t_read))
        write.append((4.0 * n, 4.0 * n / t_write))
        exp.append((float(n), n / (less_floor("exp", timer(ops.exp)) if streamed else
                                   timer(lambda a=ops.first: aten.exp.default(a)))))
        del ops
    conv: list[tuple[float, float]] = []
    for c, side in CONV_SIZES:
        flops = _conv_flops(c, side)
        if too_slow(conv, flops) or too_slow(mm, flops):
            break
        x, w = _rand(c, 8, c, side, side, device=device), _rand(c, c, c, 3, 3, device=device)
        conv.append((flops, flops / timer(lambda x=x, w=w: aten.convolution.default(
            x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))))
        del x, w
    return {"matmul": tuple(mm), "read": tuple(read), "write": tuple(write), "exp": tuple(exp),
            "conv": tuple(conv)}


def _calibrate_cpu(mode: _Mode, step: Callable[[str], None]) -> tuple[DeviceProfile, float]:
    """The host's DeviceProfile and the cost of one thread hand-off."""
    threads = torch.get_num_threads()
    step("cpu: dispatch overhead")
    one = torch.ones(1)
    launch = host_time(lambda: aten.add.Tensor(one, one), mode)

    def timer(fn: Callable[[], Any]) -> float:
        t = host_time(fn, mode)
        return max(t - launch, 0.05 * t)

    step(f"cpu: matmul and memory, {threads} threads")
    memory = _host_memory()
    curves = _curves(timer, "cpu", mode.cpu_mm, mode.cpu_add, memory / 4, mode.max_op_s,
                     streamed=True)
    step("cpu: matmul and memory, 1 thread")
    if threads > 1:  # a worker owning a few threads is costed between the two (Amdahl)
        with _torch_threads(1):
            single = _curves(timer, "cpu", tuple(n for n in mode.cpu_mm if n <= 1024),
                             mode.cpu_add, memory / 4, mode.max_op_s, streamed=True)
        curves.update({f"{k}@1t": v for k, v in single.items()})

    step("cpu: matmul other dtypes")
    ref_n, _ = _reference(curves["matmul"], 512)

    def mm_time(dt: torch.dtype, n: int) -> float:
        a, b = _rand(n, n, n, dtype=dt), _rand(n, n, n, dtype=dt)
        return timer(lambda: aten.mm(a, b))

    flops = _dtype_peaks(mm_time, ref_n, max(r for _, r in curves["matmul"]),
                         {"float64": torch.float64, "bfloat16": torch.bfloat16,
                          "float16": torch.float16})

    step("cpu: thread hand-off")
    handoff = _thread_handoff(mode)
    profile = DeviceProfile(
        kind="cpu", model=str(host_info()["cpu_model"]), launch_s=launch, min_kernel_s=launch,
        flops=flops, mem_bw=max(r for _, r in curves["read"]), memory_bytes=memory,
        curves=curves, threads=threads)
    return profile, handoff


def _thread_handoff(mode: _Mode) -> float:
    """Seconds for one worker thread to wake another through a queue (half a round trip)."""
    ping: queue.SimpleQueue[int] = queue.SimpleQueue()
    pong: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (x := ping.get()) >= 0:
            pong.put(x)

    worker = threading.Thread(target=echo, daemon=True)
    worker.start()
    try:
        def round_trip() -> None:
            ping.put(1)
            pong.get()

        return host_time(round_trip, mode) / 2
    finally:
        ping.put(-1)
        worker.join()


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _calibrate_gpu(i: int, mode: _Mode, step: Callable[[str], None]) -> DeviceProfile:
    dev = f"cuda:{i}"
    props = torch.cuda.get_device_properties(i)
    usable = int(props.total_memory * 0.92)

    def sync() -> None:
        torch.cuda.synchronize(i)

    step(f"{dev}: launch overhead")
    one = torch.ones(1, device=dev)
    launch = host_time(lambda: aten.add.Tensor(one, one), mode, sync)
    small = torch.ones(8, 8, device=dev)
    launch_mm = host_time(lambda: aten.mm(small, small), mode, sync)  # cuBLAS costs more
    clock = _GpuClock(i, max(launch, launch_mm))
    min_kernel = clock.time(lambda: aten.add.Tensor(one, one), mode)

    def timer(fn: Callable[[], Any]) -> float:
        return clock.time(fn, mode)

    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        step(f"{dev}: matmul float32 and memory")
        curves = _curves(timer, dev, mode.gpu_mm, mode.gpu_add, usable / 4, mode.max_op_s)
        torch.cuda.empty_cache()
        ref_n, _ = _reference(curves["matmul"], mode.gpu_mm[-1])

        step(f"{dev}: matmul tf32, float16, bfloat16, float64")

        def mm_time(dt: torch.dtype | str, n: int) -> float:
            torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
            real = torch.float32 if dt == "tf32" else dt
            a, b = _rand(n, n, n, dtype=real, device=dev), _rand(n, n, n, dtype=real, device=dev)
            return clock.time(lambda: aten.mm(a, b), mode)

        flops = _dtype_peaks(mm_time, ref_n, max(r for _, r in curves["matmul"]),
                             {"tf32": "tf32", "float16": torch.float16,  # type: ignore[dict-item]
                              "bfloat16": torch.bfloat16, "float64": torch.float64})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    return DeviceProfile(
        kind="cuda", model=props.name, launch_s=launch, min_kernel_s=min_kernel, flops=flops,
        mem_bw=max(r for _, r in curves["read"]), memory_bytes=usable, curves=curves,
        launch_by_kind={"matmul": launch_mm}, sm_count=int(props.multi_processor_count))


def _fit_link(points: list[tuple[int, float]]) -> LinkProfile:
    (n0, t0), (n1, t1) = points[0], points[-1]
    bandwidth = (n1 - n0) / max(t1 - t0, 1e-9)
    latency = max(t0 - n0 / bandwidth, 0.0)
    return LinkProfile(latency, bandwidth, tuple(points))


def _host_links(dev: str, mode: _Mode, sync_all: Callable[[], None]
                ) -> dict[str, LinkProfile]:
    h2d, d2h, h2d_pg, d2h_pg = [], [], [], []
    for nbytes in mode.copy_bytes:
        n = nbytes // 4
        host = torch.rand(n).pin_memory()
        gpu = torch.empty(n, device=dev)
        h2d.append((nbytes, host_time(lambda g=gpu, h=host: g.copy_(h, non_blocking=True),
                                      mode, sync_all)))
        d2h.append((nbytes, host_time(lambda g=gpu, h=host: h.copy_(g, non_blocking=True),
                                      mode, sync_all)))
        pageable = torch.rand(n)
        h2d_pg.append((nbytes, host_time(lambda p=pageable, d=dev: p.to(d), mode, sync_all)))
        d2h_pg.append((nbytes, host_time(lambda g=gpu: g.cpu(), mode, sync_all)))
        del host, gpu, pageable
    return {link_key("cpu", dev, True): _fit_link(h2d), link_key(dev, "cpu", True): _fit_link(d2h),
            link_key("cpu", dev, False): _fit_link(h2d_pg),
            link_key(dev, "cpu", False): _fit_link(d2h_pg)}


def _peer_link(i: int, j: int, mode: _Mode, sync_all: Callable[[], None]) -> LinkProfile:
    pts = []
    for nbytes in mode.peer_bytes:
        src = torch.rand(nbytes // 4, device=f"cuda:{i}")
        dst = torch.empty(nbytes // 4, device=f"cuda:{j}")
        pts.append((nbytes, host_time(lambda d=dst, s=src: d.copy_(s, non_blocking=True),
                                      mode, sync_all)))
        del src, dst
    return _fit_link(pts)


def _link_plan(n_gpus: int, every: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """GPUs whose host links are measured, and GPU pairs whose copies are; the rest take the
    numbers of a measured GPU of the same model / a measured pair of the same peer access."""
    pairs = [(i, j) for i in range(n_gpus) for j in range(n_gpus) if i != j]
    if every:
        return list(range(n_gpus)), pairs
    by_access: dict[bool, tuple[int, int]] = {}
    for i, j in pairs:
        by_access.setdefault(torch.cuda.can_device_access_peer(i, j), (i, j))
    return _distinct_models(n_gpus), sorted(by_access.values())


def _calibrate_links(n_gpus: int, mode: _Mode, step: Callable[[str], None]
                     ) -> dict[str, LinkProfile]:
    def sync_all() -> None:
        for j in range(n_gpus):
            torch.cuda.synchronize(j)

    gpus, pairs = _link_plan(n_gpus, mode.every_gpu)
    measured: dict[int, dict[str, LinkProfile]] = {}
    for i in gpus:
        step(f"cuda:{i}: host copies")
        measured[i] = _host_links(f"cuda:{i}", mode, sync_all)
    peer: dict[tuple[int, int], LinkProfile] = {}
    for i, j in pairs:
        step(f"cuda:{i} -> cuda:{j} copies")
        peer[(i, j)] = _peer_link(i, j, mode, sync_all)

    links: dict[str, LinkProfile] = {}
    for i in range(n_gpus):
        twin = i if i in measured else _twin(i, gpus)
        for key, link in measured[twin].items():
            links[key.replace(f"cuda:{twin}", f"cuda:{i}")] = link
        for j in range(n_gpus):
            if i != j:
                access = torch.cuda.can_device_access_peer(i, j)
                like = peer.get((i, j)) or next(
                    (v for (a, b), v in peer.items()
                     if torch.cuda.can_device_access_peer(a, b) == access), None)
                links[link_key(f"cuda:{i}", f"cuda:{j}")] = like or next(iter(peer.values()))
    return links


def _twin(i: int, measured: list[int]) -> int:
    """A measured GPU of the same model as GPU ``i``."""
    name = torch.cuda.get_device_properties(i).name
    return next(k for k in measured if torch.cuda.get_device_properties(k).name == name)


def _gpu_sync_costs(mode: _Mode) -> tuple[float, float]:
    """(host sync on an idle GPU, event record + stream wait) in seconds, on GPU 0."""
    torch.cuda.synchronize(0)
    with torch.cuda.device(0):
        sync = host_time(lambda: torch.cuda.synchronize(0), mode)
        other = torch.cuda.Stream()
        ev = torch.cuda.Event()

        def record_wait() -> None:
            ev.record()
            other.wait_event(ev)

        wait = host_time(record_wait, mode, lambda: torch.cuda.synchronize(0))
    return sync, wait


# -- the whole calibration -------------------------------------------------------------------
def calibrate(mode: str = "quick", *, host: dict[str, Any] | None = None,
              progress: Progress | None = None) -> Profile:
    """Measure this host and return its Profile (not saved: :func:`autopar.machine.detect.detect`
    and ``autopar calibrate`` do that). ``mode``: ``"quick"`` (<= 20 s), ``"full"``, or ``"smoke"``
    (a seconds-long pass over every code path, rough numbers, for tests).

    Safe to call from inside ``torch.compile``'s tracing (a backend asking for its machine):
    an active fake-tensor mode is set aside, or every timed op would do no work."""
    with unset_fake_temporarily(), torch.no_grad():
        return _calibrate(mode, host, progress)


def _calibrate(mode: str, host: dict[str, Any] | None, progress: Progress | None) -> Profile:
    if mode not in MODES:
        raise ValueError(f"calibration mode {mode!r}: use one of {sorted(MODES)}")
    m = MODES[mode]
    host = dict(host) if host is not None else host_info()
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    measured = list(range(n_gpus)) if m.every_gpu else _distinct_models(n_gpus)
    link_gpus, link_pairs = _link_plan(n_gpus, m.every_gpu) if n_gpus else ([], [])
    total = (6 + 3 * len(measured) + len(link_gpus) + len(link_pairs)
             + (1 if n_gpus else 0))
    done = 0

    def step(what: str) -> None:
        nonlocal done
        _step[0] = what
        if progress is not None:
            progress(what, done, total)
        done += 1

    _spreads.clear()
    load, reference, busy_at = _load_per_core(), _reference_s(), cpu_busy()
    with torch.no_grad():
        cpu, handoff = _calibrate_cpu(m, step)
        devices = {"cpu": cpu}
        for i in measured:
            devices[f"cuda:{i}"] = _calibrate_gpu(i, m, step)
        for i in range(n_gpus):  # unmeasured GPUs take the numbers of a measured one alike
            if f"cuda:{i}" not in devices:
                devices[f"cuda:{i}"] = devices[f"cuda:{_twin(i, measured)}"]
        links = _calibrate_links(n_gpus, m, step) if n_gpus else {}
        if n_gpus:
            step("host sync and event wait")
            host_sync, event_wait = _gpu_sync_costs(m)
        else:
            host_sync, event_wait = 0.0, handoff
        step("view ops")
        base = torch.ones(16, 16)
        view = host_time(lambda: aten.view.default(base, [256]), m)
    quality = _quality(load, _reference_s() / reference - 1, other_cpu_share(busy_at))
    if progress is not None:
        progress("done", total, total)
    return Profile(fingerprint=fingerprint_of(host), host=host, devices=devices, links=links,
                   host_sync_s=host_sync, event_wait_s=event_wait, view_s=view,
                   source=f"measured-{mode}", created=_now(), quality=quality)


def _distinct_models(n_gpus: int) -> list[int]:
    """The first GPU of each model: quick mode measures only these."""
    seen: dict[str, int] = {}
    for i in range(n_gpus):
        seen.setdefault(torch.cuda.get_device_properties(i).name, i)
    return sorted(seen.values())


# -- presentation (used by the CLI and by detect's first-run message) ------------------------
@contextlib.contextmanager
def console_progress(transient: bool = True) -> Iterator[Progress]:
    """A rich progress bar on stderr, as a :data:`Progress` callback."""
    from rich.console import Console  # lazy: start-up cost
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn  # lazy: start-up cost
    from rich.progress import Progress as Bar  # lazy: start-up cost

    bar = Bar(TextColumn("calibrating"), BarColumn(), TextColumn("{task.description}"),
              TimeElapsedColumn(), console=Console(stderr=True), transient=transient)
    with bar:
        task = bar.add_task("", total=1)

        def update(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        yield update


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"




def profile_tables(profile: Profile) -> list[Any]:
    """Rich tables of a profile: devices, links, and the machine-wide costs."""
    from rich.table import Table  # lazy: start-up cost

    dev = Table(title=f"autopar profile {profile.fingerprint} ({profile.source}, "
                      f"{profile.created or 'built in'})")
    names = sorted(profile.devices)
    dev.add_column("")
    for name in names:
        dev.add_column(name, justify="right")

    def rate(d: DeviceProfile, dt: str) -> str:
        return _si(d.flops[dt], "FLOP/s") if dt in d.flops else "-"

    rows: list[tuple[str, Callable[[DeviceProfile], str]]] = [
        ("model", lambda d: d.model),
        ("launch", lambda d: fmt_seconds(d.launch_s)),
        ("min kernel", lambda d: fmt_seconds(d.min_kernel_s)),
        *((f"matmul {dt}", lambda d, dt=dt: rate(d, dt))
          for dt in ("float32", "tf32", "float16", "bfloat16", "float64")),
        ("launch matmul", lambda d: fmt_seconds(d.launch("matmul"))),
        ("read bandwidth", lambda d: _si(d.mem_bw, "B/s")),
        ("write 64 MiB", lambda d: fmt_seconds(d.write_time(2**26))),
        ("usable memory", lambda d: _si(d.memory_bytes, "B")),
        ("threads / SMs", lambda d: str(d.threads or d.sm_count)),
    ]
    for label, cell in rows:
        dev.add_row(label, *(cell(profile.devices[n]) for n in names))
    tables: list[Any] = [dev]
    if profile.links:
        links = Table(title="links")
        for col in ("link", "latency", "bandwidth", "64 KiB", "4 MiB", "64 MiB"):
            links.add_column(col, justify="left" if col == "link" else "right")
        for key, k in sorted(profile.links.items()):
            links.add_row(key, fmt_seconds(k.latency_s), _si(k.bandwidth, "B/s"),
                          *(fmt_seconds(k.time(n)) for n in (2**16, 2**22, 2**26)))
        tables.append(links)
    misc = Table(title="machine-wide")
    misc.add_column("cost")
    misc.add_column("time", justify="right")
    misc.add_row("host sync (idle device)", fmt_seconds(profile.host_sync_s))
    misc.add_row("event record + wait / worker hand-off", fmt_seconds(profile.event_wait_s))
    misc.add_row("view op (host)", fmt_seconds(profile.view_s))
    tables.append(misc)
    if profile.quality:
        q = profile.quality
        trust = Table(title=f"measured {profile.created}",
                      caption=f"load {q.get('load', 0):.2f} per core before, reference loop "
                              f"{q.get('drift', 0):+.0%} at the end; "
                              + (f"BUSY: {q['busy']}" if q.get("busy") else "host quiet"))
        trust.add_column("step")
        trust.add_column("spread", justify="right")
        for step, spread in q.get("spread", {}).items():
            trust.add_row(step, f"{spread:.1%}")
        tables.append(trust)
    return tables

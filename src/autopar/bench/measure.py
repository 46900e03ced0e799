"""The timing primitive: a callable's per-call time, as a user sees it.

Policy
- :func:`measure` warms up, then takes ``repeat`` samples. A sample is ``inner`` calls between
  two synchronizations of *every* CUDA device (``torch.cuda.synchronize()`` alone waits for the
  current device only), read with ``perf_counter``: wall time, host overheads and hidden syncs
  included, as a user sees it. ``inner`` is chosen so that a sample lasts at least
  ``min_sample_s``: microsecond workloads are not drowned by the clock and the sync. It reports
  the median and the 10th and 90th percentiles of the per-call time. With ``min_total_s``, a
  variant whose ``repeat`` samples would time less than that takes more (up to
  ``MAX_SAMPLES``): a median of 5 one-millisecond samples moved by 25% on 2xH200 when one
  spell of the machine fell on 2 of them, and 50 such samples cost 50 ms.
- :func:`measure_side_by_side` interleaves: after every variant is warmed up, each round takes
  one sample of each, so a slow spell of a shared machine falls on all of them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_SAMPLES", "SUITE_MIN_TOTAL_S", "Prepared", "Stats", "in_process_compiles",
           "measure", "measure_side_by_side", "sync_all"]


@dataclass(frozen=True)
class Stats:
    """Per-call seconds over ``n`` samples."""

    median: float
    p10: float
    p90: float
    n: int

    @staticmethod
    def of(samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("Stats.of needs at least one sample")
        s = sorted(samples)
        return Stats(statistics.median(s), _percentile(s, 0.10), _percentile(s, 0.90), len(s))


def _percentile(sorted_samples: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_samples) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


def sync_all(devices: Iterable[int] | None = None) -> None:
    """Wait for every CUDA device (or those listed) to finish its queued work."""
    if devices is None:
        if not torch.cuda.is_available():
            return
        devices = range(torch.cuda.device_count())
    for i in devices:
        torch.cuda.synchronize(i)


Prepared = tuple[Callable[..., Any], tuple]


def measure(fn: Callable[..., Any], *args: Any, warmup: int = 3, repeat: int = 10,
            sync_devices: Sequence[int] | None = None, inner: int | None = None,
            min_sample_s: float = 1e-3, budget_s: float | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Stats:
    """Time ``fn(*args)``: median and percentiles of per-call seconds.

    ``sync_devices``: CUDA device indices to synchronize around each sample (None: all of them).
    ``inner``: calls per sample (None: enough for ``min_sample_s``). ``budget_s``: with ``inner``
    None, fewer samples (at least 3) when ``repeat`` of them would take longer than this.
    """
    result = measure_side_by_side(
        {"fn": (fn, args)}, warmup=warmup, repeat=repeat, sync_devices=sync_devices,
        inner=inner, min_sample_s=min_sample_s, budget_s=budget_s, clock=clock)["fn"]
    if isinstance(result, Exception):
        raise result
    return result


def in_process_compiles() -> None:
    """Have Inductor compile in this process (``compile_threads = 1``) from now on.

    Its default pool of compile worker processes starts after the first compile and keeps
    every core busy for seconds: host code measured then runs up to ~300x slower (2xH200 host:
    a 4 MB host copy 23 us -> 8 ms), whichever variant is being timed. Benchmarks call this
    before they compile anything, so ``torch.compile`` and autopar are timed on a quiet host."""
    from torch._inductor import config  # lazy: slow to import

    config.compile_threads = 1


def measure_side_by_side(prepared: dict[str, Prepared], *, warmup: int = 3, repeat: int = 10,
                         sync_devices: Sequence[int] | None = None, inner: int | None = None,
                         min_sample_s: float = 1e-3, budget_s: float | None = None,
                         min_total_s: float = 0.0,
                         clock: Callable[[], float] = time.perf_counter
                         ) -> dict[str, Stats | Exception]:
    """Time several callables in interleaved rounds (a sample of each per round), so that a
    slow spell of the machine falls on all of them alike. Each starts its samples with the
    intra-op thread count the harness had. A callable that raises gets its exception."""
    def sync() -> None:
        sync_all(sync_devices)

    threads = torch.get_num_threads()
    plans: dict[str, tuple[int, int]] = {}  # name -> (calls per sample, samples)
    out: dict[str, Stats | Exception] = {}
    for name, (fn, args) in prepared.items():
        try:
            for _ in range(warmup):
                fn(*args)
            sync()
            plans[name] = (inner, repeat) if inner else _plan(
                fn, args, sync, clock, min_sample_s, repeat, budget_s, min_total_s)
        except Exception as e:
            out[name] = e
    samples: dict[str, list[float]] = {name: [] for name in plans}
    for round_ in range(max((n for _, n in plans.values()), default=0)):
        for name, (calls, n) in plans.items():
            if round_ >= n or name in out:
                continue
            fn, args = prepared[name]
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            try:
                t0 = clock()
                for _ in range(calls):
                    fn(*args)
                sync()
                samples[name].append((clock() - t0) / calls)
            except Exception as e:
                out[name] = e
    for name in plans:
        out.setdefault(name, Stats.of(samples[name]))
    return {name: out[name] for name in prepared}


def _plan(fn: Callable[..., Any], args: tuple, sync: Callable[[], None],
          clock: Callable[[], float], min_sample_s: float, repeat: int,
          budget_s: float | None, min_total_s: float = 0.0) -> tuple[int, int]:
    """Calls per sample (a sample lasts at least ``min_sample_s``) and samples (at least
    ``repeat``, or enough to time ``min_total_s`` in all, up to ``MAX_SAMPLES``; then within
    ``budget_s``, at least 3), from one timed call."""
    t0 = clock()
    fn(*args)
    sync()
    first = max(clock() - t0, 1e-9)
    calls = 1 if first >= min_sample_s else min(10_000, math.ceil(min_sample_s / first))
    sample = first * calls
    repeat = max(repeat, min(MAX_SAMPLES, math.ceil(min_total_s / sample)))
    if budget_s is not None:
        repeat = max(3, min(repeat, int(budget_s / sample)))
    return calls, repeat


MAX_SAMPLES = 200
"""The most samples ``min_total_s`` asks for."""
SUITE_MIN_TOTAL_S = 0.05
"""The suite's ``min_total_s``: each variant of a workload is timed for at least this long."""

"""Each rank's program compiled as on one device: the way measured, and agreed by every rank.

Policy and invariants
- Ways (:data:`RANK_WAYS`): ``eager``; ``inductor`` (``torch.compile``); ``cudagraphs``
  (``torch.compile(mode="reduce-overhead")``, on a GPU only). The candidates are the
  ``candidates`` option (else ``$AUTOPAR_CANDIDATES``) among these; none of them leaves eager.
- The compiled regions are the replicated modules' children that hold parameters, each its own
  ``torch.compile`` (``nn.Module.compile``'s hook, so names and ``state_dict`` are unchanged).
  The module's own forward stays eager: DDP arms its reducer there, and a loss computed there
  keeps the autograd graph :mod:`autopar.distributed.loss` reads its weight from.
- A region runs with its module's DDP instance active, so dynamo's ``DDPOptimizer`` cuts its
  graph at DDP's bucket boundaries: each bucket's gradients come out of a backward graph of
  their own and are all-reduced while the rest of backward runs, as in eager.
- The trial: each candidate runs ``WARM_CALLS`` untimed calls (compiling, recording graphs),
  then ``TIMED_CALLS`` timed ones. The ranks agree on the slowest rank's median of each way
  (an all-reduce of the medians) and all keep the fastest. Every rank changes way at the same
  call, since every rank makes every call.
- A region whose compilation raises runs eagerly from then on, and its way's time is
  infinite on that rank, so no rank keeps it; the reason is logged once.

Extension points: :data:`RANK_WAYS` and :func:`_compiler` (how a way compiles a region).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate import replicate

from ..ir.logs import first_line

__all__ = ["RANK_WAYS", "TIMED_CALLS", "WARM_CALLS", "RankWays", "rank_candidates"]

log = logging.getLogger("autopar.dataparallel")

RANK_WAYS = ("eager", "inductor", "cudagraphs")
WARM_CALLS = 3
"""Untimed calls of a way: the first compiles, reduce-overhead records its graphs after
warming up."""
TIMED_CALLS = 5


def rank_candidates(candidates: Sequence[str], device: torch.device) -> tuple[str, ...]:
    """The ways a rank on ``device`` tries, of ``candidates`` (autopar's way names)."""
    ways = tuple(w for w in RANK_WAYS if w in candidates
                 and (w != "cudagraphs" or device.type == "cuda"))
    return ways or ("eager",)


def _compiler(way: str) -> Callable[[Callable], Callable]:
    mode = "reduce-overhead" if way == "cudagraphs" else None
    return lambda fn: torch.compile(fn, mode=mode)


class RankWays:
    """The rank's compiled regions and the trial among ``ways`` (see the module docstring)."""

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module]], ways: Sequence[str],
                 device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.ways, self.device, self.group = tuple(ways), device, group
        #: (name, child, the replicated module holding it)
        self.regions = [(f"{name}.{child_name}", child, module)
                        for name, module in modules
                        for child_name, child in module.named_children()
                        if child._compiled_call_impl is None  # the script compiled it itself
                        and next(child.parameters(), None) is not None]
        #: seconds of each timed call, by way
        self.times: dict[str, list[float]] = {w: [] for w in self.ways}
        self.failed: dict[str, str] = {}
        #: the way every rank keeps, once the trial is over (at once where there is one way)
        self.kept: str | None = self.ways[0] if len(self.ways) == 1 else None
        self._calls = 0
        self._entries: dict[tuple[str, int], Callable] = {}
        self._in_use: str | None = None  # the way the regions are set to
        self._use(self.kept or self.ways[0])

    @property
    def way(self) -> str:
        """The way the next call runs."""
        return self.kept or self.ways[min(self._calls // (WARM_CALLS + TIMED_CALLS),
                                          len(self.ways) - 1)]

    @contextlib.contextmanager
    def call(self) -> Any:
        """Around one call of the step: runs it the current way, timing it in the trial."""
        way = self.way
        self._use(way)
        timed = self.kept is None and self._calls % (WARM_CALLS + TIMED_CALLS) >= WARM_CALLS
        if timed:
            self._sync()
            start = time.perf_counter()
        yield
        if timed:
            self._sync()
            self.times[way].append(time.perf_counter() - start)
        self._calls += 1
        if self.kept is None and self._calls == len(self.ways) * (WARM_CALLS + TIMED_CALLS):
            self._decide()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _decide(self) -> None:
        mine = [float("inf") if w in self.failed else statistics.median(self.times[w])
                for w in self.ways]
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        self.medians = dict(zip(self.ways, slowest.tolist()))
        self.kept = min(self.ways, key=lambda w: self.medians[w])
        self._use(self.kept)
        log.info("autopar: every rank keeps %s (the slowest rank's median step: %s)",
                 self.kept, self._medians())

    def _medians(self) -> str:
        return ", ".join(f"{w} {s * 1e3:.2f} ms" for w, s in self.medians.items())

    def describe(self) -> str:
        names = ", ".join(n for n, *_ in self.regions) or "none"
        if self.kept is None:
            return f"  compiled regions: {names}; trying {', '.join(self.ways)}"
        if len(self.ways) == 1:
            return f"  compiled regions: {names}; way: {self.kept}"
        return (f"  compiled regions: {names}; kept {self.kept} (the slowest rank's median "
                f"step: {self._medians()})")

    # -- the regions ------------------------------------------------------------------------
    def _use(self, way: str) -> None:
        """Set every region to ``way`` (once per change of way: a kept way costs no call)."""
        if way == self._in_use:
            return
        self._in_use = way
        for name, child, module in self.regions:
            key = (way, id(child))
            if way == "eager" or way in self.failed:
                child._compiled_call_impl = None
            else:
                if key not in self._entries:
                    self._entries[key] = self._entry(way, name, child, module)
                child._compiled_call_impl = self._entries[key]

    def _entry(self, way: str, name: str, child: torch.nn.Module,
               module: torch.nn.Module) -> Callable:
        compiled = _compiler(way)(child._call_impl)
        tried = False

        def entry(*args: Any, **kwargs: Any) -> Any:
            nonlocal tried
            ddp = getattr(replicate.state(module), "_ddp", None)
            with ddp._inside_ddp_forward() if ddp is not None else contextlib.nullcontext():
                if tried:
                    return compiled(*args, **kwargs)
                try:
                    out = compiled(*args, **kwargs)
                except Exception as e:  # compiling failed: this region runs eagerly
                    reason = f"{type(e).__name__}: {first_line(e)}"
                    self.failed.setdefault(way, f"{name}: {reason}")
                    log.warning("autopar: %s could not run as %s (%s); it runs eagerly",
                                name, way, reason)
                    child._compiled_call_impl = None
                    self._in_use = None  # the next call sets every region of the way eager
                    return child._call_impl(*args, **kwargs)
                tried = True
                return out

        return entry

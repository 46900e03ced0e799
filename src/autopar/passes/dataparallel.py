"""Data parallelism's choice: a step placed unsplit and split over k devices for each k, the
one predicted fastest kept (see :mod:`autopar.dataparallel` for the policy)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..capture.step import StepGraph
from ..ir.graph import Node
from ..machine.model import GiB
from ..schedule.place import memory_limits, place
from ..schedule.plan import make_plan
from ..schedule.simulate import peak_memory, simulate
from .shard import NotShardable, Sharded, shard

__all__ = ["Choice", "choose", "shard_devices"]

log = logging.getLogger("autopar.dataparallel")


@dataclass
class Choice:
    """What :func:`choose` picked: the placement that runs, the sharded graph (None: unsplit)
    and the predicted seconds of every candidate (key ``"unsplit"`` or the devices joined by
    commas)."""

    placement: Any
    sharded: Sharded | None
    predicted: dict[str, float]
    refused: dict[str, str] = field(default_factory=dict)  # candidate -> why it can't run


def choose(step: StepGraph, batch: dict[Node, int], cost: Any, devices: Sequence[str], *,
           policy: str = "heft", shards: int | None = None) -> Choice:
    """Place ``step`` unsplit and split over the first k same-kind devices (home first) for
    k = 1, 2, 4, ... and all of them, and keep the one predicted fastest; ``shards`` forces k
    (1: don't split). A split over two devices whose big partial sums are reduced in chunks
    (:mod:`autopar.passes.shard`) is also placed with every sum reduced at once (key
    ``"<devices> at once"``): the model picks."""
    devices, same_kind = shard_devices(batch, cost, devices, shards)
    n = len(same_kind)
    ks = sorted({k for k in (1 << i for i in range(n.bit_length())) if k <= n} | {n}) \
        if shards is None else [shards]  # powers of two and all: planning time stays bounded
    predicted: dict[str, float] = {}
    placed_all: list[tuple[str, Any, Sharded | None]] = []
    for k in ks:
        if k == 1:
            placed, sharded = place(step.graph, cost, policy=policy, devices=devices), None
            label = "unsplit"
            candidates = [(label, placed, sharded)]
        else:
            try:
                # over more than two GPUs big sums are reduced scattered, not in mm chunks
                chunked = shard(step.graph, batch, same_kind[:k], updates=step.updates,
                                reduce_chunks=None if k == 2 else 1)
                forms = [("", chunked)]
                if chunked.reduced_in_chunks and k == 2:  # over more GPUs: scattered sums
                    forms.append((" at once", shard(step.graph, batch, same_kind[:k],
                                                    updates=step.updates, reduce_chunks=1)))
            except NotShardable as e:
                if shards is not None:
                    raise
                log.info("autopar: %s not split over %d devices: %s", step.graph.name, k, e)
                continue
            label = ",".join(same_kind[:k])
            candidates = [(label + suffix, place(s.graph, cost, policy=policy, devices=devices,
                                                 pins=s.pins), s) for suffix, s in forms]
        for label, placed, sharded in candidates:
            predicted[label] = placed.predicted_s
            placed_all.append((label, placed, sharded))
    ranked = sorted(placed_all, key=lambda c: c[1].predicted_s)
    refused: dict[str, str] = {}
    for label, placed, sharded in ranked:  # the fastest that fits every device's memory
        why = _does_not_fit(placed, cost)
        if why is None:
            return Choice(placed, sharded, predicted, refused)
        refused[label] = why
        log.info("autopar: %s %s: %s", step.graph.name, label, why)
    _, placed, sharded = ranked[0]  # nothing fits (eager's own form neither): the fastest
    return Choice(placed, sharded, predicted, refused)


def _does_not_fit(placed: Any, cost: Any) -> str | None:
    """Why a placement's simulated peak memory exceeds a device's, or None."""
    plan = make_plan(placed, cost)
    limits = memory_limits(cost)
    for pool, peak in peak_memory(plan, simulate(plan, cost)).items():
        has = limits.get(pool)
        if has is not None and peak > has:
            return f"needs {peak / GiB:.2f} GiB on {pool}, which has {has / GiB:.2f} GiB"
    return None


def shard_devices(batch: dict[Node, int], cost: Any, devices: Sequence[str],
                   shards: int | None) -> tuple[list[str], list[str]]:
    """The devices to place on (home added) and those that may take a shard (home first, then
    the others of its kind), checking ``shards`` against them."""
    devices = list(devices)
    home = cost.machine.home(next(iter(batch)).device).name
    if home not in devices:
        devices.insert(0, home)
    kind = home.split(":")[0]
    same_kind = [home] + [d for d in devices if d != home and d.split(":")[0] == kind]
    if shards is not None and not 1 <= shards <= len(same_kind):
        raise ValueError(f"shards={shards}: between 1 and {len(same_kind)} devices of the "
                         f"home's kind ({', '.join(same_kind)}) can take a shard")
    return devices, same_kind



"""Collectives: one op over the values of k devices, run on the interconnect's own lane.

A data-parallel step sums each gradient bucket's k partial values, one per device, and needs
the sum on every device. Written as copies and adds, that is ``k (k-1)`` copies and adds for
the thread that issues every GPU's work (GPT-2 small's step over 8 GPUs: 1,486 copies and
1,462 stream waits a step). A collective is one op for all k devices: one NCCL call.

Policy and invariants
- ``all_reduce(*parts)``: the sum of k partial values, each on its own device, in shard
  order; its value is a tuple of k equal sums, item i on ``parts[i]``'s device. Its node is
  pinned to :data:`COMM`, a lane of its own (not a device: it allocates nothing and runs no
  kernel of a device's compute stream), so collectives run one after another, beside every
  device's compute, as NCCL runs them on a stream per GPU.
- ``take(result, i)``: item i of a collective's value, pinned to that item's device: where
  that device's consumers wait for the collective (an ordering event, never a copy: see
  :func:`autopar.ir.routing.route`).
- Every item has the same bits: NCCL's all-reduce gives every rank the same result; the
  fallback here (:func:`all_reduce` called as a function: CPU workers, the host running a GPU
  graph relabelled, a build without NCCL) adds the parts in shard order on each device. The
  sum's order differs from eager's only as any split sum does (float tolerance).
- Values are contiguous tensors of one shape and dtype (a bucket's flattened partials, a
  gradient's partial product).
- A small all-reduce (parts of at most :data:`INLINE_BYTES`: batch norm's per-channel sums, a
  loss's total weight) runs on the GPUs' compute streams (:func:`inline`): its time is NCCL's
  latency, which its consumers wait for anyway, and each GPU is spared the comm stream's wait
  for its part and its consumers' wait for the item's event (an event record and wait each,
  ``event_wait_s``: 10 us calibrated on the H200 host, more than the all-reduce's launch).
  A big one (a gradient bucket) runs on each GPU's comm stream, beside backward's compute.
  Both kinds share one communicator, whose operations NCCL serializes in issue order whatever
  their streams (it adds the events; NVIDIA/nccl#574): the lane runs them one after another,
  as the simulation does. Not simulated: a compute stream that reaches a small all-reduce is
  held until the others' parts are ready and the lane's earlier collectives are done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["COMM", "INLINE_BYTES", "all_reduce", "inline", "is_collective", "take"]

COMM = "comm"
"""The lane collectives run on; a plan's program of its own (see the module docstring)."""

INLINE_BYTES = 256 * 1024
"""The largest part of an all-reduce run on the GPUs' compute streams: its bytes take
``2 (k-1) / k * n / bandwidth`` <= 1.3 us over NVLink (367 GB/s on the H200 presets) and
<= 19 us over PCIe 4 (~25 GB/s), about NCCL's latency or less."""


def inline(nbytes: int) -> bool:
    """Does an all-reduce of parts of ``nbytes`` each run on the GPUs' compute streams (see
    the module docstring), not on their comm streams?"""
    return nbytes <= INLINE_BYTES


def all_reduce(*parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The sum of ``parts`` (shard order) on each part's device: what a collective gives,
    computed as the parts added in order on each device (parts of one device share one sum)."""
    sums: dict[torch.device, torch.Tensor] = {}
    for p in parts:
        if p.device not in sums:
            total = parts[0].to(p.device)
            for q in parts[1:]:
                total = total + q.to(p.device)
            sums[p.device] = total
    return tuple(sums[p.device] for p in parts)


def take(result: Sequence[Any], i: int) -> Any:
    """Item ``i`` of a collective's value (a function of its own, so that graphs, pictures
    and the cost model tell it from a tuple's ``getitem``)."""
    return result[i]


def is_collective(op: Any) -> bool:
    """Is ``op`` a collective (runs on :data:`COMM`)?"""
    return op is all_reduce

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["COMM", "all_reduce", "is_collective", "take"]

COMM = "comm"
"""The lane collectives run on; a plan's program of its own (see the module docstring)."""


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

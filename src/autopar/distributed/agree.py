"""Every rank must make the same call: the same signature of arguments, the same model.

A rank whose batch has another shape, or whose model has another parameter, would otherwise
hang in a collective or reduce tensors that don't match. Each call compares a digest of its
signature across ranks (one small all-gather on the host, over gloo); only where they differ
are the signatures themselves gathered, to name the rank and the tensor.

Policy and invariants
- A signature is a list of readable entries (``"argument 0: tensor (8, 64) float32"``); the
  digest is stable across processes (blake2b, not Python's salted ``hash``).
- Every rank takes part in every check (they are collective calls): the caller checks on
  every call, never on a condition only one rank sees.
- The error names the first rank that differs from rank 0, the first entry that differs and
  both values, on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RanksDisagree", "check_same", "describe"]


class RanksDisagree(RuntimeError):
    """Ranks called with different arguments or hold different models."""


def describe(name: str, value: Any) -> str:
    """One signature entry: a tensor's shape, dtype and whether it requires grad; a plain
    value's repr; another object's type."""
    if isinstance(value, torch.Tensor):
        grad = ", requires grad" if value.requires_grad else ""
        return f"{name}: tensor {tuple(value.shape)} {value.dtype}{grad}"
    if value is None or isinstance(value, bool | int | float | str):
        return f"{name}: {value!r}"
    return f"{name}: {type(value).__name__}"


def _digest(entries: Sequence[str]) -> int:
    h = hashlib.blake2b("\n".join(entries).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def check_same(entries: Sequence[str], what: str, group: dist.ProcessGroup | None) -> None:
    """Raise :class:`RanksDisagree` unless every rank of ``group`` passed the same
    ``entries`` (``what``: "the step's arguments", "model 'model'", for the message)."""
    size = dist.get_world_size(group)
    mine = torch.tensor([_digest(entries)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    if all(int(d) == int(mine) for d in everyone):
        return
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, list(entries), group=group)
    first = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs == first:
            continue
        for a, b in zip(first, theirs):
            if a != b:
                raise RanksDisagree(f"rank {rank} differs from rank 0 in {what}: rank 0 has "
                                    f"{a!r}, rank {rank} has {b!r}")
        raise RanksDisagree(f"rank {rank} differs from rank 0 in {what}: rank 0 has "
                            f"{len(first)} entries, rank {rank} has {len(theirs)}")

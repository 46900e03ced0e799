"""The world a process runs in: its rank, the number of ranks, its device, the process group.

Policy and invariants
- The world is read from the environment torch's launchers set (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), or from a process group the script made
  itself. No launcher, rendezvous or transport of our own: ``torch.distributed`` does it.
- A world of one process is no world: :meth:`World.from_env` returns None and the caller runs
  the one-process path.
- The process group is made once, by :func:`ensure_process_group`, only where the script
  made none: NCCL where this process has a GPU, gloo otherwise. A script's own group is used
  as it is.
- A restarted attempt must not read what the last one left in the store torchrun's agent
  shares with its workers: gloo then connects to a dead rank's port (torch issue #135712;
  benchmarks/NOTES.md, "restarts hung"). On one node the keys are those of the attempt
  (``TORCHELASTIC_RESTART_COUNT``, which the one agent counts); over several nodes, where
  agents count restarts each their own way, ``autopar run`` gives each attempt a store of its
  own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
- The group it made is destroyed at the script's end (:func:`_destroy_at_exit`): a
  one-device script never calls ``destroy_process_group``.
- Each process owns the GPU of its local rank: :func:`adopt_local_device` makes it current
  (``torch.device("cuda")`` then means that GPU), as one-device scripts expect.
- A rank's uncaught error is written where torch's elastic agent reads it
  (:func:`record_errors`), so the launcher's summary names that rank's error, not
  ``error_file: <N/A>``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

import torch
import torch.distributed as dist

__all__ = ["World", "adopt_local_device", "broadcast_from_rank0", "ensure_process_group",
           "record_errors"]

TIMEOUT_S = float(os.environ.get("AUTOPAR_DIST_TIMEOUT", 1800))
"""A collective waits this long before it raises (torch's default): the first call of a step
may compile for minutes on one rank while another waits. A rank that dies ends the run sooner:
its peers' transport sees the closed connection and torch's agent stops the rest."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks."""

    #: this process's rank, 0..size-1
    rank: int
    #: how many processes take part
    size: int
    #: this process's rank on its machine (its GPU's index)
    local_rank: int

    @classmethod
    def from_env(cls) -> World | None:
        """The world of a launched process, or None where this process runs alone."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() == 1:
                return None
            return cls(dist.get_rank(), dist.get_world_size(),
                       int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return None
        return cls(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: its local GPU, else the host (where this process
        sees no GPU: ``CUDA_VISIBLE_DEVICES=""`` runs every rank on the host)."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise RuntimeError(
                f"rank {self.rank} (local rank {self.local_rank}) has no GPU of its own: this "
                f"machine shows {count} GPU(s) to {self.local_rank + 1} or more processes. Start "
                f"one process per GPU (--nproc-per-node {count}), or run every rank on the host "
                "with CUDA_VISIBLE_DEVICES=\"\"")
        return torch.device("cuda", self.local_rank)


def adopt_local_device(world: World) -> None:
    """Make this rank's GPU the current one (a no-op without CUDA)."""
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)


def ensure_process_group(world: World) -> None:
    """Join the default process group unless the script already did."""
    if not dist.is_available():
        raise RuntimeError("this build of torch has no torch.distributed: it can't run as "
                           f"rank {world.rank} of {world.size}")
    if dist.is_initialized():
        return
    backend = "nccl" if world.device.type == "cuda" and dist.is_nccl_available() else "gloo"
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store, rank, size = next(dist.rendezvous("env://", world.rank, world.size, timeout=timeout))
    if os.environ.get("LOCAL_WORLD_SIZE") == str(size):  # one node: one agent counts attempts
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"autopar/attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            device_id=world.device if backend == "nccl" else None)
    atexit.register(_destroy_at_exit)


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0's values of ``tensors`` on every rank, in place."""
    for t in tensors:
        dist.broadcast(t, 0)


def _destroy_at_exit() -> None:
    """Destroy the group this module made, as a script's end would (one-device scripts never
    call ``destroy_process_group``). Not after an uncaught error: the agent stops every rank
    then."""
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


def record_errors() -> None:
    """Write this process's uncaught exception where torch's elastic agent reads it (the
    format of torch's ``@record`` decorator, with the exception's own traceback and notes),
    once; the error is still printed as before."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if getattr(sys.excepthook, "_autopar", False) or not path:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if isinstance(error, Exception):
            stack = "".join(traceback.format_exception(kind, error, tb))
            data = {"message": {"message": f"{kind.__name__}: {error}",
                                "extraInfo": {"py_callstack": stack,
                                              "timestamp": str(int(time.time()))}}}
            with contextlib.suppress(OSError), open(path, "w") as f:
                json.dump(data, f)
        previous(kind, error, tb)

    hook._autopar = True  # type: ignore[attr-defined]
    sys.excepthook = hook

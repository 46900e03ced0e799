"""``autopar run``: torch's own launcher (``torch.distributed.run``, what ``torchrun`` runs),
with defaults that fit a script written for one device.

Policy and invariants
- Every option is torchrun's and means what it means there; autopar adds a default only
  where the command line doesn't set it:
  - ``--nproc-per-node``: one process per GPU; on a machine without GPUs,
    :func:`host_processes` processes on the host (gloo).
  - ``--standalone`` (a rendezvous on this machine) unless a rendezvous or ``--nnodes`` is
    given.
  - ``OMP_NUM_THREADS``: the host's cores shared evenly among its processes.
  - ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each restart attempt's workers get a store of
    their own, not the agent's, where the last attempt's keys remain (torch issue #135712).
- The elastic agent, c10d rendezvous, restarts and signal handling are torch's: Ctrl-C stops
  every process, a failed rank stops the rest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

__all__ = ["host_processes", "run", "torchrun_args"]

MAX_HOST_PROCESSES = 4
"""Processes on a machine without GPUs, at most (each runs the whole model on its cores)."""

_RENDEZVOUS = ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
               "--master_addr", "--standalone", "--rdzv-backend", "--rdzv_backend")
_NPROC = ("--nproc-per-node", "--nproc_per_node")


def host_processes() -> int:
    """Processes to start on a machine without GPUs: one per core, at most
    :data:`MAX_HOST_PROCESSES`, at least 2."""
    return max(2, min(os.cpu_count() or 2, MAX_HOST_PROCESSES))


def _given(options: Sequence[str], names: Sequence[str]) -> bool:
    return any(o == n or o.startswith(n + "=") for o in options for n in names)


def torchrun_args(argv: Sequence[str]) -> tuple[list[str], int]:
    """torchrun's command line for ``autopar run ARGV`` (defaults added before the script),
    and the processes per node it starts (0 where torchrun decides)."""
    from torch.distributed.run import get_args_parser  # lazy: imports the elastic agent

    parsed = get_args_parser().parse_args(list(argv))
    at = len(argv) - 1 - len(parsed.training_script_args)
    options, script = list(argv[:at]), list(argv[at:])
    added: list[str] = []
    nproc = 0
    if not _given(options, _NPROC):
        nproc = torch.cuda.device_count() if torch.cuda.is_available() else host_processes()
        added.append(f"--nproc-per-node={nproc}")
    elif str(parsed.nproc_per_node).isdigit():
        nproc = int(parsed.nproc_per_node)
    if not _given(options, _RENDEZVOUS):
        added.append("--standalone")
    return [*added, *options, *script], nproc


def run(argv: Sequence[str]) -> None:
    """Launch ``argv`` (torchrun's options, the script, its arguments) as torchrun does."""
    from torch.distributed.run import main  # lazy: imports the elastic agent

    args, nproc = torchrun_args(argv)
    if nproc and not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # each restart attempt gets a store of its own (see autopar.distributed.world)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    main(args)

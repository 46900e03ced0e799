"""The fabric of a world of processes: how many GPUs a node, how many nodes, and the links a
collective crosses (NVLink inside a node, each GPU's NIC between nodes).

A :class:`~autopar.machine.model.Machine` describes one node; a world of ``torchrun``
processes may span several. :func:`fabric_of` gives the fabric of a preset (its ``nodes`` and
``nic``, see :mod:`autopar.machine.presets`) or of a machine at hand (one node, its GPUs'
peer link).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import LinkProfile, Machine

__all__ = ["Fabric", "fabric_of"]


@dataclass(frozen=True)
class Fabric:
    """How the GPUs of a world are linked."""

    #: GPUs (ranks) a node
    gpus: int
    #: nodes
    nodes: int
    #: one GPU's link to the others of its node (NVLink)
    intra: LinkProfile
    #: one GPU's NIC to the other nodes (None on one node)
    inter: LinkProfile | None = None

    @property
    def ranks(self) -> int:
        return self.gpus * self.nodes


def fabric_of(machine: Machine, nodes: int = 1, nic: LinkProfile | None = None,
              gpus: int | None = None) -> Fabric:
    """The fabric of ``nodes`` nodes like ``machine`` (its first ``gpus`` GPUs a node, all by
    default), linked by ``nic`` per GPU."""
    gpu_names = [d.name for d in machine.devices if d.is_gpu]
    if not gpu_names:
        raise ValueError(f"machine {machine.name!r} has no GPU to run a rank on")
    gpus = len(gpu_names) if gpus is None else gpus
    if not 1 <= gpus <= len(gpu_names):
        raise ValueError(f"machine {machine.name!r} has {len(gpu_names)} GPUs, not {gpus}")
    intra = machine.profile.link(gpu_names[0], gpu_names[1]) if len(gpu_names) > 1 else \
        LinkProfile(0.0, float("inf"))
    if nodes > 1 and nic is None:
        raise ValueError(f"{nodes} nodes need the link between them (nic=)")
    return Fabric(gpus, nodes, intra, nic if nodes > 1 else None)

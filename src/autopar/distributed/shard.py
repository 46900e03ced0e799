"""Replicate or shard: where a replica of a model doesn't fit a GPU, FSDP2 shards it.

Policy and invariants
- A replica needs its parameters, their gradients, the optimizers' state (Adam's two moments,
  SGD's momentum: :func:`state_tensors`) and room for activations. ``sharding="auto"`` shards
  a model whose replica (parameters, gradients, optimizer state) would take more than
  :data:`~autopar.schedule.world.SHARD_ABOVE` of the smallest rank's GPU memory (the rule the
  planner's prediction shares: :func:`~autopar.schedule.world.should_shard`); on hosts
  without GPU memory to compare with, it replicates. ``"shard"`` and ``"replicate"`` force one.
- Sharding is torch's FSDP2 (``fully_shard``): each block (a module held in an
  ``nn.ModuleList``, as transformer layers and ResNet stages are) is a unit of its own, then
  the model. Parameters are gathered for each unit's forward and backward, and gradients are
  reduce-scattered and averaged over ranks as DDP averages them, so the seeded backward of
  :mod:`autopar.distributed.loss` holds.
- ``fully_shard`` makes new parameter objects (DTensors): every optimizer the step holds is
  repointed to them, its state (if any) sharded the same way. Rank 0's parameters and
  buffers are broadcast first, as DDP would.
- A sharded model's ``state_dict()`` holds shards: :func:`full_state_dict` gathers it (every
  rank calls it), ``torch.distributed.checkpoint`` saves it in parallel.

Extension points: :func:`state_tensors` (an optimizer's tensors per parameter), :func:`units`
(which submodules FSDP2 gathers at once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..schedule import world as world_price
from ..schedule.world import SHARD_ABOVE
from .world import broadcast_from_rank0

__all__ = ["SHARDING", "Sharding", "decide", "full_state_dict", "replica_bytes", "shard",
           "state_tensors", "tensor_bytes", "units"]

SHARDING = ("auto", "replicate", "shard")


def state_tensors(opt: torch.optim.Optimizer) -> int:
    """Tensors the size of a parameter that ``opt`` keeps for each one."""
    return world_price.state_tensors(type(opt).__name__, any(
        g.get("momentum", 0) for g in opt.param_groups))


@dataclass(frozen=True)
class Sharding:
    """The choice for one model, and why (``describe()`` prints ``reason``)."""

    shard: bool
    reason: str


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def replica_bytes(params: Iterable[torch.Tensor],
                  optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """What a replica of ``params`` (those that require grad, each once) holds: the
    parameters, their gradients and the ``optimizers``' state of them."""
    held = {id(p): p for p in params if p.requires_grad}
    state = sum(state_tensors(o) * tensor_bytes(p for g in o.param_groups for p in g["params"]
                                                if id(p) in held) for o in optimizers)
    return 2 * tensor_bytes(held.values()) + state


def decide(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], mode: str,
           device: torch.device) -> Sharding:
    """Replicate or shard ``module`` (every rank must call it: the memory is agreed)."""
    need = replica_bytes(module.parameters(), optimizers)
    what = f"a replica needs {_gib(need)} (parameters, gradients, optimizer state)"
    if mode != "auto":
        return Sharding(mode == "shard", f"sharding={mode!r}; {what}")
    if device.type != "cuda":
        return Sharding(False, f"{what}; {device.type} memory isn't compared")
    total = torch.tensor([torch.cuda.get_device_properties(device).total_memory],
                         dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MIN)
    if world_price.should_shard(need, float(total)):
        return Sharding(True, f"{what}, more than {SHARD_ABOVE:.0%} of the smallest GPU's "
                              f"{_gib(float(total))}")
    return Sharding(False, f"{what}, within {SHARD_ABOVE:.0%} of the smallest GPU's "
                           f"{_gib(float(total))}")


def units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP2 gathers as one: each element of an ``nn.ModuleList`` that holds
    parameters (innermost lists are not split further), deepest first."""
    found: list[torch.nn.Module] = []

    def walk(m: torch.nn.Module) -> None:
        for child in m.children():
            if isinstance(child, torch.nn.ModuleList):
                found.extend(c for c in child if next(c.parameters(), None) is not None)
            else:
                walk(child)
    walk(module)
    return found


def shard(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer],
          device: torch.device) -> int:
    """``fully_shard`` ``module`` (its :func:`units`, then itself) and repoint ``optimizers``
    to the sharded parameters; the number of units."""
    from torch.distributed.fsdp import fully_shard  # FSDP2's import: only where a model shards

    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    before = dict(module.named_parameters(remove_duplicate=False))
    broadcast_from_rank0([*module.parameters(), *module.buffers()])  # (tied ones once)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = units(module)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    after = dict(module.named_parameters(remove_duplicate=False))
    new = {id(p): after[names[id(p)]] for p in before.values()}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
        moved = {}
        for p, st in opt.state.items():
            q = new.get(id(p), p)
            moved[q] = {k: distribute_tensor(v, q.device_mesh, q.placements)
                        if isinstance(q, DTensor) and isinstance(v, torch.Tensor)
                        and v.shape == q.shape else v for k, v in st.items()}
        opt.state.clear()
        opt.state.update(moved)
    return len(blocks)


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every shard gathered into the whole tensor (a collective:
    every rank calls it; a replicated model's is its own ``state_dict()``)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in module.state_dict().items()}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"

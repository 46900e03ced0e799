"""Data parallelism on ``torch.distributed``: one process per device, one machine or many.

A script written for one device runs unchanged under ``torchrun`` (or ``autopar run``): in each
process :func:`autopar.data_parallel` finds the world in the environment and returns a
:class:`~autopar.distributed.step.DistributedStep`, which runs the rank's share of the global
batch and combines the ranks so that the results are the one-process results.

Map (data flows down):

    world.World.from_env()         rank, size, device; the process group (torch's own)
    step.DistributedStep           one call of the user's step
      +-- agree.check_same         every rank called with the same signature, or who differs
      +-- (first call) shard.decide / shard.shard or DDP's replicate: each model sharded
      |                            (FSDP2) where a replica won't fit, else replicated;
      |                            batch norm over the whole batch (norm.sync_batch_norm)
      +-- compiled.RankWays        the model's children compiled; the way every rank keeps
      +-- loss.reduction_of        the loss's reduction, read from its autograd graph: each
                                   rank's backward seeded so DDP's average is the global one
    launch                         ``autopar run``: torch.distributed.run with defaults
"""

from .shard import full_state_dict

__all__ = ["full_state_dict"]

"""Data parallelism on ``torch.distributed``: one process per device, one machine or many.

A script written for one device runs unchanged under ``torchrun`` (or ``autopar run``): in each
process :func:`autopar.data_parallel` finds the world in the environment and returns a
:class:`~autopar.distributed.step.DistributedStep`, which runs the rank's share of the global
batch and combines the ranks so that the results are the one-process results.

Map (data flows down):

    world.World.from_env()         rank, size, device; the process group (torch's own)
    step.DistributedStep.__call__  one call of the user's step
      +-- agree.check_calls        every rank called with the same signature, or who differs
      +-- share.rows / share.take  this rank's rows of each batch argument
      +-- replicas.replicate       modules under DDP's reducer (torch's ``replicate``),
      |                            batch norm synchronized (norm.sync_batch_norm)
      +-- loss.Weighting           the loss's reduction, read from its autograd graph: each
                                   rank's backward seeded so DDP's average is the global one
    launch.run                     ``autopar run``: torch.distributed.run with defaults
"""

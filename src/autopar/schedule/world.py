"""The price of a step run by one process per device (``torchrun``): each rank's own compute,
and its gradients all-reduced in buckets that overlap backward.

Under ``autopar.data_parallel`` in a launched world every rank runs the step on its share of
the batch on its own GPU, from its own thread: no thread issues another GPU's work. A rank's
compute is therefore what one GPU takes for ``B / W`` rows (the caller predicts it with the
one-device machinery); what the world adds is the gradient all-reduce, priced here.

Policy and invariants
- The fabric (:class:`~autopar.machine.fabric.Fabric`): ``gpus`` GPUs a node over ``nodes``
  nodes; inside a node every GPU reaches the others over NVLink (``intra``), and each GPU has
  a NIC of its own between nodes (``inter``).
- An all-reduce of ``n`` bytes is hierarchical, as NCCL runs it over nodes: a reduce-scatter
  inside each node, an all-reduce of each GPU's ``n / gpus`` slice over its own NIC, an
  all-gather inside the node (:func:`all_reduce_s`); one node is the ring's
  ``2 (W - 1) / W`` of the bytes over NVLink. A phase pays its link's latency once: a big
  message is cut into chunks that follow one another round the ring.
- Buckets (:data:`BUCKET_BYTES`, DDP's default) fill in the order backward makes gradients,
  which it makes at an even rate over backward's time (:func:`predict_world`); each bucket is
  all-reduced once it is full and the one before it is done (one communicator, one lane).
  The step ends when backward and the last bucket are done, then the update runs.
- Backward is :data:`BACKWARD_SHARE` of forward plus backward (twice the forward's FLOPs).
- Memory: a replica holds parameters, gradients and the optimizer's state
  (:func:`state_tensors`); a model is sharded (FSDP2) where that is more than
  :data:`SHARD_ABOVE` of a GPU's memory (:func:`should_shard`, the one rule the run and the
  prediction share). Sharded, a rank holds ``1 / W`` of each and the largest block gathered
  twice (FSDP2 prefetches the next); it all-gathers the parameters in forward and again in
  backward, and reduce-scatters the gradients, each overlapping the compute of the blocks
  around it, and updates ``1 / W`` of the parameters (:func:`predict_sharded`).
- Not priced: compute slowed by NCCL's kernels sharing the SMs, stragglers, the data loader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..machine.fabric import Fabric
from ..machine.model import LinkProfile

__all__ = ["BACKWARD_SHARE", "BUCKET_BYTES", "SHARD_ABOVE", "WorldPrediction", "all_reduce_s",
           "predict_sharded", "predict_world", "should_shard", "state_tensors"]

BUCKET_BYTES = 25 << 20
"""Gradient bytes per bucket (DDP's ``bucket_cap_mb`` default)."""
BACKWARD_SHARE = 2 / 3
"""Backward's share of a step's forward and backward time."""
SHARD_ABOVE = 0.5
"""A model is sharded where its replica would take more than this share of a GPU's memory:
the rest is for activations, DDP's buckets and the allocator's slack."""


def state_tensors(optimizer_name: str, momentum: bool = True) -> int:
    """Tensors the size of a parameter an optimizer of this class keeps for each one."""
    if "Adam" in optimizer_name:  # Adam, AdamW, NAdam, RAdam, Adamax: two moments
        return 2
    if optimizer_name == "SGD":
        return int(momentum)
    return 2 if optimizer_name == "Adadelta" else 1


def should_shard(replica_bytes: float, gpu_bytes: float) -> bool:
    """Does a replica of ``replica_bytes`` need sharding on a GPU of ``gpu_bytes``?"""
    return replica_bytes > SHARD_ABOVE * gpu_bytes


def _over(link: LinkProfile, nbytes: float, hops: int) -> float:
    """A phase of ``hops`` sends carrying ``nbytes`` in all over ``link``, pipelined."""
    return 0.0 if hops == 0 else link.latency_s + nbytes / link.bandwidth


def all_reduce_s(nbytes: float, fabric: Fabric) -> float:
    """Seconds to all-reduce ``nbytes`` over every rank of ``fabric`` (see the docstring)."""
    g, n = fabric.gpus, fabric.nodes
    inside = 2 * _over(fabric.intra, (g - 1) / g * nbytes, g - 1)  # reduce-scatter, all-gather
    if n == 1:
        return inside
    if fabric.inter is None:
        raise ValueError(f"a fabric of {n} nodes needs the link between them")
    between = 2 * _over(fabric.inter, (n - 1) / n * nbytes / g, n - 1)
    return inside + between


@dataclass(frozen=True)
class WorldPrediction:
    """One rank's step in a world of ``fabric.ranks`` processes."""

    #: the step's seconds: compute, the all-reduce left after backward, the update
    step_s: float
    #: forward and backward on the rank's share
    compute_s: float
    #: the optimizer's update
    update_s: float
    #: every bucket's all-reduce, added up
    comm_s: float
    #: what of it backward did not hide
    exposed_s: float
    #: buckets a step
    buckets: int


def predict_world(rank_step_s: float, update_s: float, grad_bytes: float, fabric: Fabric,
                  bucket_bytes: float = BUCKET_BYTES) -> WorldPrediction:
    """A rank's step whose one-GPU time on its share is ``rank_step_s`` (its update
    ``update_s`` of it), with ``grad_bytes`` of gradients all-reduced over ``fabric``."""
    compute = max(rank_step_s - update_s, 0.0)
    if fabric.ranks == 1 or grad_bytes == 0:
        return WorldPrediction(rank_step_s, compute, update_s, 0.0, 0.0, 0)
    backward = BACKWARD_SHARE * compute
    start = compute - backward
    count = max(1, math.ceil(grad_bytes / bucket_bytes))
    done, comm = 0.0, 0.0
    for b in range(count):
        size = min(bucket_bytes, grad_bytes - b * bucket_bytes)
        ready = start + backward * min(1.0, (b + 1) * bucket_bytes / grad_bytes)
        t = all_reduce_s(size, fabric)
        done = max(done, ready) + t
        comm += t
    exposed = max(0.0, done - compute)
    return WorldPrediction(compute + exposed + update_s, compute, update_s, comm, exposed,
                           count)


def predict_sharded(rank_step_s: float, update_s: float, param_bytes: float, fabric: Fabric,
                    units: int) -> WorldPrediction:
    """A rank's step as :func:`predict_world`'s, the model sharded into ``units`` blocks of
    ``param_bytes`` in all (gradients as many bytes): see the module docstring."""
    compute = max(rank_step_s - update_s, 0.0)
    update = update_s / fabric.ranks
    if fabric.ranks == 1 or param_bytes == 0:
        return WorldPrediction(compute + update_s, compute, update_s, 0.0, 0.0, units)
    backward = BACKWARD_SHARE * compute
    forward = compute - backward
    gather = all_reduce_s(param_bytes, fabric) / 2  # one of the all-reduce's two halves
    scatter = gather
    first = gather / units  # forward waits for the first block's parameters
    exposed = first + max(0.0, gather - first - forward) \
        + max(0.0, gather + scatter - backward) + scatter / units
    return WorldPrediction(compute + exposed + update, compute, update, 2 * gather + scatter,
                           exposed, units)

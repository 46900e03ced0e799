"""Batch norm over the whole batch, as one process computes it, across ranks.

Each rank holds a share of the batch, so a batch-norm layer in training must normalize with the
whole batch's statistics (what ``torch.nn.SyncBatchNorm`` does on GPUs; it refuses the host).
:func:`sync_batch_norm` gives every batch-norm layer of a module that forward, on any device.

Policy and invariants
- In training (or without running statistics) each rank sums ``x`` and ``x * x`` per channel
  and counts its values; one all-reduce of ``[sum, sum of squares, count]`` in float64 gives
  the whole batch's mean and biased variance. Uneven shards are weighted exactly.
- The all-reduce is differentiable (``torch.distributed.nn``), so backward reduces the
  statistics' gradients across ranks as autograd derives them: no backward of our own.
- Running statistics are updated as eager does (momentum, or a cumulative average where
  ``momentum`` is None; the unbiased variance ``N / (N - 1)``), identically on every rank.
- In eval with running statistics the layer's own forward runs: nothing crosses ranks.
- The layer keeps its identity (only its ``forward`` is replaced on the instance): the
  optimizer's parameters and the user's references stay valid.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["sync_batch_norm"]


def sync_batch_norm(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Give every batch-norm layer under ``module`` the whole batch's statistics; returns how
    many layers have them (a layer already changed is left as it is; a ``SyncBatchNorm`` is
    torch's own, and not counted)."""
    synced = 0
    for layer in module.modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, torch.nn.SyncBatchNorm):
            if "forward" not in vars(layer):
                layer.forward = types.MethodType(_forward, layer)
                layer._autopar_group = group
            synced += 1
    return synced


def _forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    self._check_input_dim(x)
    batch_stats = self.training or (self.running_mean is None and self.running_var is None)
    if not batch_stats:
        return type(self).forward(self, x)
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    local = torch.cat([x.sum(dims, dtype=torch.float64),
                       (x * x).sum(dims, dtype=torch.float64),
                       x.new_full((1,), x.numel() // channels, dtype=torch.float64)])
    total = _all_reduce(local, self._autopar_group or dist.group.WORLD)
    n = total[2 * channels]
    mean = total[:channels] / n
    var = total[channels:2 * channels] / n - mean * mean
    if self.training and self.track_running_stats and self.running_mean is not None:
        _update_running(self, mean.detach(), var.detach(), n.detach())
    shape = [1, channels] + [1] * (x.dim() - 2)
    compute = torch.promote_types(x.dtype, torch.float32)
    y = (x.to(compute) - mean.to(compute).view(shape)) * torch.rsqrt(
        var.to(compute).view(shape) + self.eps)
    if self.affine:
        y = y * self.weight.to(compute).view(shape) + self.bias.to(compute).view(shape)
    return y.to(x.dtype)


_FUNCOL_AUTOGRAD = torch._C._dispatch_has_kernel_for_dispatch_key(
    "_c10d_functional::all_reduce", "Autograd")
"""Does c10d's functional all-reduce have autograd in this torch (newer ones)?"""


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A differentiable sum over ranks: c10d's functional all-reduce where it has autograd,
    else ``torch.distributed.nn``'s."""
    if _FUNCOL_AUTOGRAD:
        return funcol.all_reduce(x, "sum", group)
    from torch.distributed.nn import functional as dist_nn  # lazy: older torch only

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist_nn.all_reduce(x, group=group)


@torch.no_grad()
def _update_running(self: _BatchNorm, mean: torch.Tensor, var: torch.Tensor,
                    n: torch.Tensor) -> None:
    self.num_batches_tracked.add_(1)
    factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
    unbiased = var * n / (n - 1)
    self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
    self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

"""Normalisation over a split volume: the statistics of every sample (GroupNorm, InstanceNorm) or
of the batch (BatchNorm) are reduced over the spatial group, so each rank normalises its slab with
the whole volume's mean and variance, and backward, through the same reductions, gives the unsplit
gradients. BatchNorm's running statistics come out identical on every rank.

The mean is reduced first and the variance from it (two reductions, as a one-pass sum of squares
loses digits in fp32); both go through zero's Comm as "spatial_stats".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zero.spatial.halo import group_sum
from zero.spatial.layers import SpatialError, SpatialLayer


def _moments(layer: SpatialLayer, x: torch.Tensor, dims: tuple[int, ...], shift: int = 0):
    """Mean and biased variance of `x` over `dims` (which include the split dimensions, shifted by
    `shift`) of the whole volume, and the number of elements each covers."""
    splits = {d: split.length for d, _, split in layer._splits(x, shift)}
    count = 1
    for d in dims:
        count *= splits.get(d, x.shape[d])
    comm = layer._zero_spatial.comm
    mean = group_sum(x.sum(dims, keepdim=True), comm) / count
    var = group_sum((x - mean).square().sum(dims, keepdim=True), comm) / count
    return mean, var, count


def _affine(y: torch.Tensor, weight, bias) -> torch.Tensor:
    shape = (1, -1, *(1,) * (y.dim() - 2))
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


class SpatialGroupNorm(SpatialLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        grouped = x.reshape(n, self.num_groups, c // self.num_groups, *x.shape[2:])
        dims = tuple(range(2, grouped.dim()))
        mean, var, _ = _moments(self, grouped, dims, 1)
        y = ((grouped - mean) / torch.sqrt(var + self.eps)).reshape(x.shape)
        return _affine(y, self.weight, self.bias)


class SpatialBatchNorm(SpatialLayer):
    """BatchNorm and InstanceNorm: statistics per channel over the batch and the volume
    (BatchNorm) or per sample and channel over the volume (InstanceNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        instance = isinstance(self, nn.modules.instancenorm._InstanceNorm)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:  # eval with running statistics: pointwise
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = tuple(range(2, x.dim())) if instance else (0, *range(2, x.dim()))
        mean, var, count = _moments(self, x, dims)
        if self.training and self.track_running_stats:
            self._update_running(mean, var, count)
        return _affine((x - mean) / torch.sqrt(var + self.eps), self.weight, self.bias)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * count / max(count - 1, 1)
        self.running_mean.mul_(1 - factor).add_(mean.reshape(-1), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.reshape(-1), alpha=factor)


def check_norm(module: nn.Module, path: str, dim: int = 2) -> None:
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        raise SpatialError(f"{path} ({type(module).__name__}): track_running_stats=True is not supported over a split "
                           f"volume yet (the default False is)")

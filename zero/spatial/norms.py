"""Normalisation over a split volume: the statistics of every sample (GroupNorm, InstanceNorm) or
of the batch (BatchNorm) are reduced over the spatial group, so each rank normalises its slab with
the whole volume's mean and variance, and backward, through the same reductions, gives the unsplit
gradients. BatchNorm's running statistics come out identical on every rank.

The mean is reduced first and the variance from it (two reductions, as a one-pass sum of squares
loses digits in fp32); both go through zero's Comm as "spatial_stats".

Forward and backward are one autograd Function (`_Normalize`) that saves only the input and the
statistics, as torch's own norms do: built from autograd's pointwise operations, a norm would keep
two or three more activation-sized tensors for backward (x - mean, the normalised value before the
affine), which is most of the difference between a split and an unsplit U-Net's activations.
Backward is the closed form: with g the output gradient times the weight and x^ the normalised
input, dx = rstd (g - mean(g) - x^ mean(g x^)), the two means over the whole volume (one more
reduction over the group); the weight's and the bias's gradients are this rank's part of the sums,
which the engine's gradient reduction adds up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zero.spatial.layers import SpatialError, SpatialLayer


def _count(layer: SpatialLayer, x: torch.Tensor, dims: tuple[int, ...], shift: int = 0) -> int:
    """The number of elements of the whole volume each statistic covers: `dims` of `x`, whose
    split dimensions (shifted by `shift`) count their whole length."""
    splits = {d: split.length for d, _, split in layer._splits(x, shift)}
    count = 1
    for d in dims:
        count *= splits.get(d, x.shape[d])
    return count


def _sum_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` summed over the dimensions where `like` (a broadcast parameter view) has size 1."""
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and t.shape[i] != 1)
    return t.sum(dims, keepdim=True) if dims else t


class _Normalize(torch.autograd.Function):
    """(x - mean) * rstd * weight + bias with the statistics over `dims` of the whole volume; also
    returns mean and biased variance (for running statistics). See the module's docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, dims, count, comm, eps):
        acc = _accumulation(x)  # statistics in fp32 at least, as torch's norms keep them
        with torch.no_grad():
            mean = x.sum(dims, keepdim=True, dtype=acc)
            comm.all_reduce(mean, label="spatial_stats")
            mean /= count
            var = (x.to(acc) - mean).square_().sum(dims, keepdim=True)
            comm.all_reduce(var, label="spatial_stats")
            var /= count
            rstd = (var + eps).rsqrt()
            y = (x.to(acc) - mean).mul_(rstd)
            if weight is not None:
                y.mul_(weight)
            if bias is not None:
                y.add_(bias)
            y = y.to(x.dtype)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.dims, ctx.count, ctx.comm = dims, count, comm
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, g, _mean, _var):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        g = g.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean).mul_(rstd)
        gw = g * weight if weight is not None else g
        sums = torch.cat([gw.sum(ctx.dims, keepdim=True), (gw * xhat).sum(ctx.dims, keepdim=True)])
        ctx.comm.all_reduce(sums, label="spatial_stats")
        mean_g, mean_gx = (sums / ctx.count).chunk(2)
        dx = (gw - mean_g).sub_(xhat * mean_gx).mul_(rstd).to(x.dtype) if ctx.needs_input_grad[0] else None
        dweight = _sum_to(g * xhat, weight).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        dbias = _sum_to(g, bias).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None


def _accumulation(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _view(p: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    return None if p is None else p.view(shape)


class SpatialGroupNorm(SpatialLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        groups = self.num_groups
        grouped = x.reshape(n, groups, c // groups, *x.shape[2:])
        dims = tuple(range(2, grouped.dim()))
        shape = (1, groups, c // groups, *(1,) * (x.dim() - 2))
        y, _, _ = _Normalize.apply(grouped, _view(self.weight, shape), _view(self.bias, shape), dims,
                                   _count(self, grouped, dims, 1), self._zero_spatial.comm, self.eps)
        return y.reshape(x.shape)


class SpatialBatchNorm(SpatialLayer):
    """BatchNorm and InstanceNorm: statistics per channel over the batch and the volume
    (BatchNorm) or per sample and channel over the volume (InstanceNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        instance = isinstance(self, nn.modules.instancenorm._InstanceNorm)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:  # eval with running statistics: pointwise
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = tuple(range(2, x.dim())) if instance else (0, *range(2, x.dim()))
        shape = (1, -1, *(1,) * (x.dim() - 2))
        count = _count(self, x, dims)
        y, mean, var = _Normalize.apply(x, _view(self.weight, shape), _view(self.bias, shape), dims, count,
                                        self._zero_spatial.comm, self.eps)
        if self.training and self.track_running_stats:
            self._update_running(mean, var, count)
        return y

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

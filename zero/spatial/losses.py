"""Losses and metrics over a split volume, written as for a whole one.

[Note: reductions over the whole volume]
A loss or a metric reduces the volume: a mean over every voxel, a Dice score's sums over the
spatial dimensions. On a slab each such reduction sees only this rank's voxels. `whole_volume(fn)`
runs `fn` (MONAI's DiceLoss or DiceCELoss, torch's losses, your own) with every reduction over the
split dimensions made over the whole volume: while it runs a TorchFunctionMode sees torch's sums,
means and vector norms and the losses' built-in 'mean'/'sum' reductions; one that reduces a tensor's split
dimensions (a tensor with more dimensions than the largest split one, reduced over all of them)
is computed on the slab and summed over the spatial group (`group_sum`: differentiable), a mean
divided by the whole volume's count (the count of non-ignored targets for cross-entropy's
`ignore_index`, their weights for its `weight`), in fp32 at least. Reductions that keep a split dimension, or run
on tensors already reduced (a Dice score's per-channel sums), stay local. So the value is the
unsplit loss on every rank, and its gradient the unsplit one (times the group's size on each
slab, which the engine's average over all ranks divides out, as for `volume_sum`).

A tensor whose split dimensions all have length 1 is taken for one reduced already (a sum with
keepdim=True, MONAI's reduction="none"), not for a slab: summing it again stays local. Max/min over
the volume and reductions that keep only part of a grid's split dimensions are not summable this
way and raise SpatialError.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from zero.spatial.halo import group_sum
from zero.spatial.layers import Plan, SpatialError

_SUMS = {torch.sum, torch.Tensor.sum}
_MEANS = {torch.mean, torch.Tensor.mean}
_LOSSES = {F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
           F.binary_cross_entropy_with_logits, F.cross_entropy, F.nll_loss}
_EXTREMES = {torch.amax, torch.amin, torch.Tensor.amax, torch.Tensor.amin, torch.max, torch.min,
             torch.Tensor.max, torch.Tensor.min}


def whole_volume(fn, comm=None, dim=None):
    """`fn` (a loss or metric over (N, C, *spatial) tensors) computed over the whole volume from
    this rank's slabs, the same value on every rank of the spatial group (`comm` and `dim`: as
    `shard_volume`'s; default the layout `initialize` made). See [Note: reductions over the whole
    volume].

        dice = zero.spatial.whole_volume(monai.losses.DiceLoss(sigmoid=True))
        loss = dice(engine(x_slab), y_slab)
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import zero.spatial

        layout = zero.spatial._layout(comm, dim)
        with _Reductions(layout):
            return fn(*args, **kwargs)

    return run


class _Reductions(TorchFunctionMode):
    """See [Note: reductions over the whole volume]. `ones_reduced`: a tensor whose split
    dimensions all have length 1 was reduced already (in a loss; a model's forward, whose
    activations are all slabs, passes False: a slab may be one plane deep)."""

    def __init__(self, layout: Plan, ones_reduced: bool = True):
        super().__init__()
        self.layout, self.ones_reduced = layout, ones_reduced

    def _covers(self, x, dim) -> bool:
        """`dim` of `x` (None: all) covers the split dimensions (False: none; raises: some)."""
        if not isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Parameter) or x.dim() <= max(self.layout.dims) \
                or self.ones_reduced and all(x.shape[d] == 1 for d in self.layout.dims):
            return False
        dims = set(range(x.dim())) if dim is None or dim == [] or dim == () else \
            {d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim)}
        inside = [d in dims for d in self.layout.dims]
        if any(inside) and not all(inside):
            raise SpatialError(f"a reduction over dimensions {sorted(dims)} of a volume split over dimensions "
                               f"{list(self.layout.dims)} keeps some of them: reduce all or none of them")
        return all(inside)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SUMS or func in _MEANS:
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis"))
            if not self._covers(x, dim):
                return func(*args, **kwargs)
            local = func(*args, **kwargs)  # the mode is off inside its own handler: torch's reduction
            wide = _accumulating(local)  # summed over the group in fp32 at least, as torch accumulates
            if func in _SUMS:
                return group_sum(wide, self.layout.comm).to(local.dtype)
            count = x.numel() // max(1, local.numel())  # elements each mean covers on this slab
            return (group_sum(wide * count, self.layout.comm) / self._global(count, wide)).to(local.dtype)
        if func is torch.linalg.vector_norm:  # (sum |x|^p)^(1/p): its sum over the volume
            x = args[0]
            order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            if self._covers(x, args[2] if len(args) > 2 else kwargs.get("dim")):
                if order in (float("inf"), float("-inf")) or order <= 0:
                    raise SpatialError(f"vector_norm(ord={order}) over a split volume is not supported inside "
                                       f"whole_volume (not a sum)")
                local = func(*args, **kwargs)
                return group_sum(local.pow(order), self.layout.comm).pow(1.0 / order)
        if func in _LOSSES:
            return self._loss(func, args, kwargs)
        second = args[1] if len(args) > 1 else kwargs.get("dim")
        if func in _EXTREMES and args and not isinstance(second, torch.Tensor) and self._covers(args[0], second):
            raise SpatialError(f"{getattr(func, '__name__', func)} over a split volume is not supported (not a "
                               f"sum over the slabs)")
        return func(*args, **kwargs)

    def _global(self, count: int, like: torch.Tensor) -> float:
        """`count` summed over the group (counted in fp64: a volume's voxels overflow fp16)."""
        t = torch.tensor([float(count)], dtype=torch.float64, device=like.device)
        self.layout.comm.all_reduce(t, label="spatial_stats")
        return float(t.item())

    def _loss(self, func, args, kwargs):
        import inspect

        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        reduction = values.get("reduction", "mean")
        x = values.get("input")
        if reduction == "none" or not isinstance(x, torch.Tensor) or x.dim() <= max(self.layout.dims):
            return func(*args, **kwargs)
        values["reduction"] = "none"
        for old in ("size_average", "reduce"):
            values.pop(old, None)
        each = func(**values)
        total = group_sum(_accumulating(each).sum(), self.layout.comm)
        if reduction == "sum":
            return total.to(each.dtype)
        target = values.get("target")
        if func in (F.cross_entropy, F.nll_loss) and target is not None and not target.is_floating_point():
            keep = target != values.get("ignore_index", -100)
            weight = values.get("weight")
            count = (weight[target.masked_fill(~keep, 0)] * keep).sum() if weight is not None else keep.sum()
            count = group_sum(count.to(total.dtype).detach(), self.layout.comm)
            return (total / count).to(each.dtype)
        return (total / self._global(each.numel(), each)).to(each.dtype)


def _accumulating(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

"""Spatial parallelism: one volume split over a group of ranks, for 3D networks whose activations
do not fit one device.

[Note: spatial parallelism]
A 3D U-Net's memory is its activations: one 32-channel bf16 feature map of a 512^3 volume is
8.6 GB. Spatial parallelism splits every activation of a sample over a group of P ranks, each
holding a slab of the volume along one spatial dimension (`spatial_parallel_dims`, default [2]:
depth of an (N, C, D, H, W) tensor), or the block of a grid over two or three (`grid_shape`), so
each rank keeps about 1/P of them. Layers that read a window of planes (convolutions, pools,
interpolation) fetch the planes their output slab needs from the neighbouring slabs, the halo, and
send the halo's gradient back in backward (see [Note: slabs and halos] in zero/spatial/halo.py),
one split dimension at a time over that dimension's grid line; pointwise layers and the
concatenation of skip connections are local, because every tensor is split canonically whatever
its length. The model's parameters are whole on every rank of the group and their gradients are
summed over it, as for sequence parallelism (ZeRO partitions model states over data x spatial
ranks).

The pieces, in this room:
- `parallelize(model, comm, dim)`: converts the supported modules in place (their forwards in
  zero/spatial/layers.py and norms.py), refusing first, naming it, any module it cannot split;
  functional calls in the model's forward are seen by zero/spatial/functional.py;
- `shard_volume(x)` / `gather_volume(y)`: this rank's slab of a full (N, C, *spatial) tensor, and
  a slabbed tensor put back together on every rank;
- `whole_volume(loss)`, `volume_sum`, `volume_mean`: losses and metrics over the whole volume
  (zero/spatial/losses.py);
- zero/spatial/data.py: loaders that read only a rank's slab;
- zero/spatial/halo.py: the split and the exchange.
docs/spatial.md is the user's guide.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from zero.parallel.comm import Comm
from zero.spatial.data import SlabCollate, SpatialRank, read_slab, slab_bounds
from zero.spatial.functional import Scope
from zero.spatial.halo import SpatialDivergence, Split, fetch, group_sum
from zero.spatial.layers import (
    Plan,
    SpatialAdaptivePool,
    SpatialConv,
    SpatialConvTranspose,
    SpatialError,
    SpatialPool,
    SpatialUpsample,
    check_adaptive_pool,
    check_conv,
    check_pool,
    check_upsample,
    convert,
)
from zero.spatial.losses import whole_volume
from zero.spatial.norms import SpatialBatchNorm, SpatialGroupNorm, check_norm

__all__ = ["Split", "fetch", "shard_volume", "gather_volume", "parallelize", "volume_sum", "volume_mean",
           "whole_volume", "grid_shape", "SpatialError", "SpatialDivergence", "slab_bounds", "read_slab",
           "SlabCollate", "SpatialRank"]

log = logging.getLogger(__name__)
_current: Plan | None = None  # the layout `parallelize` (or `initialize`) last converted a model for


def _comm(comm: Comm | None) -> Comm:
    if comm is not None:
        return comm
    if _current is None:
        raise SpatialError("no spatial group yet: zero.initialize with spatial_parallel_size > 1 (or "
                           "zero.spatial.parallelize) sets it; or pass comm=")
    return _current.comm


def _layout(comm: Comm | None, dim) -> Plan:
    """The dimensions and axes a function splits along: the layout `parallelize` made, or, with
    `comm` given, `dim` (one dimension, or several: a grid, see `grid_shape`) over `comm`."""
    dims = None if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    if _current is not None and comm in (None, _current.comm) and dims in (None, _current.dims):
        return _current
    return _plan(_comm(comm), dims or (2,))


def grid_shape(ranks: int, dims: int) -> tuple[int, ...]:
    """How `ranks` spatial ranks split `dims` dimensions: as even a grid as the factors allow, the
    larger parts on the earlier dimensions (4 over 2: 2 x 2; 8 over 2: 4 x 2; 6 over 3: 3 x 2 x 1)."""
    shape = [1] * dims
    for f in _factors(ranks):
        shape[shape.index(min(shape))] *= f
    return tuple(sorted(shape, reverse=True))


def _factors(n: int) -> list[int]:
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    return sorted(out + ([n] if n > 1 else []), reverse=True)


def _plan(comm: Comm, dims: tuple[int, ...], sites: tuple[str, ...] = ()) -> Plan:
    """The layout of `dims` over `comm`: one dimension over the whole group, or a grid (row-major
    over the group's ranks; `grid_shape`), each dimension over the ranks of its grid line. A
    dimension the grid gives one part is not split."""
    if len(dims) == 1 or comm.world_size == 1:
        return Plan(comm, dims[:1], (comm,), sites)
    import torch.distributed as dist

    from zero.parallel.groups import group_of

    shape = grid_shape(comm.world_size, len(dims))
    if 1 in shape:
        log.warning("zero.spatial: %d ranks over dimensions %s make a %s grid: dimension(s) %s are not split",
                    comm.world_size, list(dims), " x ".join(map(str, shape)),
                    [d for d, n in zip(dims, shape) if n == 1])
    members = dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD)
    grid = torch.tensor(members).view(shape)  # row-major: the group's rank r at its coordinates
    coords = [int(c) for c in (grid == members[comm.rank]).nonzero()[0]]
    split_dims, axes = [], []
    for i, (dim, n) in enumerate(zip(dims, shape)):
        if n > 1:  # this rank's line along dimension i: every coordinate but the i-th its own
            line = grid[(*coords[:i], slice(None), *coords[i + 1:])]
            split_dims.append(dim)
            axes.append(Comm(group_of(line.tolist())))
    return Plan(comm, tuple(split_dims), tuple(axes), sites)


# What parallelize converts: the module types (the first row that matches), the check that refuses
# what cannot be split, and the forward over slabs.
_SPLIT = (
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), check_conv, SpatialConv),
    ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), check_conv, SpatialConvTranspose),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), check_pool, SpatialPool),
    ((nn.GroupNorm,), check_norm, SpatialGroupNorm),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
     check_norm, SpatialBatchNorm),
    ((nn.Upsample,), check_upsample, SpatialUpsample),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
      nn.AdaptiveMaxPool3d), check_adaptive_pool, SpatialAdaptivePool),
)
# Networks refused whole, with the reason (before their first unsupported leaf would be named)
_REFUSED = {
    "SwinUNETR": "its Swin transformer encoder attends within 7^3 windows shifted by half a window and merges "
                 "2x2x2 patches with a Linear layer; over a split volume the windows and the shift would have to "
                 "follow the slab boundaries, with the shifted windows' planes exchanged as halos, which is not "
                 "built. Train it on whole volumes (ZeRO and offload still apply), or use a convolutional U-Net "
                 "(MONAI's UNet, BasicUNet, DynUNet, SegResNet-like networks) with spatial parallelism",
}
_POINTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.RReLU,
              nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
              nn.LogSigmoid, nn.Tanhshrink, nn.Threshold, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
              nn.Dropout3d, nn.AlphaDropout, nn.Sequential, nn.ModuleList, nn.ModuleDict)
_POINTWISE_NAMES = {"Swish", "MemoryEfficientSwish", "Mish"}  # MONAI's activations, by class name
_OVER_CHANNELS = (nn.Softmax, nn.LogSoftmax, nn.Softmin)  # pointwise in space when over the channels (dim=1)


def shard_volume(x: torch.Tensor, comm: Comm | None = None, dim=None) -> torch.Tensor:
    """This rank's slab (or block, over a grid) of the full tensor `x` (the canonical split along
    each split dimension: see [Note: slabs and halos]); every rank of the spatial group (`comm`,
    default: the one `initialize` made, with its dimensions) passes the same `x`."""
    for d, axis in (layout := _layout(comm, dim)).on(layout.dims):
        a, b = Split(x.shape[d], axis.world_size).bounds(axis.rank)
        if a == b:
            raise SpatialError(f"shard_volume: dimension {d} of {x.shape[d]} planes cannot give each of the "
                               f"{axis.world_size} spatial ranks along it a plane")
        x = x.narrow(d, a, b - a)
    return x.contiguous()


@torch.no_grad()
def gather_volume(y: torch.Tensor, comm: Comm | None = None, dim=None) -> torch.Tensor:
    """The whole tensor whose slabs (or blocks) the ranks of the spatial group hold, on every rank
    (for evaluation and saving predictions; not differentiable)."""
    layout = _layout(comm, dim)
    for d, axis in layout.on(layout.dims):
        y = _gather_along(y, axis, d)
    return y


def _gather_along(y: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    split = Split.of(y.shape[dim], comm)
    widest = max(split.sizes())
    planes = y.movedim(dim, 0)
    padded = planes.new_zeros((widest, *planes.shape[1:]))
    padded[:planes.shape[0]] = planes
    every = planes.new_empty((comm.world_size * widest, *planes.shape[1:]))
    comm.all_gather(every.view(-1), padded.reshape(-1).contiguous(), label="spatial_gather")
    parts = [every[r * widest:r * widest + n] for r, n in enumerate(split.sizes())]
    return torch.cat(parts).movedim(0, dim)


def volume_sum(x: torch.Tensor, comm: Comm | None = None) -> torch.Tensor:
    """The sum of every element of the split tensor `x` over the whole volume, the same on every
    rank, differentiable: each rank's gradient is its slab's share times the group's size, which
    the engine's average over the ranks (the spatial ones included) turns back into the unsplit
    gradient. Build losses from it (a Dice score's sums)."""
    return group_sum(x.sum(), _comm(comm))


def volume_mean(x: torch.Tensor, comm: Comm | None = None, dim=None) -> torch.Tensor:
    """The mean of every element of the split tensor `x` over the whole volume: a mean loss (MSE,
    cross-entropy per voxel) equal to the unsplit one, on every rank."""
    layout = _layout(comm, dim)
    count = x.numel()
    for d, axis in layout.on(layout.dims):
        count = count // max(x.shape[d], 1) * Split.of(x.shape[d], axis).length
    return volume_sum(x, layout.comm) / count


def parallelize(model: nn.Module, comm: Comm, dim=2) -> nn.Module:
    """Convert `model`'s modules to run on slabs split along `dim` over `comm`, in place; `dim` a
    list of two or three dimensions: blocks of a grid over them (`grid_shape`).

    Raises:
        SpatialError: a module that cannot run on a split volume (named with its path); nothing
            was changed.
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if len(set(dims)) != len(dims) or not all(isinstance(d, int) and d >= 2 for d in dims):
        raise SpatialError(f"parallelize: dim={dim!r}: give distinct spatial dimensions (>= 2) of an (N, C, *spatial) "
                           f"tensor")
    chosen = []
    for path, module in model.named_modules():
        reason = next((why for cls in type(module).__mro__ for name, why in _REFUSED.items() if cls.__name__ == name),
                      None)
        if reason is not None:
            raise SpatialError(f"{path or '<model>'} ({type(module).__name__}) cannot run on a volume split over ranks: "
                               f"{reason}")
        row = next((r for r in _SPLIT if isinstance(module, r[0])), None)
        if row is not None:
            base = next(c for c in type(module).__mro__ if c in row[0])
            if type(module).forward is not base.forward:
                raise SpatialError(f"{path or '<model>'} ({type(module).__name__}) overrides {base.__name__}.forward; "
                                   f"zero.spatial splits torch's own layers only (move the extra computation into "
                                   f"modules of its own)")
            row[1](module, path or "<model>", dims)
            chosen.append((path or "<model>", module, row[2]))
        elif isinstance(module, _OVER_CHANNELS) and module.dim not in (1, -len(dims) - 2):
            raise SpatialError(f"{path or '<model>'} ({type(module).__name__}(dim={module.dim})) over a dimension other "
                               f"than the channels cannot run on a volume split over ranks")
        elif next(module.children(), None) is None and not isinstance(module, (*_POINTWISE, *_OVER_CHANNELS)) \
                and type(module).__name__ not in _POINTWISE_NAMES:
            raise SpatialError(f"{path or '<model>'} ({type(module).__name__}) cannot run on a volume split over "
                               f"ranks yet (supported so far: convolutions, transposed convolutions, pools, "
                               f"normalisation, Upsample and pointwise layers; see docs/spatial.md)")
    plan = _plan(comm, dims, tuple(f"{path} ({type(module).__name__})" for path, module, _ in chosen))
    for site, (_, module, mixin) in enumerate(chosen):
        convert(module, mixin, plan, site)
    Scope(model, plan)  # functional calls in the model's forward (zero/spatial/functional.py)
    global _current
    _current = plan
    return model

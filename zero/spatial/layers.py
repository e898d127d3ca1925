"""Layers over a split volume: each computes its output slab from a fetched input range (see
[Note: slabs and halos] in zero/spatial/halo.py). So far: convolutions (Conv1d/2d/3d).

A converted module keeps its class (as a subclass: `isinstance(m, nn.Conv3d)` holds), its
parameters and its state-dict keys; only `forward` changes. `convert` refuses, before changing
anything, what it cannot split, naming the module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zero.parallel.comm import Comm
from zero.spatial.halo import Split, fetch


@dataclass(frozen=True)
class Plan:
    """Where a converted module's input is split: `dim` of the (N, C, *spatial) tensor, over `comm`."""

    comm: Comm
    dim: int


class SpatialError(ValueError):
    """A module or a volume that spatial parallelism cannot split; the message names it."""


def _pads(module: nn.modules.conv._ConvNd) -> list[tuple[int, int]]:
    """(left, right) zero padding of each spatial dimension, as the module pads."""
    nd = len(module.kernel_size)
    if module.padding == "valid":
        return [(0, 0)] * nd
    if module.padding == "same":
        total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        return [(t // 2, t - t // 2) for t in total]
    return [(p, p) for p in module.padding]


def _output_ranges(split: Split, out: Split, kernel: int, stride: int, dilation: int, left: int, what: str
                   ) -> list[tuple[int, int]]:
    """The input planes [lo, hi) each rank needs for its slab of the output split `out`."""
    if 0 in out.sizes() or 0 in split.sizes():
        raise SpatialError(f"{what}: a volume of {split.length} planes in, {out.length} out, is too small to give "
                           f"each of the {split.parts} spatial ranks at least one plane; use fewer spatial ranks or a "
                           f"larger volume")
    ranges = []
    for r in range(out.parts):
        o0, o1 = out.bounds(r)
        ranges.append((o0 * stride - left, (o1 - 1) * stride - left + dilation * (kernel - 1) + 1))
    return ranges


class SpatialConv:
    """forward of a Conv1d/2d/3d whose input is split along `self._zero_spatial.dim`."""

    _zero_spatial: Plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._zero_spatial
        axis = plan.dim - 2  # the split dimension among the spatial ones
        split = Split.of(x.shape[plan.dim], plan.comm)
        pads = _pads(self)
        k, s, d = self.kernel_size[axis], self.stride[axis], self.dilation[axis]
        left, right = pads[axis]
        out = Split((split.length + left + right - d * (k - 1) - 1) // s + 1, split.parts)
        ranges = _output_ranges(split, out, k, s, d, left, f"{type(self).__name__}")
        x = fetch(x, plan.dim, split, ranges, plan.comm)
        flat = []
        for i in reversed(range(len(pads))):  # F.pad lists the last dimension first
            flat += [0, 0] if i == axis else list(pads[i])
        if any(flat):
            x = F.pad(x, flat)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(pads)]
        return conv(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


_CONVERTED: dict[type, type] = {}


def _converted_class(cls: type, mixin: type) -> type:
    if cls not in _CONVERTED:
        _CONVERTED[cls] = type(f"Spatial{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CONVERTED[cls]


def check_conv(module: nn.Module, path: str) -> None:
    """Raise SpatialError unless `module` is a convolution `SpatialConv` computes exactly."""
    if module.padding_mode != "zeros":
        raise SpatialError(f"{path} ({type(module).__name__}): padding_mode={module.padding_mode!r} is not supported "
                           f"over a split volume yet (zeros padding is)")


def convert_conv(module: nn.Module, plan: Plan) -> None:
    module.__class__ = _converted_class(type(module), SpatialConv)
    module._zero_spatial = plan

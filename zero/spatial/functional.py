"""Functional calls inside a converted model's forward: `F.interpolate` is split like nn.Upsample,
and the other window operations (`F.conv3d`, `F.max_pool3d`, ...) are refused by name, since
computed on a slab they would silently miss the neighbours' planes.

[Note: functional calls over a split volume]
`parallelize` converts modules; a model may also call torch's functions directly in its own
forward (`F.interpolate(x, scale_factor=2)` in a decoder, `F.max_pool3d(x, 2)`), which no module
conversion sees. While a converted model's forward runs, a TorchFunctionMode (`SplitFunctions`)
sees every torch function called: calls made by a converted module's own forward (and by zero's
layers) pass through untouched (`_INSIDE`, counted per thread), and so does everything pointwise;
interpolation is computed over the split (zero.spatial.layers.interpolate); sums, means and
vector norms over the split dimensions (a squeeze-excitation's global mean) over the whole volume,
as in a loss (zero/spatial/losses.py), max/min over them refused; F.pad of a split dimension and
a window operation raise SpatialError naming the function and the module to use instead. A block recomputed by
activation checkpointing runs outside the model's forward, so a functional call inside one is not
seen there: torch's checkpoint then finds the recomputed shapes differ and raises (use modules in
checkpointed blocks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from zero.spatial.layers import _INSIDE, Plan, SpatialError, interpolate
from zero.spatial.losses import _EXTREMES, _MEANS, _SUMS, _Reductions

# torch functions that read a window of planes, with the module zero.spatial splits instead
_WINDOWED = {
    **{f"conv{n}d": f"nn.Conv{n}d" for n in (1, 2, 3)},
    **{f"conv_transpose{n}d": f"nn.ConvTranspose{n}d" for n in (1, 2, 3)},
    **{f"{p}max_pool{n}d": f"nn.MaxPool{n}d" for n in (1, 2, 3) for p in ("", "_")},
    **{f"max_pool{n}d_with_indices": f"nn.MaxPool{n}d" for n in (1, 2, 3)},
    **{f"avg_pool{n}d": f"nn.AvgPool{n}d" for n in (1, 2, 3)},
    **{f"adaptive_avg_pool{n}d": f"nn.AdaptiveAvgPool{n}d" for n in (1, 2, 3)},
    **{f"{p}adaptive_max_pool{n}d": f"nn.AdaptiveMaxPool{n}d" for n in (1, 2, 3) for p in ("", "_")},
    **{f"lp_pool{n}d": "no module (not supported)" for n in (1, 2, 3)},
    "unfold": "no module (not supported)", "fold": "no module (not supported)",
    "grid_sample": "no module (not supported)", "affine_grid": "no module (not supported)",
    "scaled_dot_product_attention": "no module (attention over a split volume is not supported)",
}


_REDUCING = {*_SUMS, *_MEANS, *_EXTREMES, torch.linalg.vector_norm}


class SplitFunctions(TorchFunctionMode):
    """See [Note: functional calls over a split volume]."""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan
        self.reductions = _Reductions(plan, ones_reduced=False)  # its handler, called from this one

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _INSIDE.depth:
            return func(*args, **kwargs)
        if func is F.interpolate:
            return _interpolate(self.plan, *args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.dim() <= max(self.plan.dims):
            return func(*args, **kwargs)
        if func is F.pad:
            self._check_pad(x, args[1] if len(args) > 1 else kwargs.get("pad"))
            return func(*args, **kwargs)
        if func in _REDUCING:  # a squeeze-excitation's mean over the volume: over the whole volume
            return self.reductions.__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _WINDOWED and func is not torch.Tensor.unfold:  # Tensor.unfold: a view, not F.unfold
            raise SpatialError(f"{name}, called in the forward of a model whose volume is split over ranks, would "
                               f"miss the neighbouring slabs' planes; use {_WINDOWED[name]} as a module, which "
                               f"zero.spatial converts (see docs/spatial.md)")
        return func(*args, **kwargs)

    def _check_pad(self, x: torch.Tensor, pad) -> None:
        """F.pad of a split dimension would pad every slab (MONAI's UpCat pads a skip whose length
        is odd): refused; padding the other dimensions is local."""
        for i, dim in enumerate(range(x.dim() - 1, -1, -1)):  # pad lists the last dimension first
            if dim in self.plan.dims and 2 * i + 1 < len(pad) and (pad[2 * i] or pad[2 * i + 1]):
                raise SpatialError(f"F.pad of dimension {dim}, which is split over ranks, in the forward of a split "
                                   f"model would pad every rank's slab; give that dimension a length the model's "
                                   f"pools divide (MONAI's UpCat pads a skip connection whose length is odd)")


def _interpolate(plan: Plan, input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False):
    if antialias:
        raise SpatialError("F.interpolate(antialias=True) is not supported over a split volume")
    if input.dim() <= max(plan.dims):  # not a volume with the split dimensions
        _INSIDE.depth += 1
        try:
            return F.interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor)
        finally:
            _INSIDE.depth -= 1
    return interpolate(input, plan, size, scale_factor, mode, align_corners, recompute_scale_factor)


class Scope:
    """Forward hooks that hold `SplitFunctions` active while the converted model's forward runs
    (nested calls of the same model enter it once)."""

    def __init__(self, model: torch.nn.Module, plan: Plan):
        self.mode = SplitFunctions(plan)
        self.depth = 0
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module, args):
        self.depth += 1
        if self.depth == 1:
            self.mode.__enter__()

    def _exit(self, module, args, output):
        self.depth -= 1
        if self.depth == 0:
            self.mode.__exit__(None, None, None)

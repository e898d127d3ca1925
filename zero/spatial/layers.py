"""Layers over a split volume: each computes its output slab from a fetched input range (see
[Note: slabs and halos] in zero/spatial/halo.py): convolutions, transposed convolutions, max and
average pools, Upsample (1d/2d/3d); normalisation is in zero/spatial/norms.py.

A converted module keeps its class (as a subclass: `isinstance(m, nn.Conv3d)` holds), its
parameters and its state-dict keys; only `forward` changes (`convert`). Each `check_*` refuses,
before anything is changed, what its layer's forward cannot split, naming the module.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zero.parallel.comm import Comm
from zero.spatial.halo import Split, fetch


@dataclass(frozen=True)
class Plan:
    """Where a converted module's input is split: dimensions `dims` of the (N, C, *spatial)
    tensor, each over its `axes` Comm (the ranks of the group `comm` that share every other
    coordinate of the grid; a slab layout has one dimension, whose axis is `comm` itself);
    `sites`: the converted modules' names, in model order (see `Split.of`)."""

    comm: Comm
    dims: tuple[int, ...]
    axes: tuple[Comm, ...]
    sites: tuple[str, ...] = ()

    @property
    def dim(self) -> int:
        """The split dimension of a slab layout (one dimension)."""
        if len(self.dims) != 1:
            raise SpatialError(f"the volume is split over a grid of dimensions {list(self.dims)}, not one")
        return self.dims[0]

    def on(self, dims) -> list[tuple[int, Comm]]:
        return list(zip(dims, self.axes))


class SpatialLayer:
    """What every converted module has: its plan and its place among the converted modules."""

    _zero_spatial: Plan
    _zero_spatial_site: int = -1

    def _splits(self, x: torch.Tensor, shift: int = 0) -> list[tuple[int, Comm, Split]]:
        """(dimension, axis Comm, split) of each split dimension of `x` (shifted by `shift`, for a
        tensor with a dimension inserted before them)."""
        plan = self._zero_spatial
        return [(d + shift, c, Split.of(x.shape[d + shift], c, self._zero_spatial_site, plan.sites))
                for d, c in zip(plan.dims, plan.axes)]


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


class SpatialConv(SpatialLayer):
    """forward of a Conv1d/2d/3d whose input is split along `self._zero_spatial.dim`. Zero padding
    is the zeros `fetch` returns outside the volume; the other padding modes (reflect, replicate)
    fetch the planes inside it and pad the first and last slabs as torch would."""


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._zero_spatial
        pads = _pads(self)
        zeros = self.padding_mode == "zeros"
        edges = {}  # split dimension -> the planes the padding mode adds before and after this rank's range
        for dim, comm, split in self._splits(x):
            a = dim - 2
            k, s, d = self.kernel_size[a], self.stride[a], self.dilation[a]
            left, right = pads[a]
            out = Split((split.length + left + right - d * (k - 1) - 1) // s + 1, split.parts)
            ranges = _output_ranges(split, out, k, s, d, left, f"{type(self).__name__}")
            if not zeros:  # the planes inside the volume; the mode pads the rest below
                lo, hi = ranges[comm.rank]
                edges[dim] = [max(0, -lo), max(0, hi - split.length)]
                ranges = [(max(lo, 0), min(hi, split.length)) for lo, hi in ranges]
            x = fetch(x, dim, split, ranges, comm)
        # zero padding of the other dimensions by the convolution itself where it is the same on
        # both sides (F.pad would keep a padded copy of the input for backward)
        inner = tuple(p[0] if zeros and i + 2 not in plan.dims and p[0] == p[1] else 0 for i, p in enumerate(pads))
        flat = []
        for i in reversed(range(len(pads))):  # F.pad lists the last dimension first
            if i + 2 in plan.dims:
                flat += [0, 0] if zeros else edges[i + 2]
            else:
                flat += [pads[i][0] - inner[i], pads[i][1] - inner[i]]
        if any(flat):
            x = F.pad(x, flat) if zeros else F.pad(x, flat, mode=self.padding_mode)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(pads)]
        return conv(x, self.weight, self.bias, self.stride, inner, self.dilation, self.groups)


def _window(y: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Planes [start, start + length) of `y` along `dim`, zeros where that leaves `y`."""
    moved = y.movedim(dim, -1)
    return F.pad(moved, (-start, start + length - moved.shape[-1])).movedim(-1, dim)


def _other_dims(values, dims, on_split):
    """`values` (one per spatial dimension) with those of the split dimensions `dims` (of the
    (N, C, *spatial) tensor) replaced by `on_split`."""
    return tuple(on_split if i + 2 in dims else v for i, v in enumerate(values))


class SpatialConvTranspose(SpatialLayer):
    """forward of a ConvTranspose1d/2d/3d whose input is split: each output plane o adds
    x[i] * w[j] for o = i * stride - padding + dilation * j, so an output slab reads the input
    planes whose windows reach it, fetched from the neighbours; the bias goes on after cropping,
    since planes that no input reaches still get it."""

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        if output_size is not None:
            raise SpatialError(f"{type(self).__name__}: output_size= is not supported over a split volume; give "
                               f"output_padding instead")
        plan = self._zero_spatial
        crops = []
        for dim, comm, split in self._splits(x):
            a = dim - 2
            k, s, d = self.kernel_size[a], self.stride[a], self.dilation[a]
            p, op = self.padding[a], self.output_padding[a]
            out = Split((split.length - 1) * s - 2 * p + d * (k - 1) + op + 1, split.parts)
            if 0 in out.sizes() or 0 in split.sizes():
                raise SpatialError(f"{type(self).__name__}: a volume of {split.length} planes in, {out.length} out, is "
                                   f"too small to give each of the {split.parts} spatial ranks at least one plane")
            ranges = []
            for r in range(out.parts):
                o0, o1 = out.bounds(r)
                ranges.append((-((d * (k - 1) - o0 - p) // s), (o1 - 1 + p) // s + 1))  # ceil, floor + 1
            o0, o1 = out.bounds(comm.rank)
            crops.append((dim, o0 + p - ranges[comm.rank][0] * s, o1 - o0))
            x = fetch(x, dim, split, ranges, comm)
        conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[len(self.kernel_size)]
        y = conv(x, self.weight, None, self.stride, _other_dims(self.padding, plan.dims, 0),
                 _other_dims(self.output_padding, plan.dims, 0), self.groups, self.dilation)
        for dim, start, length in crops:
            y = _window(y, dim, start, length)
        if self.bias is not None:
            y = y + self.bias.view(-1, *(1,) * len(self.kernel_size))
        return y


def _per_dim(value, nd: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * nd


class SpatialPool(SpatialLayer):
    """forward of a MaxPool or AvgPool (1d/2d/3d) over a split input: a window pool is a
    convolution with a fixed kernel, so its output slab reads the same kind of input range. Outside
    the volume the fetched planes are -inf for a max pool and zeros for an average pool (which then
    counts them, as count_include_pad=True does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._zero_spatial
        nd = x.dim() - 2
        kernel, padding = _per_dim(self.kernel_size, nd), _per_dim(self.padding, nd)
        stride = _per_dim(self.stride if self.stride is not None else self.kernel_size, nd)
        dilation = _per_dim(getattr(self, "dilation", 1), nd)
        maximum = isinstance(self, nn.modules.pooling._MaxPoolNd)
        for dim, comm, split in self._splits(x):
            a = dim - 2
            k, s, d, p = kernel[a], stride[a], dilation[a], padding[a]
            out = Split((split.length + 2 * p - d * (k - 1) - 1) // s + 1, split.parts)
            ranges = _output_ranges(split, out, k, s, d, p, type(self).__name__)
            x = fetch(x, dim, split, ranges, comm)
            lo, hi = ranges[comm.rank]
            if maximum and (lo < 0 or hi > split.length):
                planes = torch.arange(lo, hi, device=x.device).view(-1, *(1,) * (x.dim() - dim - 1))
                x = x.masked_fill((planes < 0) | (planes >= split.length), float("-inf"))
        if maximum:
            pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
            return pool(x, kernel, stride, _other_dims(padding, plan.dims, 0), dilation)
        pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
        extra = {} if nd == 1 else {"divisor_override": self.divisor_override}
        return pool(x, kernel, stride, _other_dims(padding, plan.dims, 0), False, self.count_include_pad, **extra)


def check_pool(module: nn.Module, path: str, dims=(2,)) -> None:
    """Raise SpatialError unless `SpatialPool` computes `module` exactly."""
    name = f"{path} ({type(module).__name__})"
    if getattr(module, "ceil_mode", False):
        raise SpatialError(f"{name}: ceil_mode=True is not supported over a split volume yet")
    if getattr(module, "return_indices", False):
        raise SpatialError(f"{name}: return_indices=True is not supported over a split volume")
    if isinstance(module, nn.modules.pooling._AvgPoolNd) and not module.count_include_pad and any(
            _per_dim(module.padding, 3)):
        raise SpatialError(f"{name}: count_include_pad=False with padding is not supported over a split volume yet")


_CONVERTED: dict[type, type] = {}


class _Inside(threading.local):
    depth = 0  # converted modules' forwards running on this thread (see SplitFunctions)


_INSIDE = _Inside()


def _counted(forward):
    def run(self, *args, **kwargs):
        _INSIDE.depth += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            _INSIDE.depth -= 1

    run.__doc__, run.__name__ = forward.__doc__, forward.__name__
    return run


def convert(module: nn.Module, mixin: type, plan: Plan, site: int = -1) -> None:
    """Give `module` the forward of `mixin` over slabs split as `plan` says, keeping its class (as a
    subclass), parameters and state-dict keys; `site`: its place in `plan.sites`."""
    cls = type(module)
    if cls not in _CONVERTED:
        _CONVERTED[cls] = type(f"Spatial{cls.__name__}", (mixin, cls),
                               {"__module__": __name__, "forward": _counted(mixin.forward)})
    module.__class__ = _CONVERTED[cls]
    module._zero_spatial = plan
    module._zero_spatial_site = site


def check_conv(module: nn.Module, path: str, dims=(2,)) -> None:
    """Raise SpatialError unless `module` is a convolution `SpatialConv` computes exactly."""
    mode = module.padding_mode
    if mode == "circular" and any(any(_pads(module)[d - 2]) for d in dims):
        raise SpatialError(f"{path} ({type(module).__name__}): padding_mode='circular' along the split dimension joins "
                           f"the volume's two ends, which lie on the group's first and last ranks; not supported "
                           f"over a split volume (zeros, reflect and replicate are)")
    if mode != "zeros" and isinstance(module, nn.modules.conv._ConvTransposeNd):
        raise SpatialError(f"{path} ({type(module).__name__}): padding_mode={mode!r} (torch itself supports only "
                           f"zeros for transposed convolutions)")


class SpatialAdaptivePool(SpatialLayer):
    """forward of an AdaptiveAvgPool or AdaptiveMaxPool (1d/2d/3d) over a split input: output
    plane o pools input planes [floor(o L / O), ceil((o + 1) L / O)) of the split dimension's L
    (O output planes), so an output slab reads the range its first and last windows span,
    fetched from the neighbours; each plane is then pooled by torch along the other dimensions.
    The output must give every rank a plane (O >= the group's size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._zero_spatial
        nd = x.dim() - 2
        maximum = isinstance(self, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d))
        pool = ({1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d} if maximum else
                {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d})[nd]
        wanted = _per_dim(self.output_size, nd)
        for dim, comm, split in self._splits(x):  # one split dimension at a time: a box pools separably
            length = split.length if wanted[dim - 2] is None else wanted[dim - 2]
            out = Split(length, split.parts)
            if 0 in out.sizes() or 0 in split.sizes():
                raise SpatialError(f"{type(self).__name__}: an output of {length} planes along the split dimension "
                                   f"(of {split.length} in) cannot give each of the {split.parts} spatial ranks a "
                                   f"plane; pool to at least {split.parts} planes there, or gather the volume first "
                                   f"(zero.spatial.gather_volume)")

            def window(o: int, n=split.length, m=length) -> tuple[int, int]:
                return o * n // m, -(-(o + 1) * n // m)

            ranges = [(window(a)[0], window(b - 1)[1]) for a, b in map(out.bounds, range(split.parts))]
            lo = ranges[comm.rank][0]
            x = fetch(x, dim, split, ranges, comm)
            plane = tuple(1 if i + 2 == dim else x.shape[i + 2] for i in range(nd))
            pieces = []
            for o in range(*out.bounds(comm.rank)):
                a, b = window(o)
                pieces.append(pool(x.narrow(dim, a - lo, b - a), plane))
            x = torch.cat(pieces, dim)
        rest = tuple(x.shape[i + 2] if i + 2 in plan.dims or wanted[i] is None else wanted[i] for i in range(nd))
        return x if rest == tuple(x.shape[2:]) else pool(x, rest)


def check_adaptive_pool(module: nn.Module, path: str, dims=(2,)) -> None:
    if getattr(module, "return_indices", False):
        raise SpatialError(f"{path} ({type(module).__name__}): return_indices=True is not supported over a split volume")


class SpatialUpsample(SpatialLayer):
    """forward of an nn.Upsample over a split input (see `interpolate`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return interpolate(x, self._zero_spatial, self.size, self.scale_factor, self.mode, self.align_corners,
                           self.recompute_scale_factor, site=self._zero_spatial_site)


def interpolate(x: torch.Tensor, plan: Plan, size=None, scale_factor=None, mode: str = "nearest",
                align_corners=None, recompute_scale_factor=None, site: int = -1) -> torch.Tensor:
    """F.interpolate (nearest, or linear/bilinear/trilinear with align_corners either way) of a
    tensor split as `plan` says. Interpolation is separable: along the split dimension each output
    plane is read from one (nearest) or two (linear) input planes, at the source positions torch
    computes, fetched from the neighbours where they lie in another slab; the other dimensions are
    then interpolated by torch itself."""
    if mode not in _MODES:
        raise SpatialError(f"interpolation mode={mode!r} is not supported over a split volume yet (nearest and "
                           f"(bi/tri)linear are)")
    nd = x.dim() - 2
    sizes = _per_dim(size, nd) if size is not None else None
    scales = _per_dim(scale_factor, nd) if scale_factor is not None else None
    for dim, comm in plan.on(plan.dims):  # one split dimension at a time: interpolation is separable
        a = dim - 2
        split = Split.of(x.shape[dim], comm, site, plan.sites)
        length = sizes[a] if sizes is not None else int(split.length * scales[a])
        out = Split(length, split.parts)
        if 0 in out.sizes() or 0 in split.sizes():
            raise SpatialError(f"interpolation: a volume of {split.length} planes in, {length} out, is too small for "
                               f"{split.parts} spatial ranks")
        scale = scales[a] if scales else None
        first, second, weight = _sources(*out.bounds(comm.rank), split.length, length, scale, mode, align_corners,
                                         recompute_scale_factor)
        ranges = [(0, 0)] * split.parts
        for r in range(split.parts):
            lo, hi, _ = _sources(*out.bounds(r), split.length, length, scale, mode, align_corners,
                                 recompute_scale_factor)
            ranges[r] = (int(lo.min()), int(hi.max()) + 1)
        lo = ranges[comm.rank][0]
        x = fetch(x, dim, split, ranges, comm)
        y = x.index_select(dim, (first - lo).to(x.device))
        if weight is not None:
            w = weight.to(x.dtype).to(x.device).view(-1, *(1,) * (x.dim() - dim - 1))
            y = y * (1 - w) + x.index_select(dim, (second - lo).to(x.device)) * w
        x = y
    rest = [i for i in range(nd) if i + 2 not in plan.dims]
    if not rest:
        return x
    flat_mode = "nearest" if mode == "nearest" else {1: "linear", 2: "bilinear"}[len(rest)]
    split_dims = sorted(plan.dims)
    order = [0, *split_dims, 1, *(i + 2 for i in rest)]  # the split dimensions join the batch
    moved = x.permute(order)
    lead = moved.shape[:1 + len(split_dims)]
    flat = moved.reshape(-1, *moved.shape[1 + len(split_dims):])
    kw = {"align_corners": align_corners} if flat_mode != "nearest" else {}
    _INSIDE.depth += 1  # torch's own interpolation of the other dimensions: not split
    try:
        if sizes is not None:
            flat = F.interpolate(flat, size=[sizes[i] for i in rest], mode=flat_mode, **kw)
        else:
            flat = F.interpolate(flat, scale_factor=[scales[i] for i in rest], mode=flat_mode,
                                 recompute_scale_factor=recompute_scale_factor, **kw)
    finally:
        _INSIDE.depth -= 1
    back = [order.index(i) for i in range(len(order))]
    return flat.reshape(*lead, *flat.shape[1:]).permute(back)


_MODES = ("nearest", "linear", "bilinear", "trilinear")


def _sources(o0: int, o1: int, length_in: int, length_out: int, scale_factor, mode: str, align_corners,
             recompute: bool | None):
    """The input planes (first, second) and the weight of the second that torch reads for
    output planes [o0, o1) of an interpolation along one dimension (second and weight None for
    nearest)."""
    o = torch.arange(o0, o1, dtype=torch.float64)
    if align_corners:
        scale = (length_in - 1) / (length_out - 1) if length_out > 1 else 0.0
    elif scale_factor is not None and not recompute:
        scale = 1.0 / scale_factor
    else:
        scale = length_in / length_out
    if mode == "nearest":
        first = torch.clamp(torch.floor(o * scale), max=length_in - 1).long()
        return first, first, None
    src = o * scale if align_corners else torch.clamp(scale * (o + 0.5) - 0.5, min=0.0)
    first = torch.floor(src).long().clamp(max=length_in - 1)
    second = torch.clamp(first + 1, max=length_in - 1)
    return first, second, src - first


def check_upsample(module: nn.Module, path: str, dims=(2,)) -> None:
    if module.mode not in _MODES:
        raise SpatialError(f"{path} ({type(module).__name__}): mode={module.mode!r} is not supported over a split "
                           f"volume yet (nearest and (bi/tri)linear are)")

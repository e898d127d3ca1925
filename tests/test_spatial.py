"""Spatial parallelism (zero/spatial/): a layer over a volume split across 2, 3 and 4 ranks gives
the unsplit layer's output slab, input gradient and (summed over the group) weight gradient, in
fp64 to 1e-12; uneven slabs included."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d, "t1": nn.ConvTranspose1d, "t3": nn.ConvTranspose3d}
# (spatial dims, constructor arguments, length of the split dimension)
CASES = [
    (3, dict(kernel_size=3, padding=1), 12),
    (3, dict(kernel_size=3, padding=1), 13),  # uneven slabs
    (3, dict(kernel_size=1), 11),
    (3, dict(kernel_size=5, padding=2), 17),
    (3, dict(kernel_size=3, stride=2, padding=1), 15),
    (3, dict(kernel_size=2, stride=2), 16),  # a U-Net's downsampling
    (3, dict(kernel_size=3, padding="same", dilation=2), 14),
    (3, dict(kernel_size=4, padding="same"), 13),  # even kernel: torch pads one more on the right
    (3, dict(kernel_size=3, padding=0), 14),  # "valid": the output is shorter
    (3, dict(kernel_size=(3, 1, 3), padding=(1, 0, 1), groups=2), 10),
    (2, dict(kernel_size=3, padding=1, stride=(2, 1)), 11),
    (1, dict(kernel_size=5, padding=3, dilation=2), 19),
    # padding modes other than zeros: the first and last slabs pad as torch does
    (3, dict(kernel_size=3, padding=1, padding_mode="reflect"), 13),
    (3, dict(kernel_size=5, padding=2, stride=2, padding_mode="replicate"), 14),
    (3, dict(kernel_size=(1, 3, 3), padding=(0, 1, 1), padding_mode="circular"), 10),  # not along the split
    # transposed: a U-Net's upsampling, and overlapping / gapped windows
    ("t3", dict(kernel_size=2, stride=2), 7),
    ("t3", dict(kernel_size=3, stride=2, padding=1, output_padding=1), 9),
    ("t3", dict(kernel_size=3, padding=1), 11),
    ("t3", dict(kernel_size=2, stride=3), 8),  # planes no input reaches: the bias alone
    ("t3", dict(kernel_size=(3, 3, 1), stride=(2, 1, 1), dilation=(2, 1, 1), groups=2), 6),
    ("t1", dict(kernel_size=5, stride=2, padding=2, output_padding=1), 10),
    # pools
    ("max3", dict(kernel_size=2), 12),
    ("max3", dict(kernel_size=3, stride=2, padding=1), 13),
    ("max3", dict(kernel_size=3, stride=1, padding=1, dilation=2), 11),
    ("avg3", dict(kernel_size=2), 10),
    ("avg3", dict(kernel_size=3, stride=2, padding=1), 13),
    ("avg3", dict(kernel_size=3, stride=1, padding=1, divisor_override=5), 9),
    ("max1", dict(kernel_size=4, stride=3, padding=2), 17),
    # upsampling: nearest and (bi/tri)linear, both align_corners, scale factors and sizes
    ("up3", dict(scale_factor=2, mode="nearest"), 7),
    ("up3", dict(scale_factor=2, mode="trilinear"), 7),
    ("up3", dict(scale_factor=2, mode="trilinear", align_corners=True), 6),
    ("up3", dict(size=(11, 6, 4), mode="trilinear"), 5),  # a ratio that is not whole
    ("up3", dict(scale_factor=(1.5, 2, 1), mode="nearest"), 6),
    ("up2", dict(scale_factor=2, mode="bilinear"), 5),
    ("up1", dict(scale_factor=3, mode="linear", align_corners=True), 5),
    # adaptive pools: windows of uneven, overlapping lengths
    ("aavg3", dict(output_size=(5, 3, None)), 13),
    ("amax3", dict(output_size=(7, 2, 2)), 12),
    ("aavg3", dict(output_size=(None, 2, 3)), 9),
    ("amax1", dict(output_size=4), 11),
]
POOLS = {"aavg3": nn.AdaptiveAvgPool3d, "amax3": nn.AdaptiveMaxPool3d, "amax1": nn.AdaptiveMaxPool1d,
         "max1": nn.MaxPool1d, "max3": nn.MaxPool3d, "avg3": nn.AvgPool3d, "up1": nn.Upsample,
         "up2": nn.Upsample, "up3": nn.Upsample}  # the layers without parameters
# normalisation: (module, the length of the split dimension)
NORM_CASES = [
    (("GroupNorm", 2, 4), {}, 9),
    (("GroupNorm", 4, 4), {"affine": False}, 12),
    (("InstanceNorm3d", 4), {"affine": True}, 11),
    (("InstanceNorm3d", 4), {}, 8),
    (("BatchNorm3d", 4), {}, 13),
    (("BatchNorm3d", 4), {"momentum": None}, 10),
]


def _run_norms(cases, dim=2):
    import torch.distributed as dist

    import zero.spatial as sp
    from zero.parallel.comm import Comm

    comm = Comm()
    errors = []
    for i, ((name, *args), kwargs, length) in enumerate(cases):
        torch.manual_seed(i)
        norm = getattr(nn, name)(*args, **kwargs).double()
        with torch.no_grad():
            for p in norm.parameters():
                p.copy_(torch.randn_like(p))
        ref = copy.deepcopy(norm)
        sp.parallelize(norm, comm, dim)
        worst = 0.0
        for step in range(2):  # twice: BatchNorm's running statistics after two updates
            x = torch.randn(2, 4, length, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            xr = x.clone().requires_grad_()
            yr = ref(xr)
            gy = torch.randn(yr.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + step))
            (yr * gy).sum().backward()
            xs = sp.shard_volume(x, comm, dim).requires_grad_()
            y = norm(xs)
            (y * sp.shard_volume(gy, comm, dim)).sum().backward()
            worst = max(worst, (y - sp.shard_volume(yr.detach(), comm, dim)).abs().max().item(),
                        (xs.grad - sp.shard_volume(xr.grad, comm, dim)).abs().max().item())
        for p, q in zip(norm.parameters(), ref.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            worst = max(worst, (g - q.grad).abs().max().item())
        for b, c in zip(norm.buffers(), ref.buffers()):
            worst = max(worst, (b.double() - c.double()).abs().max().item())
        norm.eval(), ref.eval()
        x = torch.randn(2, 4, length, 3, 5, dtype=torch.float64)
        worst = max(worst, (norm(sp.shard_volume(x, comm, dim)) - sp.shard_volume(ref(x), comm, dim)).abs().max().item())
        errors.append(worst)
    return errors


@pytest.mark.parametrize("ranks", [2, 3])
def test_normalisation_over_a_split_volume_equals_the_unsplit_one(dist_run, ranks):
    for errors in dist_run(ranks, _run_norms, NORM_CASES, timeout=300):
        assert max(errors) < 1e-12, errors


def _run_cases(cases, dim=2):
    import zero.spatial as sp
    from zero.parallel.comm import Comm
    from zero.testing.spatial import compare_with_unsplit

    comm = Comm()
    errors = []
    for i, (nd, kwargs, length) in enumerate(cases):
        torch.manual_seed(i)
        conv = POOLS[nd](**kwargs) if nd in POOLS else CONVS[nd](4, 6, **kwargs).double()
        dims = nd if isinstance(nd, int) else int(nd[-1])
        x = torch.randn(2, 4, length, *(5,) * (dims - 1), dtype=torch.float64)
        run = compare_with_unsplit(conv, x, comm, seed=100 + i, dim=dim)
        errors.append((*run.errors.values(), (sp.gather_volume(run.out, comm, dim) - run.ref_out).abs().max().item()))
    return errors


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_a_convolution_over_a_split_volume_equals_the_unsplit_one(dist_run, ranks):
    for errors in dist_run(ranks, _run_cases, CASES, timeout=300):
        for case, errs in zip(CASES, errors):
            assert max(errs) < 1e-12, (case, errs)


def _refusals():
    import zero.spatial as sp
    from zero.parallel.comm import Comm

    comm = Comm()
    out = []
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(8, 2))
    before = type(model[0])
    try:
        sp.parallelize(model, comm)
    except sp.SpatialError as err:
        out.append(str(err))
    out.append(type(model[0]) is before)  # nothing changed
    conv = sp.parallelize(nn.Conv3d(1, 1, 3, padding=1), comm)
    try:
        conv(torch.randn(1, 1, 1 if comm.rank == 0 else 0, 3, 3))  # a volume of one plane over two ranks
    except sp.SpatialError as err:
        out.append(str(err))
    class Standardised(nn.Conv3d):  # a subclass with a forward of its own: not silently replaced
        def forward(self, x):
            return super().forward(x)

    for module in (nn.Conv3d(1, 1, 3, padding=1, padding_mode="circular"), _Functional(F.max_pool3d, kernel_size=2),
                   _Functional(F.pad, pad=[0, 0, 0, 0, 1, 0]), Standardised(1, 1, 3)):
        try:
            sp.parallelize(module, comm)(torch.randn(1, 4 if isinstance(module, _Functional) else 1, 4, 3, 3))
        except sp.SpatialError as err:
            out.append(str(err))
    try:  # a global pool: one plane cannot be split over two ranks
        sp.parallelize(nn.AdaptiveAvgPool3d(1), comm)(torch.randn(1, 1, 4, 3, 3))
    except sp.SpatialError as err:
        out.append(str(err))
    return out


def test_what_cannot_be_split_is_refused_by_name_before_anything_changes(dist_run):
    for out in dist_run(2, _refusals):
        assert "1 (Flatten) cannot run on a volume split over ranks yet" in out[0]
        assert out[1] is True
        assert "too small to give each of the 2 spatial ranks at least one plane" in out[2]
        assert "padding_mode='circular' along the split dimension joins the volume's two ends" in out[3]
        assert "max_pool3d, called in the forward of a model whose volume is split over ranks" in out[4]
        assert "use nn.MaxPool3d as a module" in out[4]
        assert "F.pad of dimension 2, which is split over ranks, in the forward of a split model" in out[5]
        assert "<model> (Standardised) overrides Conv3d.forward" in out[6]
        assert "AdaptiveAvgPool3d: an output of 1 planes along the split dimension (of 8 in) cannot give" in out[7]


class _Functional(nn.Module):
    """A convolution, then a torch function called in the forward (not a module)."""

    def __init__(self, fn, **kwargs):
        super().__init__()
        self.conv = nn.Conv3d(4, 4, 3, padding=1)
        self.fn, self.kwargs = fn, kwargs

    def forward(self, x):
        return self.fn(self.conv(x), **self.kwargs)


FUNCTIONAL = [dict(scale_factor=2, mode="trilinear"), dict(size=(9, 4, 6), mode="nearest"),
              dict(scale_factor=(2, 1, 1), mode="trilinear", align_corners=True)]


class _SqueezeExcite(nn.Module):
    """A convolution whose channels are scaled by a gate from their means over the volume, and
    the largest value along the channels (torch's functions in the forward, not modules)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        gate = torch.sigmoid(y.mean(dim=(2, 3, 4), keepdim=True) + torch.linalg.vector_norm(y, dim=(2, 3, 4),
                                                                                            keepdim=True))
        return y * gate + y.amax(dim=1, keepdim=True)


def _functional():
    from zero.parallel.comm import Comm
    from zero.testing.spatial import compare_with_unsplit

    comm = Comm()
    worst = []
    for i, kwargs in enumerate(FUNCTIONAL):
        torch.manual_seed(i)
        model = _Functional(F.interpolate, **kwargs).double()
        x = torch.randn(2, 4, 7, 3, 5, dtype=torch.float64)
        worst.append(max(compare_with_unsplit(model, x, comm).errors.values()))
    x = torch.randn(2, 4, 7, 3, 5, dtype=torch.float64)
    worst.append(max(compare_with_unsplit(_SqueezeExcite().double(), x, comm).errors.values()))
    return worst


@pytest.mark.parametrize("ranks", [2, 3])
def test_interpolate_and_volume_means_called_in_a_forward_equal_the_unsplit_ones(dist_run, ranks):
    for worst in dist_run(ranks, _functional):
        assert max(worst) < 1e-12, worst


def _diverge():
    """Rank 1 runs the model's second layer while rank 0 runs the first: both raise at once,
    naming the two layers, before any planes are exchanged."""
    import time

    import zero.spatial as sp
    from zero.parallel.comm import Comm

    comm = Comm()
    model = sp.parallelize(nn.Sequential(nn.Conv3d(1, 1, 3, padding=1), nn.ReLU(), nn.Conv3d(1, 1, 3, padding=1)),
                           comm)
    x = sp.shard_volume(torch.randn(1, 1, 8, 3, 3), comm)
    start = time.monotonic()
    try:
        model[0 if comm.rank == 0 else 2](x)
    except sp.SpatialDivergence as err:
        return str(err), time.monotonic() - start
    return "no error", 0.0


def test_ranks_that_run_different_layers_raise_at_once_naming_them(dist_run):
    for message, seconds in dist_run(2, _diverge):
        assert "the ranks of the group run different layers (rank 0 in 0 (Conv3d); rank 1 in 2 (Conv3d))" in message
        assert seconds < 5, seconds


def _stall():
    """Rank 1 never reaches the layer (alive, elsewhere): rank 0 raises within the collective
    timeout (ZERO_COLLECTIVE_TIMEOUT=2)."""
    import os
    import time

    os.environ["ZERO_COLLECTIVE_TIMEOUT"] = "2"
    import zero.spatial as sp
    from zero.parallel.comm import CollectiveTimeout, Comm

    comm = Comm()
    conv = sp.parallelize(nn.Conv3d(1, 1, 3, padding=1), comm)
    x = sp.shard_volume(torch.randn(1, 1, 8, 3, 3), comm)
    start = time.monotonic()
    if comm.rank == 1:
        time.sleep(6)
        return "slept", 0.0
    try:
        conv(x)
    except CollectiveTimeout as err:
        seconds = time.monotonic() - start
        try:  # the group is not used again: its abandoned collective would pair with the next one
            comm.all_reduce(torch.zeros(1))
        except CollectiveTimeout as again:
            return f"{err} | {again}", seconds
    return "no error", 0.0


def test_a_rank_that_never_reaches_an_exchange_makes_the_others_raise_within_the_timeout():
    from zero.testing.dist import DistPool

    pool = DistPool(2)  # its own ranks: the timed-out group is not reused
    try:
        (message, seconds), (slept, _) = pool.run(_stall, timeout=60)
    finally:
        pool.close(kill=True)
    assert "spatial_sizes) did not complete within 2 s" in message and slept == "slept", message
    assert "| this group is unusable after an earlier collective timed out" in message, message
    assert seconds < 4, seconds  # the timeout, not the peer's 6 s


def _unet(ranks_length, dim=2, shape=(4, 8)):
    """The example 3D U-Net (examples/train_unet3d.py) on a volume split over the group: output,
    input gradient and the group's summed parameter gradients against the unsplit model."""
    import importlib.util
    from pathlib import Path

    from zero.parallel.comm import Comm
    from zero.testing.spatial import compare_with_unsplit

    path = Path(__file__).parents[1] / "examples" / "train_unet3d.py"
    spec = importlib.util.spec_from_file_location("train_unet3d", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.UNet3D(width=4, depth=3).double()
    x = torch.randn(2, 1, ranks_length, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    run = compare_with_unsplit(model, x, Comm(), dim=dim)
    return max(run.errors.values()), model.state_dict().keys() == run.ref.state_dict().keys()


@pytest.mark.parametrize("ranks, length", [(2, 16), (4, 16), (3, 12), (2, 12)])  # 12: uneven slabs deeper down
def test_the_example_unet_over_a_split_volume_equals_the_unsplit_one(dist_run, ranks, length):
    for worst, same_keys in dist_run(ranks, _unet, length, timeout=300):
        assert worst < 1e-11 and same_keys, worst


# a 2 x 2 grid over depth and height: every case with two or three spatial dimensions (circular
# padding along a split dimension is refused)
GRID_CASES = [c for c in CASES if (c[0] if isinstance(c[0], int) else int(c[0][-1])) >= 2
              and c[1].get("padding_mode") != "circular"]


def _grid():
    import zero.spatial as sp
    from zero.parallel.comm import Comm

    assert sp.grid_shape(4, 2) == (2, 2) and sp.grid_shape(8, 2) == (4, 2) and sp.grid_shape(6, 3) == (3, 2, 1)
    layers = _run_cases(GRID_CASES, (2, 3))
    norms = _run_norms(NORM_CASES, (2, 3))
    unet, same_keys = _unet(16, (2, 3), (8, 8))
    assert sp._current.dims == (2, 3) and [a.world_size for a in sp._current.axes] == [2, 2]  # a grid, not slabs
    x = torch.randn(1, 2, 9, 7, 5, dtype=torch.float64)
    whole = sp.gather_volume(sp.shard_volume(x, Comm(), (2, 3)), Comm(), (2, 3))  # blocks of 5/4 x 4/3 planes
    return layers, norms, unet, same_keys, torch.equal(whole, x)


def test_layers_and_the_unet_over_a_2x2_grid_equal_the_unsplit_ones(dist_run):
    for layers, norms, unet, same_keys, gathered in dist_run(4, _grid, timeout=600):
        for case, errs in zip(GRID_CASES, layers):
            assert max(errs) < 1e-12, (case, errs)
        assert max(norms) < 1e-12, norms
        assert unet < 1e-11 and same_keys and gathered, unet

"""MONAI's 3D U-Nets over a volume split across spatial ranks (zero.spatial.parallelize): UNet,
BasicUNet and DynUNet give the unsplit model's output, input gradient and (summed over the group)
parameter gradients, in fp64."""
import copy

import pytest
import torch

pytest.importorskip("monai", reason="needs MONAI (pip install monai; part of the test extra)")

# (network, the volume's shape (D, H, W): BasicUNet halves it four times, the others twice)
NETS = {"UNet": (16, 16, 16), "BasicUNet": (32, 32, 32), "DynUNet": (16, 16, 16)}


def _build(name: str) -> torch.nn.Module:
    from monai.networks.nets import BasicUNet, DynUNet, UNet

    torch.manual_seed(0)
    if name == "UNet":
        return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                    num_res_units=1)
    if name == "BasicUNet":
        return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))
    return DynUNet(spatial_dims=3, in_channels=1, out_channels=2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                   upsample_kernel_size=[2, 2])


def _compare(name: str) -> float:
    import torch.distributed as dist

    import zero.spatial as sp
    from zero.parallel.comm import Comm

    comm = Comm()
    model = _build(name).double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 1, *NETS[name], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    gy = torch.randn(yr.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (yr * gy).sum().backward()
    sp.parallelize(model, comm)
    xs = sp.shard_volume(x, comm).requires_grad_()
    y = model(xs)
    (y * sp.shard_volume(gy, comm)).sum().backward()
    worst = max((y - sp.shard_volume(yr.detach(), comm)).abs().max().item(),
                (xs.grad - sp.shard_volume(xr.grad, comm)).abs().max().item())
    for p, q in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        worst = max(worst, (g - q.grad).abs().max().item())
    return worst


@pytest.mark.parametrize("name, ranks", [("UNet", 2), ("UNet", 4), ("BasicUNet", 2), ("DynUNet", 2), ("DynUNet", 4)])
def test_a_monai_unet_over_a_split_volume_equals_the_unsplit_one(dist_run, name, ranks):
    for worst in dist_run(ranks, _compare, name, timeout=300):
        assert worst < 1e-10, (name, worst)

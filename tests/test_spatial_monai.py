"""MONAI's 3D U-Nets over a volume split across spatial ranks (zero.spatial.parallelize): UNet,
BasicUNet and DynUNet give the unsplit model's output, input gradient and (summed over the group)
parameter gradients, in fp64."""

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
    from zero.parallel.comm import Comm
    from zero.testing.spatial import compare_with_unsplit

    x = torch.randn(2, 1, *NETS[name], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return max(compare_with_unsplit(_build(name).double(), x, Comm()).errors.values())


@pytest.mark.parametrize("name, ranks", [("UNet", 2), ("UNet", 4), ("BasicUNet", 2), ("DynUNet", 2), ("DynUNet", 4)])
def test_a_monai_unet_over_a_split_volume_equals_the_unsplit_one(dist_run, name, ranks):
    for worst in dist_run(ranks, _compare, name, timeout=300):
        assert worst < 1e-10, (name, worst)


def test_swin_unetr_is_refused_with_the_reason_before_anything_changes():
    from monai.networks.nets import SwinUNETR

    import zero.spatial as sp
    from zero.parallel.comm import Comm

    model = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(sp.SpatialError) as err:
        sp.parallelize(model, Comm())
    assert "<model> (SwinUNETR) cannot run on a volume split over ranks" in str(err.value)
    assert "windows and the shift would have to follow the slab boundaries" in str(err.value)
    assert {name: type(m) for name, m in model.named_modules()} == before  # nothing converted

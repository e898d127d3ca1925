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


def _losses(dim) -> list[float]:
    """MONAI's Dice losses and torch's own, wrapped in whole_volume over slabs (or a grid's blocks):
    the unsplit value on every rank, and the unsplit gradient (times the group's size)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from monai.losses import DiceCELoss, DiceLoss

    import zero.spatial as sp
    from zero.parallel.comm import Comm

    comm = Comm()
    g = torch.Generator().manual_seed(3)
    out = torch.randn(2, 3, 9, 6, 5, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 3, (2, 1, 9, 6, 5), generator=g)
    labels[0, 0, :2] = -1  # ignored voxels, for cross-entropy's ignore_index
    soft = torch.rand(2, 3, 9, 6, 5, dtype=torch.float64, generator=g)
    cases = [
        (DiceLoss(sigmoid=True), (soft > 0.5).double()),
        (DiceCELoss(softmax=True, to_onehot_y=True), labels.clamp(min=0).double()),
        (DiceLoss(softmax=True, include_background=False, batch=True, squared_pred=True), soft),
        (lambda a, b: F.mse_loss(a, b), soft),
        (lambda a, b: F.cross_entropy(a, b[:, 0], ignore_index=-1), labels),
        (lambda a, b: F.cross_entropy(a, b[:, 0], weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)),
         labels.clamp(min=0)),
        (lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction="sum") / 7, soft),
        (lambda a, b: (a.sigmoid() * b).mean(dim=(2, 3, 4)).sum() + a.mean(), soft),
        (lambda a, b: (a * b).sum(dim=(2, 3, 4), keepdim=True).sum() / 100, soft),  # reduced once, not twice
        (lambda a, b: F.cross_entropy(a, b[:, 0], weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64),
                                      ignore_index=255), labels.masked_fill(labels < 0, 255)),
    ]
    worst = []
    for loss, target in cases:
        whole = out.clone().requires_grad_()
        expected = loss(whole, target)
        expected.backward()
        mine = sp.shard_volume(out, comm, dim).requires_grad_()
        value = sp.whole_volume(loss, comm, dim)(mine, sp.shard_volume(target, comm, dim))
        value.backward()
        values = torch.zeros(dist.get_world_size(), dtype=torch.float64)
        dist.all_gather_into_tensor(values, value.detach().reshape(1))
        worst.append(max((values - expected.detach()).abs().max().item(),
                         (mine.grad / comm.world_size - sp.shard_volume(whole.grad, comm, dim)).abs().max().item()))
    return worst


@pytest.mark.parametrize("ranks, dim", [(2, 2), (4, (2, 3))])
def test_losses_over_a_split_volume_equal_the_unsplit_ones(dist_run, ranks, dim):
    for worst in dist_run(ranks, _losses, dim):
        assert max(worst) < 1e-12, worst


def test_a_converted_model_saves_an_ordinary_state_dict_for_sliding_window_inference(monkeypatch):
    from monai.inferers import sliding_window_inference

    import zero.spatial as sp
    from zero.parallel.comm import Comm

    monkeypatch.setattr(sp, "_current", None)  # the layout parallelize sets here goes with the test

    model, fresh = _build("UNet").double(), _build("UNet").double()
    sp.parallelize(model, Comm())  # one process: a group of one, converted all the same
    fresh.load_state_dict(model.state_dict())  # same keys, no wrapper state
    x = torch.randn(1, 1, 24, 20, 16, dtype=torch.float64)
    with torch.no_grad():
        assert sliding_window_inference(x, (16, 16, 16), 2, fresh.eval(), overlap=0.5).shape == (1, 2, 24, 20, 16)
        assert torch.allclose(sliding_window_inference(x, (24, 20, 16), 1, fresh), fresh(x))  # one window: the whole
        assert torch.allclose(model.eval()(x), fresh(x), rtol=0, atol=1e-12)

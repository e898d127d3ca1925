"""Spatial parallelism composed with ZeRO (docs/spatial.md): `zero.initialize` with
`spatial_parallel_size` splits each volume over the group, ZeRO partitions over every rank, and
a few AdamW steps of the example 3D U-Net equal the unsplit model trained in one process."""
import importlib.util
from pathlib import Path

import pytest
import torch

STEPS = 5
# A convolution's bias before a GroupNorm has a gradient of exactly zero, which the split and the
# unsplit model compute as different ~1e-9 round-off; with Adam's eps at 1e-8 that noise would
# make steps of +-lr. An eps of 1e-4 keeps such steps below 1e-6 and the others as they are.
EPS = 1e-4


def _example():
    spec = importlib.util.spec_from_file_location("train_unet3d", Path(__file__).parents[1] / "examples" /
                                                  "train_unet3d.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _volumes(step: int, samples: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Volumes of 16 planes: split over 2 or 4 ranks, every level's slabs start at an even plane."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(samples, 1, 16, 4, 8, generator=g), torch.randn(samples, 1, 16, 4, 8, generator=g)


def _build(net: str) -> torch.nn.Module:
    """The example U-Net, or MONAI's UNet or DynUNet, small."""
    torch.manual_seed(0)
    if net == "unet3d":
        return _example().UNet3D(width=4, depth=3)
    from monai.networks.nets import DynUNet, UNet

    if net == "monai-unet":
        return UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)
    return DynUNet(spatial_dims=3, in_channels=1, out_channels=1, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                   upsample_kernel_size=[2, 2])


def _reference(samples: int = 2, net: str = "unet3d") -> tuple[list[torch.Tensor], int]:
    """The unsplit model trained in one process on every data-parallel rank's samples, and the
    halo formula's bytes per rank per step for 2 spatial ranks (see docs/spatial.md)."""
    model = _build(net)
    planes = []  # N x C x H x W of each 3x3x3 convolution's input: one plane each way per cut, in forward,
    # and its gradient sent back in backward (unless the input needs none: the model's input)
    for m in model.modules():
        if isinstance(m, torch.nn.Conv3d) and m.kernel_size == (3, 3, 3):
            m.register_forward_hook(lambda m, args, out: planes.append(
                (1 + args[0].requires_grad) * args[0].numel() // args[0].shape[2]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS, weight_decay=0.01)
    for step in range(STEPS):
        planes.clear()
        x, y = _volumes(step, samples)
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], sum(planes) * 4  # fp32


def _spatial(stage: int, offload: bool, spatial: int = 2, dims: tuple[int, ...] = (2,), net: str = "unet3d",
             mics: int = -1) -> tuple:
    import torch.distributed as dist

    import zero
    import zero.spatial as sp

    model = _build(net)
    names = [n for n, _ in model.named_parameters()]
    zc = {"stage": stage, "mics_shard_size": mics, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "spatial_parallel_size": spatial, "spatial_parallel_dims": list(dims),
        "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": EPS, "weight_decay": 0.01}}})
    data_ranks = dist.get_world_size() // spatial
    mine = slice(2 * (dist.get_rank() // spatial), 2 * (dist.get_rank() // spatial) + 2)  # this data rank's samples
    losses = []
    for step in range(STEPS):
        x, y = _volumes(step, 2 * data_ranks)
        out = engine(sp.shard_volume(x[mine]))
        loss = sp.volume_mean((out - sp.shard_volume(y[mine])).square())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = {}
    for name, p in engine.module.named_parameters():
        with zero.GatheredParameters([p]):
            full[name] = p.detach().clone()
    halo = engine.comm_report().get("spatial_halo", {}).get("bytes")
    if mics > 0:  # hybrid sharding: states sharded over the spatial group, replicated across data ranks
        assert engine.replicate is not None and engine.comm.world_size == spatial * mics
        assert "all_reduce (replicas)" in engine.comm_report() or stage < 2
    engine.destroy()
    return [full[n] for n in names], losses, halo


@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), (3, False), (3, True)])
def test_the_unet_trained_over_spatial_ranks_equals_the_unsplit_one(dist_run, stage, offload):
    expected, halo_bytes = _reference()
    for params, losses, halo in dist_run(2, _spatial, stage, offload, timeout=300):
        for p, q in zip(params, expected):
            assert torch.allclose(p, q, rtol=1e-5, atol=2e-5), (stage, (p - q).abs().max().item())  # see EPS
        assert len(set(losses)) == STEPS  # every rank sees the whole volume's loss
        assert halo == halo_bytes, (halo, halo_bytes)  # the comm report's halo bytes: the docs' formula


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_composes_with_spatial_parallelism(dist_run, stage):
    """2 replicas (mics_shard_size 1) of a spatial pair: the states sharded over the pair's 2
    ranks, replicated across the replicas, and the model equals the unsplit one."""
    expected, _ = _reference(4)
    for params, _, _ in dist_run(4, _spatial, stage, False, 2, (2,), "unet3d", 1, timeout=600):
        for p, q in zip(params, expected):
            assert torch.allclose(p, q, rtol=1e-5, atol=2e-5), (stage, (p - q).abs().max().item())


FOUR_RANKS = [(4, 3, True, (2,), "unet3d"), (2, 2, False, (2,), "unet3d"), (4, 1, False, (2, 4), "unet3d"),
              (2, 3, True, (2,), "monai-unet"), (4, 2, False, (2,), "dynunet")]


@pytest.mark.parametrize("spatial, stage, offload, dims, net", FOUR_RANKS)
def test_four_ranks_as_spatial_and_data_ranks_equal_the_unsplit_model(dist_run, spatial, stage, offload, dims, net):
    """4 spatial ranks as slabs or as a 2 x 2 grid (depth x width), or 2 spatial x 2 data-parallel
    ranks (the unsplit model trains on both data ranks' samples at once); MONAI's UNet and DynUNet
    too."""
    if net != "unet3d":
        pytest.importorskip("monai", reason="needs MONAI (pip install monai; part of the test extra)")
    expected, _ = _reference(2 * 4 // spatial, net)
    for params, _, _ in dist_run(4, _spatial, stage, offload, spatial, dims, net, timeout=600):
        for p, q in zip(params, expected):
            assert torch.allclose(p, q, rtol=1e-5, atol=2e-5), (spatial, (p - q).abs().max().item())


def _refused():
    import zero

    out = []
    for config in ({"spatial_parallel_size": 2, "sequence_parallel_size": 2},
                   {"spatial_parallel_size": 2, "spatial_parallel_dims": [2, 2]}):
        try:
            zero.load_config({"train_micro_batch_size_per_gpu": 1, **config}, 4)
        except zero.ConfigError as err:
            out.append(str(err))
    try:
        zero.initialize(model=torch.nn.Sequential(torch.nn.Conv3d(1, 1, 3), torch.nn.Flatten()), config={
            "train_micro_batch_size_per_gpu": 1, "spatial_parallel_size": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except ValueError as err:
        out.append(str(err))
    return out


def test_what_spatial_parallelism_does_not_combine_with_is_refused_by_key(dist_run):
    for out in dist_run(2, _refused):
        assert "spatial_parallel_size: is 2 with pipeline, tensor or sequence parallelism" in out[0]
        assert "spatial_parallel_dims: is [2, 2]: give one to three distinct dimensions" in out[1]
        assert "1 (Flatten) cannot run on a volume split over ranks yet" in out[2]


def _save_then_resume(directory: str) -> list[float]:
    """Train with the volume split over all 4 ranks at stage 3 and save; resume with no split (4
    data ranks) at stage 1, and with 2 spatial x 2 data ranks at stage 2: the same parameters,
    and training goes on."""
    import zero
    import zero.spatial as sp

    def gathered(engine) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in engine.module.named_parameters():
            with zero.GatheredParameters([p]):
                out[name] = p.detach().clone()
        return out

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": EPS}}}
    engine, *_ = zero.initialize(model=_example().UNet3D(width=4, depth=3), config={
        **config, "spatial_parallel_size": 4, "zero_optimization": {"stage": 3}})
    for step in range(2):
        x, y = _volumes(step)
        engine.backward(sp.volume_mean((engine(sp.shard_volume(x)) - sp.shard_volume(y)).square()))
        engine.step()
    engine.save_checkpoint(directory, tag="spatial")
    saved = gathered(engine)
    engine.destroy()
    worst = []
    for spatial, stage in ((1, 1), (2, 2)):
        torch.manual_seed(1)  # other initial values: the checkpoint must replace them
        again, *_ = zero.initialize(model=_example().UNet3D(width=4, depth=3), config={
            **config, "train_micro_batch_size_per_gpu": 1, "spatial_parallel_size": spatial,
            "zero_optimization": {"stage": stage}})
        again.load_checkpoint(directory, tag="spatial")
        worst.append(max((p - saved[name]).abs().max().item() for name, p in gathered(again).items()))
        x, y = _volumes(5, 4)
        i = torch.distributed.get_rank() // spatial
        x, y = x[i:i + 1], y[i:i + 1]
        if spatial > 1:
            x, y = sp.shard_volume(x), sp.shard_volume(y)
        again.backward(sp.volume_mean((again(x) - y).square()) if spatial > 1 else (again(x) - y).square().mean())
        again.step()
        assert again.global_steps == 3
        again.destroy()
    return worst


def test_a_checkpoint_saved_over_4_spatial_ranks_resumes_without_them_and_over_2_at_other_stages(dist_run, tmp_path):
    for worst in dist_run(4, _save_then_resume, str(tmp_path / "ck"), timeout=600):
        assert worst == [0.0, 0.0], worst

"""Spatial parallelism composed with ZeRO (docs/spatial.md): `zero.initialize` with
`spatial_parallel_size` splits each volume over the group, ZeRO partitions over every rank, and
a few AdamW steps of the example 3D U-Net equal the unsplit model trained in one process."""
import importlib.util
from pathlib import Path

import pytest
import torch

STEPS = 3
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


def _volumes(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 1, 12, 4, 8, generator=g), torch.randn(2, 1, 12, 4, 8, generator=g)


def _reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _example().UNet3D(width=4, depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS, weight_decay=0.01)
    for step in range(STEPS):
        x, y = _volumes(step)
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _spatial(stage: int, offload: bool) -> tuple:
    import zero
    import zero.spatial as sp

    torch.manual_seed(0)
    model = _example().UNet3D(width=4, depth=3)
    names = [n for n, _ in model.named_parameters()]
    zc = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "spatial_parallel_size": 2, "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": EPS, "weight_decay": 0.01}}})
    losses = []
    for step in range(STEPS):
        x, y = _volumes(step)
        out = engine(sp.shard_volume(x))
        loss = sp.volume_mean((out - sp.shard_volume(y)).square())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = {}
    for name, p in engine.module.named_parameters():
        with zero.GatheredParameters([p]):
            full[name] = p.detach().clone()
    halo = engine.comm_report() if hasattr(engine, "comm_report") else None
    engine.destroy()
    return [full[n] for n in names], losses, halo is not None


@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), (3, False), (3, True)])
def test_the_unet_trained_over_spatial_ranks_equals_the_unsplit_one(dist_run, stage, offload):
    expected = _reference()
    for params, losses, _ in dist_run(2, _spatial, stage, offload, timeout=300):
        for p, q in zip(params, expected):
            assert torch.allclose(p, q, rtol=1e-5, atol=2e-5), (stage, (p - q).abs().max().item())  # see EPS
        assert len(set(losses)) == STEPS  # every rank sees the whole volume's loss


def _refused():
    import zero

    out = []
    for config in ({"spatial_parallel_size": 2, "sequence_parallel_size": 2},
                   {"spatial_parallel_size": 2, "spatial_parallel_dims": [2, 3]}):
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
        assert "spatial_parallel_dims: is [2, 3]" in out[1]
        assert "1 (Flatten) cannot run on a volume split over ranks yet" in out[2]


def _save_then_resume(directory: str) -> float:
    """Train with the volume split over 2 ranks at stage 2 and save; resume with every rank a data
    rank (no split) at stage 3: the same parameters, and training goes on."""
    import zero
    import zero.spatial as sp

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": EPS}}}
    engine, *_ = zero.initialize(model=_example().UNet3D(width=4, depth=3), config={
        **config, "spatial_parallel_size": 2, "zero_optimization": {"stage": 2}})
    for step in range(2):
        x, y = _volumes(step)
        engine.backward(sp.volume_mean((engine(sp.shard_volume(x)) - sp.shard_volume(y)).square()))
        engine.step()
    engine.save_checkpoint(directory, tag="spatial")
    saved = {}
    for name, p in engine.module.named_parameters():
        with zero.GatheredParameters([p]):
            saved[name] = p.detach().clone()
    engine.destroy()
    torch.manual_seed(1)  # other initial values: the checkpoint must replace them
    again, *_ = zero.initialize(model=_example().UNet3D(width=4, depth=3), config={
        **config, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    again.load_checkpoint(directory, tag="spatial")
    worst = 0.0
    for name, p in again.module.named_parameters():
        with zero.GatheredParameters([p]):
            worst = max(worst, (p.detach() - saved[name]).abs().max().item())
    x, y = _volumes(5)
    rank = torch.distributed.get_rank()
    again.backward((again(x[rank:rank + 1]) - y[rank:rank + 1]).square().mean())
    again.step()
    assert again.global_steps == 3
    again.destroy()
    return worst


def test_a_checkpoint_saved_over_spatial_ranks_resumes_without_them_at_another_stage(dist_run, tmp_path):
    for worst in dist_run(2, _save_then_resume, str(tmp_path / "ck")):
        assert worst == 0.0, worst

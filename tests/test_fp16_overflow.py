"""fp16: an inf gradient on one rank skips the step on every rank and halves the loss scale."""
import pytest
import torch
import torch.distributed as dist

import zero
from zero.testing.models import MLP


def overflow_on_rank_one(stage: int):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
           "zero_optimization": {"stage": stage}}
    engine, *_ = zero.initialize(model=model, config=cfg)
    x, y = torch.randn(4, 13).half(), torch.randn(4, 5).half()
    engine.backward(engine(x, y))
    engine.step()  # a normal step first
    scale_before = engine.optimizer.loss_scaler.scale
    params_before = [p.detach().clone() for p in model.parameters()]
    master_before = [m.clone() for m in engine.optimizer.storage.master]
    loss = engine(x, y)
    if rank == 1:
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
    master_unchanged = all(torch.equal(a, b) for a, b in zip(master_before, engine.optimizer.storage.master))
    # and training goes on normally afterwards
    engine.backward(engine(x, y))
    engine.step()
    moved = not all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
    return (scale_before, engine.optimizer.loss_scaler.scale, engine.skipped_steps, engine.global_steps,
            unchanged, master_unchanged, moved)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_inf_gradient_on_one_rank_skips_the_step_on_all_ranks(dist_run, stage):
    for before, after, skipped, steps, unchanged, master_unchanged, moved in dist_run(2, overflow_on_rank_one, stage):
        assert before == 256.0 and after == 128.0
        assert skipped == 1 and steps == 3
        assert unchanged and master_unchanged  # bitwise
        assert moved


def test_loss_scaler_follows_deepspeed_hysteresis_rules():
    from zero.optim.loss_scale import LossScaler

    s = LossScaler(initial_scale_power=4, window=2, hysteresis=2)
    s.update(overflow=True)
    assert s.scale == 16  # first overflow only spends hysteresis
    s.update(overflow=True)
    assert s.scale == 8
    s.update(overflow=False)
    assert s.scale == 8
    s.update(overflow=False)
    assert s.scale == 16  # two good steps since the last overflow: doubled
    static = LossScaler(static_scale=128.0)
    static.update(overflow=True)
    assert static.scale == 128.0

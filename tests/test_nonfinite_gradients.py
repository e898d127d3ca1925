"""Non-finite and huge gradients: a NaN/inf batch is skipped (and logged) in every precision, a huge
finite gradient is clipped as torch.nn.utils.clip_grad_norm_ would without overflow, fp16 stuck at the minimum loss
scale stops with an error, and a bad learning rate is refused before anything changes."""
import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.optim.loss_scale import NonFiniteGradientError
from zero.testing.training import relative_error


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _clip_in_fp64(params, max_norm: float) -> None:
    """clip_grad_norm_'s rule with the norm summed in fp64: torch sums squares in fp32, so a
    gradient of 1e20 gives it an inf norm and a zero update."""
    grads = [p.grad for p in params]
    norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
    for g in grads:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _config(stage: int, **extra) -> dict:
    zc = {"stage": stage}
    if stage == 3:
        zc.update(stage3_param_persistence_threshold=0, stage3_module_granularity_threshold=50)
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zc, **extra}


def bad_batches_against_torch(stage: int, dtype: str):
    """Step 2 sees a NaN input (skipped: as if that batch never came), step 4 a gradient of
    about 1e20 with clipping at 1.0 (clipped as torch does). The reference is plain torch on
    the full batch, with clip_grad_norm_, that never saw the NaN batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net()
    ref = copy.deepcopy(net)
    extra = {"gradient_clipping": 1.0}
    if dtype == "bf16":
        extra["bf16"] = {"enabled": True}
    engine, *_ = zero.initialize(model=net, config=_config(stage, **extra))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    records = _Records()
    logging.getLogger("zero").addHandler(records)
    g = torch.Generator().manual_seed(0)
    norms = []
    try:
        for step in range(1, 6):
            xs, ys = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
            x, y = xs[4 * rank : 4 * rank + 4], ys[4 * rank : 4 * rank + 4]
            if step == 2 and rank == world - 1:
                x = x.clone()
                x[0, 0] = float("nan") if dtype == "fp32" else float("inf")  # bf16: an inf norm, with clipping on
            scale = 1e20 if step == 4 else 1.0
            engine.backward(F.mse_loss(engine(x.to(engine.module[0].weight.dtype)).float(), y) * scale)
            engine.step()
            norms.append(engine.get_global_grad_norm())
            if step != 2:
                ref_opt.zero_grad()
                (F.mse_loss(ref(xs), ys) * scale).backward()
                _clip_in_fp64(ref.parameters(), 1.0)
                ref_opt.step()
    finally:
        logging.getLogger("zero").removeHandler(records)
    return dict(error=relative_error(net, ref), norms=norms, skipped=engine.skipped_steps,
                steps=engine.global_steps, opt_steps=engine.optimizer.step_count, log=records.messages)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_nan_batch_is_skipped_and_a_huge_gradient_is_clipped(dist_run, stage):
    for rank, r in enumerate(dist_run(2, bad_batches_against_torch, stage, "fp32")):
        assert r["error"] < 1e-5, r["error"]
        assert r["skipped"] == 1 and r["steps"] == 5 and r["opt_steps"] == 4
        assert r["norms"][1] is None
        assert 1e19 < r["norms"][3] < 1e21, r["norms"]  # finite: no fp32 overflow of the squares
        if rank == 0:
            assert len(r["log"]) == 1 and "step 2 skipped" in r["log"][0] and "inf or NaN" in r["log"][0], r["log"]
        else:
            assert r["log"] == []


def test_bf16_skips_an_inf_batch_and_steps_on_a_huge_finite_gradient(dist_run):
    for r in dist_run(2, bad_batches_against_torch, 2, "bf16"):
        assert r["error"] < 2e-2, r["error"]  # bf16 parameters against an fp32 reference
        assert r["skipped"] == 1 and r["opt_steps"] == 4, r


def test_fp16_overflowing_at_the_minimum_scale_stops_with_an_error(caplog):
    net = _net()
    engine, *_ = zero.initialize(model=net, config=_config(2, fp16={
        "enabled": True, "initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1}))
    x, y = torch.randn(4, 8).half(), torch.randn(4, 4).half()
    with caplog.at_level(logging.WARNING, logger="zero"):
        with pytest.raises(NonFiniteGradientError, match=r"step 3: fp16 gradients overflowed at the minimum loss "
                                                         r"scale 1 \(3 steps skipped"):
            for _ in range(10):
                engine.backward((engine(x) - y).float().sum() * float("inf"))
                engine.step()
    assert engine.skipped_steps == 3
    assert [r.getMessage() for r in caplog.records] == [
        "zero: step 1 skipped: fp16 gradients overflowed; loss scale 4 -> 2",
        "zero: step 2 skipped: fp16 gradients overflowed; loss scale 2 -> 1"]


def test_a_nan_learning_rate_is_refused_before_anything_changes():
    net = _net()
    engine, opt, *_ = zero.initialize(model=net, config=_config(2))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    before = [p.detach().clone() for p in net.parameters()]
    opt.param_groups[0]["lr"] = float("nan")  # as a scheduler with gamma=NaN would
    engine.backward(F.mse_loss(engine(x), y))
    with pytest.raises(ValueError, match=r"param group 0 has lr=nan: the learning rate must be a finite number"):
        engine.step()
    assert opt.step_count == 1 and engine.global_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_training_goes_on_after_a_caught_min_scale_error_and_norms_beyond_fp32_are_clipped():
    net = _net()
    engine, *_ = zero.initialize(model=net, config=_config(2, fp16={
        "enabled": True, "initial_scale_power": 1, "hysteresis": 1, "loss_scale_window": 1, "min_loss_scale": 1}))
    x, y = torch.randn(4, 8).half(), torch.randn(4, 4).half()
    with pytest.raises(NonFiniteGradientError):
        for _ in range(3):
            engine.backward((engine(x) - y).float().sum() * float("inf"))
            engine.step()
    for _ in range(3):  # the user caught it and goes on: the scale grows again
        engine.backward(F.mse_loss(engine(x).float(), y.float()))
        engine.step()
    assert engine.optimizer.loss_scaler.scale == 8
    engine.backward((engine(x) - y).float().sum() * float("inf"))  # one overflow above the minimum: a skip
    engine.step()
    assert engine.optimizer.loss_scaler.scale == 4

    big = nn.Linear(100, 100, bias=False)  # each gradient ~1e38: the norm, 1e40, is beyond fp32
    engine, *_ = zero.initialize(model=big, config={**_config(2, gradient_clipping=1.0),
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    before = big.weight.detach().clone()
    engine.backward((big(torch.full((1, 100), 1e19)) * 1e19).sum())
    engine.step()
    assert engine.skipped_steps == 0 and engine.get_global_grad_norm() == pytest.approx(1e40, rel=1e-6)
    assert (big.weight - before).abs().max().item() == pytest.approx(0.1, rel=1e-4)  # Adam's first step: lr

"""ZeRO stage 3 trains like plain single-process PyTorch on the full batch.

Same tolerances as tests/test_stages_match_reference.py: fp32 1e-6 relative for the MLP, 5e-6
for the GPT (Adam eps 1e-6; see [Note: conditioning of the comparison] in
zero/testing/training.py); bf16 losses within 1e-2 and parameters within 5e-2 of the fp32 run.
The test models are split into several units plus persistent small parameters (see STAGE3 in
zero/testing/training.py).
"""
import pytest
import torch
import torch.distributed as dist

import zero
from zero.testing.models import MLP
from zero.testing.training import STAGE3, train_side_by_side

TOLERANCE = {"mlp": dict(tol=1e-6, eps=1e-8), "gpt": dict(tol=5e-6, eps=1e-6)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_stage3_matches_single_process_training_in_fp32(dist_run, world_size, model):
    tol, eps = TOLERANCE[model]["tol"], TOLERANCE[model]["eps"]
    for r in dist_run(world_size, train_side_by_side, model=model, stage=3, eps=eps):
        assert r["error"] < tol, r["error"]
        assert len(r["units"]) >= 3  # really split into units
        for ours, ref in r["losses"]:
            assert abs(ours - ref) <= 1e-6 * abs(ref)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_stage3_bf16_follows_the_fp32_reference(dist_run, model):
    for r in dist_run(3, train_side_by_side, model=model, stage=3, precision="bf16", eps=1e-6):
        for ours, ref in r["losses"]:
            assert abs(ours - ref) <= 1e-2 * abs(ref), r["losses"]
        assert r["error"] < 5e-2, r["error"]


@pytest.mark.parametrize("overlap", [False, True])
def test_stage3_accumulation_and_clipping_match(dist_run, overlap):
    extra = {"overlap_comm": overlap}
    for r in dist_run(2, train_side_by_side, model="mlp", stage=3, accumulation=4, clip=0.05, extra_config=extra):
        assert r["error"] < 1e-6, r["error"]
        assert r["grad_norm"] > 0.05


def stage3_overflow_on_rank_one():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
           "zero_optimization": {"stage": 3, **STAGE3["mlp"]}}
    engine, *_ = zero.initialize(model=model, config=cfg)
    x, y = torch.randn(4, 13).half(), torch.randn(4, 5).half()
    engine.backward(engine(x, y))
    engine.step()
    opt = engine.optimizer
    shards = [u.shard.clone() for u in opt.storage.units]
    masters = [r.master.clone() for u in opt.storage.units for r in u.ranges]
    loss = engine(x, y)
    engine.backward(loss * float("inf") if rank == 1 else loss)
    engine.step()
    unchanged = all(torch.equal(a, u.shard) for a, u in zip(shards, opt.storage.units)) and \
        all(torch.equal(a, r.master) for a, r in zip(masters, (r for u in opt.storage.units for r in u.ranges)))
    return opt.loss_scaler.scale, engine.skipped_steps, unchanged


def test_stage3_fp16_inf_on_one_rank_skips_the_step_everywhere(dist_run):
    for scale, skipped, unchanged in dist_run(2, stage3_overflow_on_rank_one):
        assert scale == 128.0 and skipped == 1 and unchanged


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_stage3_default_config_on_a_small_model_matches(dist_run, model):
    # DeepSpeed's defaults make every parameter of a small model persistent (<= 100k elements)
    defaults = {"stage3_param_persistence_threshold": 100_000, "stage3_module_granularity_threshold": 0}
    for r in dist_run(2, train_side_by_side, model=model, stage=3, eps=1e-6, extra_config=defaults):
        assert r["units"] == ["<persistent>"]
        assert r["error"] < 5e-6, r["error"]
        assert r["grad_norm"] > 0

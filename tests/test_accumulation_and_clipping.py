"""Gradient accumulation equals one big batch; clipping equals torch's clip_grad_norm_."""
import pytest

from zero.testing.training import train_side_by_side


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [1, 3])
def test_four_accumulation_steps_equal_one_big_batch(dist_run, stage, world_size):
    for r in dist_run(world_size, train_side_by_side, model="mlp", stage=stage, accumulation=4):
        assert r["error"] < 1e-6, r["error"]
        assert r["global_steps"] == 5  # 20 micro-steps, 5 updates


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_clipping_equals_torch_clip_grad_norm(dist_run, stage):
    results = dist_run(2, train_side_by_side, model="mlp", stage=stage, clip=0.05)
    for r in results:
        assert r["error"] < 1e-6, r["error"]
        assert r["grad_norm"] > 0.05  # the clip was active
    assert len({r["grad_norm"] for r in results}) == 1  # every rank agrees on the global norm


def test_accumulation_with_bf16_keeps_fp32_gradient_buffers(dist_run):
    for r in dist_run(2, train_side_by_side, model="mlp", stage=2, precision="bf16", accumulation=4):
        # stage 2 with accumulation: fp32 gradient shard (4 bytes) beside bf16 params (2 bytes)
        assert r["memory"]["grads"] >= 4 * r["psi"] / 2

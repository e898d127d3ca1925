"""ZeRO stages 0, 1 and 2 train exactly like plain single-process PyTorch on the full batch.

World sizes 1-4, with parameter counts that do not divide the world size, for an MLP and a small
GPT (tied embeddings). fp32: the MLP matches to 1e-6 relative; the GPT, run with Adam eps=1e-6,
to 5e-6 (see [Note: conditioning of the comparison] in zero/testing/training.py; its gradients
are checked at 1e-6 in tests/test_gradient_shards.py). bf16 is compared with the fp32 reference:
losses within 1e-2 relative, parameters within 5e-2 of each tensor's largest element.
"""
import pytest

from zero.testing.training import train_side_by_side

TOLERANCE = {"mlp": dict(tol=1e-6, eps=1e-8), "gpt": dict(tol=5e-6, eps=1e-6)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_stage_matches_single_process_training_in_fp32(dist_run, world_size, stage, model):
    tol, eps = TOLERANCE[model]["tol"], TOLERANCE[model]["eps"]
    for r in dist_run(world_size, train_side_by_side, model=model, stage=stage, eps=eps):
        assert r["error"] < tol, r["error"]
        assert r["global_steps"] == 5
        for ours, ref in r["losses"]:
            assert abs(ours - ref) <= 1e-6 * abs(ref)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_bf16_training_follows_the_fp32_reference(dist_run, stage, model):
    for r in dist_run(3, train_side_by_side, model=model, stage=stage, precision="bf16", eps=1e-6):
        for ours, ref in r["losses"]:
            assert abs(ours - ref) <= 1e-2 * abs(ref), r["losses"]
        assert r["error"] < 5e-2, r["error"]


@pytest.mark.parametrize("stage", [1, 2])
def test_adam_with_l2_weight_decay_matches_torch_adam(dist_run, stage):
    for r in dist_run(3, train_side_by_side, model="mlp", stage=stage, adamw=False, weight_decay=0.1):
        assert r["error"] < 1e-6, r["error"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("reduce_scatter", [True, False])
def test_stage2_comm_options_do_not_change_the_result(dist_run, overlap, reduce_scatter):
    extra = {"overlap_comm": overlap, "reduce_scatter": reduce_scatter}
    for r in dist_run(2, train_side_by_side, model="gpt", stage=2, eps=1e-6, extra_config=extra):
        assert r["error"] < 5e-6, r["error"]

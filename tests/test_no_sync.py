"""no_sync(): backward passes inside accumulate locally (stages 0/1); step() inside is an error,
as in DeepSpeed, because the gradients it would apply were never reduced across ranks."""
import pytest
import torch

import zero
from zero.testing.training import build_model, make_batch


def step_inside_and_outside_no_sync(stage: int):
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=build_model("mlp"), config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": stage}})
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    with engine.no_sync():
        engine.backward(engine(*make_batch("mlp", 4, g)))
        try:
            engine.step()
            inside = "no error"
        except RuntimeError as exc:
            inside = str(exc)
    engine.step()  # the first micro-step, outside: fine
    engine.backward(engine(*make_batch("mlp", 4, g)))
    engine.step()
    return inside, engine.global_steps, [p.detach().sum().item() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 1])
def test_step_inside_no_sync_is_an_error_and_ranks_stay_identical(dist_run, stage):
    results = dist_run(2, step_inside_and_outside_no_sync, stage)
    for inside, steps, _ in results:
        assert "inside no_sync()" in inside and "diverge" in inside
        assert steps == 1
    assert results[0][2] == results[1][2]  # both ranks applied the same (reduced) update


def test_no_sync_is_refused_with_partitioned_gradients():
    engine, *_ = zero.initialize(model=build_model("mlp"), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}})
    with pytest.raises(RuntimeError, match="stage 2"):
        with engine.no_sync():
            pass

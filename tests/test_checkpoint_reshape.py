"""A checkpoint loads at another world size, stage and offload setting, with no conversion step,
and training goes on as if nothing had changed: equal to one unbroken single-process run."""

import torch
import torch.distributed as dist

import zero
from zero.testing.training import build_model, make_batch, relative_error

GLOBAL_BATCH, STEPS = 12, 4
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}


def _batch(step: int):
    return make_batch("mlp", GLOBAL_BATCH, torch.Generator().manual_seed(step))


def _engine(stage: int, offload: bool = False):
    world = dist.get_world_size() if dist.is_initialized() else 1
    zc = {"stage": stage}
    if stage == 3:
        zc.update(stage3_param_persistence_threshold=20, stage3_module_granularity_threshold=300)
    if offload:
        zc["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=build_model("mlp"), config={
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": zc})
    return engine


def _train(engine, first: int, last: int) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    m = GLOBAL_BATCH // world
    for step in range(first, last):
        x, y = _batch(step)
        engine.backward(engine(x[rank * m : (rank + 1) * m], y[rank * m : (rank + 1) * m]))
        engine.step()


def _reference():
    torch.manual_seed(0)
    model = build_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(2 * STEPS):
        opt.zero_grad()
        model(*_batch(step)).backward()
        opt.step()
    return model


def first_half(stage: int, path: str, offload: bool = False) -> None:
    engine = _engine(stage, offload)
    _train(engine, 0, STEPS)
    engine.save_checkpoint(path)


def second_half(stage: int, path: str, offload: bool = False) -> float:
    engine = _engine(stage, offload)
    engine.load_checkpoint(path)
    assert engine.global_steps == STEPS
    _train(engine, STEPS, 2 * STEPS)
    reference = _reference()
    return relative_error(engine.module, reference)


def test_a_world_4_stage_3_checkpoint_continues_at_1_2_3_ranks_and_stages_1_2(dist_run, tmp_path):
    dist_run(4, first_half, 3, str(tmp_path / "w4s3"))
    errors = {(1, 2): second_half(2, str(tmp_path / "w4s3"))}
    for world, stage in ((2, 1), (2, 2), (3, 3), (3, 1)):
        errors[(world, stage)] = max(dist_run(world, second_half, stage, str(tmp_path / "w4s3")))
    assert all(e < 1e-5 for e in errors.values()), errors


def test_a_world_2_stage_1_checkpoint_continues_at_3_ranks_stage_3_with_offload(dist_run, tmp_path):
    dist_run(2, first_half, 1, str(tmp_path / "w2s1"))
    errors = dist_run(3, second_half, 3, str(tmp_path / "w2s1"), True)
    assert max(errors) < 1e-5, errors

"""Checkpoints of hybrid sharding (zero_optimization.mics_shard_size: states sharded over groups of
2 ranks, replicated across the groups; the first replica writes): saved on 2 x 2 ranks, they resume
in flat ZeRO-3 on 4, hybrid on 2 (one group), stage 1 with optimizer offload on 2, and hybrid at
stage 2 on 4, and the next steps equal the unbroken run."""
import pytest
import torch
import torch.distributed as dist

import zero
from zero.testing.training import STAGE3, build_model, make_batch

GLOBAL_BATCH, STEPS = 8, 3


def _engine(stage: int, shard: int = -1, offload: bool = False):
    world = dist.get_world_size()
    zc = {"stage": stage, "mics_shard_size": shard, "reduce_bucket_size": 500, **(STAGE3["mlp"] if stage == 3 else {}),
          **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=build_model("mlp"), config={
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}})
    return engine


def _train(engine, first: int, last: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // world
    for step in range(first, last):
        x, y = make_batch("mlp", GLOBAL_BATCH, torch.Generator().manual_seed(step))
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()


def _params(engine) -> list[torch.Tensor]:
    with zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def save(path: str, unbroken: bool) -> list[torch.Tensor] | None:
    engine = _engine(3, shard=2)
    assert engine.replicate is not None and engine.comm.world_size == 2
    _train(engine, 0, STEPS)
    engine.save_checkpoint(path, tag="half")
    if unbroken:
        _train(engine, STEPS, 2 * STEPS)
        return _params(engine)
    return None


def resume(path: str, stage: int, shard: int, offload: bool) -> list[torch.Tensor]:
    engine = _engine(stage, shard, offload)
    engine.load_checkpoint(path, tag="half")
    _train(engine, STEPS, 2 * STEPS)
    return _params(engine)


def test_hybrid_checkpoints_resume_in_every_layout(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    unbroken = dist_run(4, save, path, True)[0]
    for world, stage, shard, offload in ((4, 3, -1, False), (2, 3, 2, False), (2, 1, -1, True), (4, 2, 2, False)):
        got = dist_run(world, resume, path, stage, shard, offload)[0]
        # one global batch, summed in another order on another layout: fp32 round-off
        assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(got, unbroken)), (world, stage, shard)


def _hpz_resume(path: str, offload: bool) -> dict:
    """hpZ (secondary shards inside each node of 2 ranks) with and without optimizer offload: a
    checkpoint loaded into a fresh engine, and into the running engine after it trained on, gives
    the unbroken run's next steps (DeepSpeed's stale secondary copy after a load, #7606; hpZ with
    CPU offload, #6926)."""
    import os

    os.environ["GROUP_RANK"] = str(dist.get_rank() // 2)  # ranks 0-1 on node 0, 2-3 on node 1
    try:
        def make():
            world = dist.get_world_size()
            zc = {"stage": 3, "zero_hpz_partition_size": 2, "reduce_bucket_size": 500, **STAGE3["mlp"],
                  "stage3_max_reuse_distance": 0,  # backward gathers again: from the secondary shards
                  **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
            torch.manual_seed(0)
            return zero.initialize(model=build_model("mlp"), config={
                "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "zero_optimization": zc,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}})[0]

        engine = make()
        _train(engine, 0, STEPS)
        engine.save_checkpoint(path, tag="hpz")
        _train(engine, STEPS, 2 * STEPS)
        unbroken = _params(engine)
        engine.load_checkpoint(path, tag="hpz")  # into the running engine, which trained past it
        _train(engine, STEPS, 2 * STEPS)
        running = _params(engine)
        fresh = make()
        fresh.load_checkpoint(path, tag="hpz")
        _train(fresh, STEPS, 2 * STEPS)
        hpz = fresh.comm_report().get("all_gather (hpZ)", {}).get("calls", 0)
        return {"running": all(torch.equal(p, q) for p, q in zip(running, unbroken)),
                "fresh": all(torch.equal(p, q) for p, q in zip(_params(fresh), unbroken)), "hpz_gathers": hpz}
    finally:
        os.environ.pop("GROUP_RANK")




@pytest.mark.parametrize("offload", [False, True])
def test_hpz_resumes_bit_for_bit_into_a_fresh_and_a_running_engine(dist_run, tmp_path, offload):
    for r in dist_run(4, _hpz_resume, str(tmp_path / "ckpt"), offload):
        assert r["running"] and r["fresh"], r
        assert r["hpz_gathers"] > 0  # backward did gather from the secondary shards

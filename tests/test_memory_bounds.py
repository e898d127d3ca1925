"""Memory the engine holds beyond its model states is bounded, measured at the allocator:
construction never holds a second copy of the model, and reduce buffers in flight stay within
the bound of [Note: gradient readiness] (zero/stages/readiness.py)."""
import pytest
import torch
import torch.nn as nn

import zero
from zero.probes import AllocatorPeak
from zero.testing.models import GPT, GPTConfig

WIDTH = 256


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])


def construction_peak(stage: int):
    model = mlp()
    largest_fp32 = max(p.numel() for p in model.parameters()) * 4
    zc = {"stage": stage, "stage3_module_granularity_threshold": WIDTH * WIDTH,
          "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage, "reduce_bucket_size": 3 * WIDTH * WIDTH}
    # stage 3: one unit per layer, none gathered at construction
    with AllocatorPeak() as mem:
        engine, *_ = zero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
            "zero_optimization": zc})
    return mem.peak, mem.end, largest_fp32, engine.memory_report()["model_states_total"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_construction_holds_at_most_the_final_state_plus_one_fp32_parameter(dist_run, stage):
    for peak, end, largest_fp32, states in dist_run(2, construction_peak, stage):
        assert end >= states  # what it keeps is (at least) its model states, measured
        assert peak <= end + largest_fp32 + (64 << 10), ((peak - end) / largest_fp32)


def reduce_buffer_peak(stage: int, bucket: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=6, n_head=2, n_embd=32))
    total = sum(p.numel() for p in model.parameters()) * 4  # the whole gradient in fp32
    zc = {"stage": stage, "overlap_comm": True, **({"reduce_bucket_size": bucket} if stage == 2 else {
          "stage3_module_granularity_threshold": 5000, "stage3_param_persistence_threshold": 0})}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": zc})
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        idx = torch.randint(0, 64, (2, 9), generator=g)
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    opt = engine.optimizer
    if stage == 3:  # a unit's send buffer: N x its trainable shard, fp32
        groups = [u.trainable_numel * opt.comm.world_size * 4 for u in opt.storage.units if u.trainable]
    else:  # a bucket's staging buffer, fp32
        groups = [b.numel * 4 for b in opt.storage.layout.buckets]
    return engine.memory_report()["reduce_buffers_peak"], sorted(groups), total


@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_buffers_in_flight_stay_within_the_bound(dist_run, stage):
    for peak, groups, total in dist_run(2, reduce_buffer_peak, stage, 4000):
        assert len(groups) > 4  # many buckets or units, so a bound matters
        # at most two reductions in flight, plus (stage 2) the bucket being filled
        bound = sum(groups[-3:]) if stage == 2 else sum(groups[-2:])
        assert 0 < peak <= bound, (peak, groups)
        assert peak < total / 2  # far from a whole unsharded gradient

"""memory_report() follows the ZeRO paper's formulas; comm_report() counts Psi per collective."""
import pytest
import torch
import torch.distributed as dist

import zero
from zero.partition.layout import ALIGN
from zero.testing.training import build_model, make_batch

# bytes per parameter, mixed precision (bf16) with one micro-batch per step, Psi params, N ranks
FORMULA = {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 4 * psi + 12 * psi / n, 2: lambda psi, n: 2 * psi + 14 * psi / n}


def one_bf16_step(stage: int):
    torch.manual_seed(0)
    net = build_model("gpt")
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}}
    engine, *_ = zero.initialize(model=net, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    engine.backward(engine(*make_batch("gpt", 2, g)))
    engine.step()
    layout = engine.optimizer.storage.layout
    return engine.memory_report(), engine.comm_report(), layout.param_numel, layout.numel, len(layout.buckets)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
def test_model_state_bytes_per_rank_follow_the_zero_formulas(dist_run, stage, world_size):
    for memory, _, psi, padded, n_buckets in dist_run(world_size, one_bf16_step, stage):
        want = FORMULA[stage](psi, world_size)
        padding_bytes = 16 * (padded - psi)
        assert padded - psi < n_buckets * world_size * ALIGN
        assert abs(memory["model_states_total"] - want) <= padding_bytes, (memory, want)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage2_moves_psi_reduce_scattered_and_psi_all_gathered_per_step(dist_run, world_size):
    for _, comm, psi, padded, n_buckets in dist_run(world_size, one_bf16_step, 2):
        assert comm["reduce_scatter"]["elements"] == padded and comm["reduce_scatter"]["calls"] == n_buckets
        assert comm["all_gather"]["elements"] == padded and comm["all_gather"]["calls"] == n_buckets
        assert padded - psi < n_buckets * world_size * ALIGN
        assert comm["reduce_scatter"]["bytes"] == 2 * padded  # bf16 on the wire
        assert comm["all_reduce_sum"]["elements"] == 1  # the global gradient norm, nothing else

"""Stage 3 on a CUDA GPU, measured at the allocator phase by phase (as FSDP2's memory tests do).

One GPU, a world of one, parameter and optimizer offload: the shards live on the host, so every
layer the GPU holds was gathered onto it and must be freed again. Skipped where no CUDA GPU is.
"""
import gc

import pytest
import torch
import torch.nn as nn

import zero
from zero.probes import AllocatorPeak, SavedTensorProbe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WIDTH, LAYERS = 4096, 8
LAYER_BYTES = WIDTH * WIDTH * 2  # bf16 weight
SLACK = 8 << 20  # activations at batch 4 and the biases, and the allocator's rounding


@pytest.mark.parametrize("extra", [
    {"stage3_max_live_parameters": 2 * WIDTH * WIDTH},
    {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1},
], ids=["cap-two-layers", "no-reuse"])
def test_stage3_with_offload_holds_at_most_two_layers_on_the_gpu(extra):
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])  # on the host
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}, **extra}}
    with AllocatorPeak("cuda") as init:
        engine, *_ = zero.initialize(model=model, config=cfg)
    # construction: beyond what it keeps, at most one fp32 layer in flight, never a copy of the model
    assert init.peak - init.end <= 2 * LAYER_BYTES + SLACK, (init.peak - init.end) / LAYER_BYTES
    x = torch.randn(4, WIDTH, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        with AllocatorPeak("cuda") as fwd, SavedTensorProbe() as probe:
            loss = engine(x).float().square().mean()
        held = probe.held_bytes(extra=[p.data for p in model.parameters()])
        with AllocatorPeak("cuda") as bwd:
            engine.backward(loss)
        with AllocatorPeak("cuda") as step:
            engine.step()
        assert held <= 2 * LAYER_BYTES + SLACK, held / LAYER_BYTES
        assert fwd.peak <= 3 * LAYER_BYTES + SLACK, fwd.peak / LAYER_BYTES  # two layers + one landing
        # backward: a gathered layer, its gradient, the reduce buffer, and one layer prefetched
        assert bwd.peak <= 5 * LAYER_BYTES + SLACK, bwd.peak / LAYER_BYTES
        assert step.end <= SLACK, step.end / LAYER_BYTES  # nothing stays on the GPU after the step
    report = engine.memory_report()
    assert report["gathered_peak"] <= 2 * LAYER_BYTES and report["gathered_bytes"] == 0

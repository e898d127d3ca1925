"""ZeRO-Offload on a CUDA GPU: the same equivalence as on the CPU, and the device memory it saves.
Skipped (with the reason) where no CUDA GPU is present; run on a GPU machine."""
import copy

import pytest
import torch

import zero
from zero.testing.models import GPT, GPTConfig
from zero.testing.state import shard_state

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              # a native Adam (fused CUDA, CPU) that failed to build would make both runs torch's
              # Adam and every comparison pass without testing the kernels
              pytest.mark.filterwarnings("error:.*native op '(cpu_adam|fused_adam)' is unavailable")]


def gpt(n_embd: int = 64, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd))


def batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 512, (n, 65), generator=g)
    return idx[:, :-1].cuda(), idx[:, 1:].cuda()


def config(stage: int, offload: dict, precision: str = "bf16") -> dict:
    return {"train_micro_batch_size_per_gpu": 4, precision: {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_module_granularity_threshold": 10_000, **offload}}


OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFFLOAD_BOTH = {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}}


@pytest.mark.parametrize("stage,offload", [(2, OFFLOAD_OPT), (3, OFFLOAD_OPT), (3, OFFLOAD_BOTH)])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offloaded_run_equals_the_device_run_on_cuda(stage, offload, precision):
    base = gpt()
    plain = zero.initialize(model=copy.deepcopy(base), config=config(stage, {}, precision))[0]
    offloaded = zero.initialize(model=copy.deepcopy(base), config=config(stage, offload, precision))[0]
    for step in range(5):
        for engine in (plain, offloaded):
            engine.backward(engine(*batch(step)))
            engine.step()
    a, b = shard_state(plain.optimizer), shard_state(offloaded.optimizer)
    for x, y in zip(a, b):  # CPU and CUDA Adam differ only by rounding of fused multiply-adds
        torch.testing.assert_close(x["master"], y["master"], rtol=1e-5, atol=1e-6)
    assert offloaded.memory_report()["host_bytes"] > 0


def model_state_bytes_on_device(offload: dict) -> tuple[int, int]:
    import gc

    gc.collect()  # an earlier engine lives in reference cycles: free it before measuring
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = gpt(n_embd=512, n_layer=4)  # built on the host; the engine moves it one parameter at a time
    psi = sum(p.numel() for p in model.parameters())
    cfg = config(2, offload)
    cfg["zero_optimization"]["reduce_bucket_size"] = psi // 8  # staging buffers are per bucket and freed after use
    engine = zero.initialize(model=model, config=cfg)[0]
    engine.backward(engine(*batch(0, n=1)))
    engine.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - before
    del engine, model
    gc.collect()
    return after, psi


def test_stage2_with_optimizer_offload_keeps_about_4_psi_on_the_device():
    on_device, psi = model_state_bytes_on_device({})
    offloaded, _ = model_state_bytes_on_device(OFFLOAD_OPT)
    # one GPU: 16 Psi without offload; 2 Psi params + 2 Psi gradients with the optimizer on the host
    assert on_device > 14 * psi
    assert offloaded < 5 * psi, (offloaded / psi)

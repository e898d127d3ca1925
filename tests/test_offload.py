"""ZeRO-Offload on this CPU machine: a distinct path (host optimizer state, staging buffers, real
copies) that must give the same numbers as the non-offloaded run and as plain PyTorch."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

import zero
from zero.offload.host import cpu_adam_threads
from zero.testing.state import load_shard_state, shard_state
from zero.testing.training import STAGE3, build_model, make_batch, train_side_by_side

OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFFLOAD_BOTH = {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}}
CASES = [(1, OFFLOAD_OPT), (2, OFFLOAD_OPT), (3, OFFLOAD_OPT), (3, OFFLOAD_BOTH)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage,offload", CASES, ids=["s1-opt", "s2-opt", "s3-opt", "s3-opt+param"])
def test_offloaded_training_matches_the_single_process_reference(dist_run, world_size, stage, offload):
    for r in dist_run(world_size, train_side_by_side, model="mlp", stage=stage, extra_config=offload):
        assert r["error"] < 1e-6, r["error"]
        assert r["memory"]["host_bytes"] > 0


def twin_runs(stage: int, offload: dict, precision: str, steps: int = 5, accumulation: int = 2):
    """Train the same model with and without offload side by side; return how they differ."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = build_model("gpt")
    engines = []
    for extra in ({}, offload):
        zc = {"stage": stage, **(STAGE3["gpt"] if stage == 3 else {"reduce_bucket_size": 2000}), **extra}
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "zero_optimization": zc}
        if precision == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
        elif precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engines.append(zero.initialize(model=copy.deepcopy(base), config=cfg)[0])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps * accumulation):
        batches = [make_batch("gpt", 2, g) for _ in range(world)]
        for engine in engines:
            engine.backward(engine(*batches[rank]))
            engine.step()
    plain, offloaded = engines
    states = [shard_state(e.optimizer) for e in engines]
    same_state = all(torch.equal(a[k], b[k]) for a, b in zip(*states) for k in ("master", "exp_avg", "exp_avg_sq"))
    with zero.GatheredParameters(list(plain.module.parameters())), zero.GatheredParameters(list(offloaded.module.parameters())):
        same_params = all(torch.equal(a, b) for a, b in zip(plain.module.parameters(), offloaded.module.parameters()))
    return same_params, same_state, offloaded.optimizer.loss_scaler.scale == plain.optimizer.loss_scaler.scale


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage,offload", CASES, ids=["s1-opt", "s2-opt", "s3-opt", "s3-opt+param"])
def test_offloaded_run_is_bitwise_the_non_offloaded_run(dist_run, stage, offload, precision):
    # the same kernels on the same numbers: offload moves where they run, not what they compute
    for same_params, same_state, same_scale in dist_run(2, twin_runs, stage, offload, precision):
        assert same_params and same_state and same_scale


def swap_state_between_twins(stage: int):
    """Optimizer state taken from an offloaded run continues a non-offloaded one, and back."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = build_model("mlp")
    engines = []
    for extra in ({}, OFFLOAD_OPT):
        zc = {"stage": stage, **(STAGE3["mlp"] if stage == 3 else {}), **extra}
        cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": zc}
        engines.append(zero.initialize(model=copy.deepcopy(base), config=cfg)[0])
    plain, offloaded = engines
    g = torch.Generator().manual_seed(rank)
    batches = [make_batch("mlp", 4, g) for _ in range(6)]
    for x, y in batches[:3]:  # train only the offloaded one
        offloaded.backward(offloaded(x, y))
        offloaded.step()
    load_shard_state(plain.optimizer, shard_state(offloaded.optimizer))
    for x, y in batches[3:]:  # now both continue from the same state
        for e in engines:
            e.backward(e(x, y))
            e.step()
    back = shard_state(offloaded.optimizer)
    load_shard_state(offloaded.optimizer, shard_state(plain.optimizer))
    return all(torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
               for a, b in zip(back, shard_state(plain.optimizer)))


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_state_moves_between_offloaded_and_device_runs(dist_run, stage):
    assert all(dist_run(2, swap_state_between_twins, stage))


def memory_split(stage: int, offload: dict):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": stage, **(STAGE3["gpt"] if stage == 3 else {}), **offload}}
    engine, *_ = zero.initialize(model=build_model("gpt"), config=cfg)
    engine.backward(engine(*make_batch("gpt", 2, torch.Generator().manual_seed(0))))
    engine.step()
    return engine.memory_report(), sum(p.numel() for p in engine.optimizer.params) if stage < 3 else \
        sum(p._zero.numel for p in engine.optimizer.params)


def test_memory_report_separates_device_and_host_bytes(dist_run):
    n = 2
    (m, psi), _ = dist_run(n, memory_split, 2, OFFLOAD_OPT)
    # stage 2 + optimizer offload: 16-bit params and gradient shard on the device; fp32 master,
    # m and v (12 Psi/N) plus the 16-bit gradient staging on the host
    assert m["device_bytes"] == m["params"] + m["grads"] + m["reduce_buffers"]
    assert m["host_bytes"] == m["fp32_master"] + m["optimizer_states"] + m["host_staging"]
    assert abs(m["fp32_master"] + m["optimizer_states"] - 12 * psi / n) < 12 * 16 * n
    (m3, psi3), _ = dist_run(n, memory_split, 3, OFFLOAD_BOTH)
    assert m3["host_bytes"] > m3["device_bytes"]  # with parameter offload, shards live on the host too


def test_cpu_adam_threads_split_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.delenv("ZERO_CPU_ADAM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_adam_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))
    assert cpu_adam_threads() == 1
    monkeypatch.setenv("ZERO_CPU_ADAM_THREADS", "3")
    assert cpu_adam_threads() == 3


def test_refused_page_locking_falls_back_and_clears_the_cuda_error(monkeypatch):
    """HostMemory.empty on a CUDA machine whose cudaHostRegister is refused (host memory short,
    a sandbox): the runtime's last error is cleared (torch's cudart binding has no
    cudaGetLastError), then torch's pinned allocator is tried, then pageable memory with a
    warning. Simulated here: the CUDA calls are stand-ins."""
    import zero.offload.host as offload

    cleared = []

    class Refusing:
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(offload, "_clear_cuda_error", lambda: cleared.append(1))
    monkeypatch.setattr(torch, "empty", empty)
    class Owner:
        pass

    owner = Owner()
    with pytest.warns(UserWarning, match="could not be page-locked"):
        t = offload.HostMemory(owner).empty((4, 3), torch.float32)
    assert t.shape == (4, 3) and t.device.type == "cpu" and len(cleared) == 2

"""NVMe offload (zero/offload/nvme.py, zero/ops/aio.py): the optimizer state in swap files gives the
numbers of CPU offload bit for bit, checkpoints move between the two at any world size, and every
way a file can fail is a clear error that names it."""
import errno
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist

import zero
from zero.ops import aio as aio_mod
from zero.ops.aio import ALIGNMENT, AsyncIO, DataFile, aligned_empty
from zero.ops.builder import OpUnavailable
from zero.testing.state import shard_state
from zero.testing.training import STAGE3, build_model, make_batch


def _nvme(path, **extra) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": 2, **extra}


# -- the aio op ---------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "python-threads"])
def test_aio_reads_back_what_it_wrote_aligned_unaligned_and_in_a_tail(tmp_path, monkeypatch, native):
    if not native:  # the fallback where the op cannot be built
        monkeypatch.setattr(aio_mod, "load", lambda name: (_ for _ in ()).throw(OpUnavailable("no C compiler")))
    io = AsyncIO(threads=2, queue_depth=3, block_size=8192)
    assert io.native is native
    n = 5 * ALIGNMENT * 7 + 123  # many blocks, a tail that is not a whole block
    f = DataFile.create(tmp_path / "f.bin", n + ALIGNMENT)
    data = aligned_empty(n).random_(0, 255, generator=torch.Generator().manual_seed(0))
    io.write(f, data, 0).wait()
    back = aligned_empty(n).zero_()
    io.read(f, back, 0).wait()
    assert torch.equal(back, data)
    odd = aligned_empty(3000)[7:2907].fill_(9)  # unaligned address, offset and length: buffered
    io.write(f, odd, 4099).wait()
    again = torch.zeros(2900, dtype=torch.uint8)
    io.read(f, again, 4099).wait()
    assert torch.equal(again, odd)
    if native and f.fd_direct >= 0:  # a filesystem with O_DIRECT: the aligned blocks went direct
        assert io.stats()["direct_bytes"] >= 2 * (n // ALIGNMENT * ALIGNMENT - 8192)
    # a read past the end: short, then nothing; the error names the file and where it stopped
    with pytest.raises(OSError, match=rf"reading 100 bytes at offset {n + ALIGNMENT - 50} of .*f\.bin: the file ends at {n + ALIGNMENT}"):
        io.read(f, torch.empty(100, dtype=torch.uint8), n + ALIGNMENT - 50).wait()
    io.close()


def test_aio_on_tmpfs_and_a_file_size_limit_reached_mid_write(tmp_path):
    io = AsyncIO(threads=1, queue_depth=2, block_size=4096)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    f = DataFile.create(os.path.join(shm, f"zero-test-{os.getpid()}.bin"), 3 * ALIGNMENT)
    try:
        data = aligned_empty(3 * ALIGNMENT).fill_(3)
        io.write(f, data, 0).wait()
        back = aligned_empty(3 * ALIGNMENT)
        io.read(f, back, 0).wait()
        assert torch.equal(back, data)
    finally:
        os.unlink(f.path)
    # the kernel's file size limit (as a full filesystem would refuse): EFBIG, named, the earlier bytes intact
    g = DataFile.create(tmp_path / "g.bin", 4 * ALIGNMENT)
    io.write(g, aligned_empty(4 * ALIGNMENT).fill_(1), 0).wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * ALIGNMENT, hard))
    try:
        with pytest.raises(OSError, match=r"writing 16384 bytes at offset 0 of .*g\.bin failed at offset 8192: File too large"):
            io.write(g, aligned_empty(4 * ALIGNMENT).fill_(2), 0).wait()
        with pytest.raises(OSError, match=r"reserving .* of .*h\.bin failed: File too large") as info:
            DataFile.create(tmp_path / "h.bin", 4 * ALIGNMENT)
        assert info.value.errno == errno.EFBIG
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    back = aligned_empty(4 * ALIGNMENT)
    io.read(g, back, 0).wait()
    assert back[2 * ALIGNMENT:].eq(1).all()  # what lay beyond the limit was never touched
    io.close()


# -- training: bit for bit against CPU offload --------------------------------------------------

CASES = [  # (stage, precision, optimizer, state format and where the parameter shards are)
    (1, "fp32", "AdamW", {}), (1, "bf16", "Lion", {}),
    (2, "fp32", "AdamW", {}), (2, "bf16", "AdamW", {"state_dtype": "int8"}),
    (3, "fp32", "AdamW", {}), (3, "bf16", "AdamW", {"state_dtype": "int8", "master": "bf16"}),
    # stage-3 parameter shards on NVMe too (against shards in host memory), with the optimizer
    # state on NVMe, and with it in host memory (the twin's own CPU offload)
    (3, "fp32", "AdamW", {"params": "nvme"}), (3, "bf16", "AdamW", {"state_dtype": "int8", "params": "nvme",
                                                                   "optimizer": "cpu"}),
]


def _config(stage: int, precision: str, optimizer: str, fmt: dict, offload: dict, params: dict | None = None) -> dict:
    zc = {"stage": stage, "sub_group_size": 1024, **(STAGE3["gpt"] if stage == 3 else {"reduce_bucket_size": 2000}),
          "offload_optimizer": offload, **({"offload_param": params} if params else {})}
    params = {"lr": 1e-3, "weight_decay": 0.01, **({"state_dtype": fmt["state_dtype"]} if "state_dtype" in fmt else {})}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": zc,
           "optimizer": {"type": optimizer, "params": params}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True, **({"bf16_master_weights_and_grads": True} if fmt.get("master") else {})}
    return cfg


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def nvme_twins(path: str) -> list[tuple]:
    import copy

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, precision, optimizer, fmt in CASES:
        torch.manual_seed(0)
        base = build_model("gpt")
        twins = [({"device": "cpu"}, None), (_nvme(path), None)]
        if fmt.get("params"):  # max_in_cpu 0: every unit but the persistent parameters on disk
            twins = [({"device": "cpu"}, {"device": "cpu"}),
                     ({"device": "cpu"} if fmt.get("optimizer") == "cpu" else _nvme(path), _nvme(path, max_in_cpu=0))]
        engines = [zero.initialize(model=copy.deepcopy(base), config=_config(stage, precision, optimizer, fmt, *twin))[0]
                   for twin in twins]
        g = torch.Generator().manual_seed(1)
        for _ in range(5 * 2):
            batches = [make_batch("gpt", 2, g) for _ in range(world)]
            for engine in engines:
                engine.backward(engine(*batches[rank]))
                engine.step()
        cpu, nvme = engines
        a, b = shard_state(cpu.optimizer), shard_state(nvme.optimizer)
        same_state = len(a) == len(b) and all(x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
                                              for x, y in zip(a, b))
        with zero.GatheredParameters(list(cpu.module.parameters())), \
                zero.GatheredParameters(list(nvme.module.parameters())):
            same_params = all(torch.equal(p, q) for p, q in zip(cpu.module.parameters(), nvme.module.parameters()))
        store, swap = nvme.optimizer.storage.store, getattr(nvme.optimizer.storage, "swap", None)
        report = nvme.memory_report()
        states = report["fp32_master"] + report["optimizer_states"] if store.policy.on_disk else 0
        moved = store.bytes["read"] > 0 and store.bytes["read"] == store.bytes["written"] if store.policy.on_disk \
            else True
        if swap is not None:  # every shard but the persistent one on disk, read ahead but for the first pass
            units = nvme.optimizer.storage.units
            shards = sum(u.shard.untyped_storage().nbytes() for u in units if u.swap is not None)
            states += shards
            moved = moved and [u.persistent for u in units if u.swap is None] == [True] and \
                swap.reads["ahead"] > 3 * swap.reads["on_demand"] > 0 and swap.reads["extra_buffers"] == 0 and \
                swap.bytes["written"] == 10 // 2 * shards_raw(units)  # each step wrote every shard with the aio op
        host = report["host_bytes"] - report["host_staging"]  # the states left; their buffers came
        twin = cpu.memory_report()
        on_disk = report["disk_bytes"] == states > 0 and host < twin["host_bytes"] - twin["host_staging"] + \
            report["nvme_buffers"]
        out.append((stage, precision, optimizer, same_params, same_state, moved, on_disk,
                    (swap or store).swap.io.stats()))
        for engine in engines:
            engine.destroy()
    return out


def shards_raw(units) -> int:
    return sum(u.shard.numel() * u.shard.element_size() for u in units if u.swap is not None)


def test_nvme_offload_is_bitwise_cpu_offload_at_every_stage_precision_and_state_format(dist_run, tmp_path):
    """2 ranks, accumulation 2, 5 steps, tiles of 1024 elements in 2 buffers (reads ahead, writes
    behind, buffers reused): the same parameters and optimizer state, bit for bit, as CPU offload;
    stage-3 parameter shards on NVMe the same as in host memory."""
    for results in dist_run(2, nvme_twins, str(tmp_path)):
        for stage, precision, optimizer, same_params, same_state, moved, on_disk, _stats in results:
            case = f"stage {stage} {precision} {optimizer}"
            assert same_params and same_state, case
            assert on_disk, case
            assert moved or optimizer != "AdamW", case  # Adam streams its tiles; Lion goes through the mapping
        assert sum(r[-1]["direct_bytes"] for r in results) > 0  # ext4/xfs: the aligned tiles bypass the page cache
    assert not list(tmp_path.iterdir())  # every swap directory went with its engine


# -- checkpoints: NVMe <-> CPU offload at another world size --------------------------------------

from test_checkpoint_reshape import GLOBAL_BATCH, _train  # noqa: E402  (one global batch split over the ranks)

STEPS = 3


def _engine(stage: int, offload: dict):
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = {"offload_param": _nvme(offload["nvme_path"], max_in_cpu=0)} if stage == 3 and "nvme_path" in offload \
        else {}  # at stage 3 the parameter shards go to NVMe with the optimizer state
    zc = {"stage": stage, "sub_group_size": 1024, "offload_optimizer": offload, **params,
          **({"stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 300} if stage == 3 else {})}
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=build_model("mlp"), config={
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}})
    return engine


def first_half(stage: int, offload: dict, path: str) -> None:
    engine = _engine(stage, offload)
    _train(engine, 0, STEPS)
    engine.save_checkpoint(path, tag="half")


def second_half(stage: int, offload: dict, path: str) -> list[torch.Tensor]:
    engine = _engine(stage, offload)
    engine.load_checkpoint(path, tag="half")
    _train(engine, STEPS, 2 * STEPS)
    with zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def test_checkpoints_move_between_nvme_and_cpu_offload_at_another_world_size(dist_run, tmp_path):
    """Saved with the optimizer state and the parameter shards on NVMe (stage 3, 2 ranks), resumed
    on 1 rank with both in host memory and at stage 1; saved from host memory, resumed onto NVMe."""
    nvme, cpu = _nvme(tmp_path), {"device": "cpu"}
    dist_run(2, first_half, 3, nvme, str(tmp_path / "from-nvme"))
    dist_run(2, first_half, 2, cpu, str(tmp_path / "from-cpu"))
    finals = [dist_run(1, second_half, 3, cpu, str(tmp_path / "from-nvme"))[0],
              dist_run(1, second_half, 1, nvme, str(tmp_path / "from-nvme"))[0],
              dist_run(1, second_half, 3, nvme, str(tmp_path / "from-cpu"))[0],
              dist_run(1, second_half, 1, cpu, str(tmp_path / "from-cpu"))[0]]
    # one world size, one reduction order: the four continuations are one run, whatever held the state
    for other in finals[1:]:
        assert all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(finals[0], other))


# -- errors ---------------------------------------------------------------------------------------


def test_a_state_that_does_not_fit_the_drive_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    from zero.config import ConfigError
    from zero.offload import nvme

    model = build_model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    untouched = lambda: not list(tmp_path.iterdir()) and all(  # noqa: E731
        torch.equal(a, b) and not hasattr(b, "_zero") for a, b in zip(before, model.parameters()))
    stage3 = {"stage": 3, **STAGE3["mlp"], "offload_param": _nvme(tmp_path, max_in_cpu=0)}
    # a shard larger than a buffer: the unit, its size and the key
    with pytest.raises(ConfigError, match=r"offload_param.buffer_size = 100 elements is smaller than the shard of unit "
                                          r"'layers.0' on each rank \(434 elements\)"):
        zero.initialize(model=model, config={"train_batch_size": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": {
            **stage3, "offload_param": _nvme(tmp_path, max_in_cpu=0, buffer_size=100)}})
    assert untouched()
    monkeypatch.setattr(nvme, "free_bytes", lambda path: 1000)
    with pytest.raises(OSError, match=rf"needs .* for this rank's optimizer state in {tmp_path}.*0.00 GiB are free"):
        zero.initialize(model=model, config={"train_batch_size": 4, "optimizer": {"type": "AdamW"},
                                             "zero_optimization": {"stage": 2, "offload_optimizer": _nvme(tmp_path)}})
    assert untouched()
    # the optimizer state and the parameter shards on one drive: both counted, both named
    with pytest.raises(OSError, match=rf"needs .* optimizer state in {tmp_path} .* and 0.00 GiB for this rank's "
                                      rf"parameter shards in {tmp_path} \(zero_optimization.offload_param.nvme_path\)"):
        zero.initialize(model=model, config={"train_batch_size": 4, "optimizer": {"type": "AdamW"},
                                             "zero_optimization": {**stage3, "offload_optimizer": _nvme(tmp_path)}})
    assert untouched()


def test_an_io_error_in_the_step_stops_the_run_naming_the_file_and_the_checkpoint_stays_whole(tmp_path):
    (tmp_path / "swap").mkdir()
    engine = _engine(1, _nvme(tmp_path / "swap", buffer_count=1))
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="good")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ALIGNMENT, hard))  # the swap file can no longer be written
    try:
        with pytest.raises(OSError, match=r"zero aio: writing \d+ bytes at offset \d+ of .*swap/zero-swap-.*state\.bin"):
            _train(engine, 2, 3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    fresh = _engine(1, {"device": "cpu"})
    fresh.load_checkpoint(str(tmp_path / "ckpt"), tag="good")  # the last checkpoint loads, whole
    assert fresh.global_steps == 2


def test_a_rank_killed_in_the_nvme_write_back_auto_resumes_to_the_unbroken_run(tmp_path):
    """Rank 1 dies (SIGKILL) with step 5's tiles half written back to its swap file; torchrun
    restarts the job, which resumes from the step-4 checkpoint (never from a swap file), removes
    the dead process's swap directory and ends with the unbroken run's parameters, bit for bit."""
    from test_auto_resume import _torchrun

    (tmp_path / "swap").mkdir()
    args = ["--steps", "7", "--stage", "2", "--nvme", str(tmp_path / "swap")]
    _, unbroken = _torchrun(tmp_path, "unbroken", *args)
    log, killed = _torchrun(tmp_path, "killed", *args, "--kill-in-writeback", "5", "--kill-rank", "1", restarts=2)
    assert "killed in the write-back of step 5" in log and "exitcode: -9" in log
    assert "attempt 1 starts at step 4" in log, log[-2000:]
    assert unbroken.keys() == killed.keys() and all(torch.equal(unbroken[k], killed[k]) for k in unbroken)
    assert not list((tmp_path / "swap").iterdir())  # the dead rank's swap directory is gone too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", [2, 3])
def test_on_a_gpu_nvme_offload_is_bitwise_cpu_offload(tmp_path, stage):
    """The CUDA path: page-locked buffers, the updated 16-bit values copied to the GPU, and at stage
    3 the parameter shards read from disk and staged onto the GPU for their all-gathers."""
    import copy

    torch.manual_seed(0)
    base = build_model("gpt").cuda()
    nvme = _nvme(tmp_path, pin_memory=True)
    twins = [({"device": "cpu", "pin_memory": True}, {"device": "cpu", "pin_memory": True}), (nvme, {**nvme, "max_in_cpu": 0})]
    engines = []
    for opt, param in twins:
        cfg = _config(stage, "bf16", "AdamW", {}, opt, param if stage == 3 else None)
        engines.append(zero.initialize(model=copy.deepcopy(base), config=cfg)[0])
    g = torch.Generator().manual_seed(1)
    for _ in range(4 * 2):
        batch = [t.cuda() for t in make_batch("gpt", 2, g)]
        for engine in engines:
            engine.backward(engine(*batch))
            engine.step()
    with zero.GatheredParameters(list(engines[0].module.parameters())), \
            zero.GatheredParameters(list(engines[1].module.parameters())):
        assert all(torch.equal(p, q) for p, q in zip(engines[0].module.parameters(), engines[1].module.parameters()))
    if stage == 3:
        swap = engines[1].optimizer.storage.swap
        assert swap.reads["ahead"] > swap.reads["on_demand"] > 0
    for engine in engines:
        engine.destroy()


def test_parameters_on_nvme_see_every_write_while_shards_are_read_ahead(tmp_path):
    """Reads ahead are pending whenever a step ends; writes that land then (load_state_dict, an
    accessor, GatheredParameters with a modifier, load_checkpoint into the running engine) must be
    what the next gathers see: the run stays bitwise equal to its twin with the shards in host memory."""
    import copy

    from zero.accessors import safe_set_full_fp32_param

    torch.manual_seed(0)
    base = build_model("gpt")
    nvme = _nvme(tmp_path / "swap", max_in_cpu=0)
    (tmp_path / "swap").mkdir()
    engines = [zero.initialize(model=copy.deepcopy(base), config=_config(3, "bf16", "AdamW", {}, {"device": "cpu"},
                                                                         param))[0]
               for param in ({"device": "cpu"}, nvme)]
    swap = engines[1].optimizer.storage.swap
    g = torch.Generator().manual_seed(1)

    def train(steps: int) -> None:
        for _ in range(steps * 2):
            batch = make_batch("gpt", 2, g)
            for engine in engines:
                engine.backward(engine(*batch))
                engine.step()
        assert swap._ahead, "no read ahead pending: the writes below would test nothing"

    train(2)
    for engine in engines:  # load_state_dict of changed values
        with zero.GatheredParameters(list(engine.module.parameters())):
            sd = {k: v * 0.5 if v.is_floating_point() else v.clone() for k, v in engine.module.state_dict().items()}
        engine.module.load_state_dict(sd)
    train(1)
    for engine in engines:  # an accessor, and a modifier rank's change
        name, p = next((n, p) for n, p in engine.module.named_parameters() if p._zero.unit.swap is not None
                       or engine is engines[0] and n.endswith("weight") and p.ds_numel > 100)
        safe_set_full_fp32_param(p, torch.full(p.ds_shape, 0.25))
        with zero.GatheredParameters([p], modifier_rank=0):
            with torch.no_grad():
                p.add_(1.0)
    train(1)
    for i, engine in enumerate(engines):  # a checkpoint loaded into the running engine
        engine.save_checkpoint(str(tmp_path / f"ckpt{i}"), tag="t")
    train(1)
    for i, engine in enumerate(engines):
        engine.load_checkpoint(str(tmp_path / f"ckpt{i}"), tag="t")
    train(2)
    with zero.GatheredParameters(list(engines[0].module.parameters())), \
            zero.GatheredParameters(list(engines[1].module.parameters())):
        assert all(torch.equal(p, q) for p, q in zip(engines[0].module.parameters(), engines[1].module.parameters()))
    assert swap.reads["ahead"] > swap.reads["on_demand"] and swap.reads["extra_buffers"] == 0
    for engine in engines:
        engine.destroy()


def test_the_aio_section_reaches_the_policies_by_either_name(tmp_path):
    from zero.config import ConfigError, load_config
    from zero.offload.policy import offload_policy, param_nvme_policy

    for name in ("thread_count", "intra_op_parallelism"):  # DeepSpeed's old name is read, not dropped
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "aio": {name: 3, "block_size": 65536, "queue_depth": 5},
                           "zero_optimization": {"stage": 3, "offload_optimizer": _nvme(tmp_path),
                                                 "offload_param": _nvme(tmp_path)}})
        opt, param = offload_policy(cfg, 1), param_nvme_policy(cfg)
        assert (opt.threads, opt.block_size, opt.queue_depth) == (param.threads, param.block_size,
                                                                 param.queue_depth) == (3, 65536, 5)
    with pytest.raises(ConfigError, match="both 'thread_count' and 'intra_op_parallelism' are given"):
        load_config({"train_micro_batch_size_per_gpu": 1, "aio": {"thread_count": 2, "intra_op_parallelism": 2}})

"""Training checkpoints: resuming equals never stopping, bitwise, on every stage and offload
setting, with fp16 loss scaling and an lr scheduler (another world size: test_checkpoint_reshape.py)."""
import json
import os

import pytest
import torch
import torch.distributed as dist

import zero
from zero.testing.state import shard_state
from zero.testing.training import build_model, make_batch

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}

VARIANTS = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2, "reduce_bucket_size": 300},
    "stage3": {"stage": 3, "stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 300},
    "stage2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
    "stage3-offload": {"stage": 3, "stage3_param_persistence_threshold": 20, "offload_param": {"device": "cpu"},
                       "offload_optimizer": {"device": "cpu", "pin_memory": False}},
}


def _engine(zc: dict, fp16: bool = False):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": SCHEDULER, "zero_optimization": zc}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3}
    engine, *_ = zero.initialize(model=build_model("mlp"), config=cfg)
    return engine


def _train(engine, first: int, last: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(first, last):
        for micro in range(2):
            x, y = make_batch("mlp", 4, torch.Generator().manual_seed(1000 * step + 10 * micro + rank))
            if engine.config.fp16.enabled:
                x, y = x.half(), y.half()
            engine.backward(engine(x, y))
            engine.step()


def _state(engine) -> dict:
    with zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().clone() for p in engine.module.parameters()]
    return dict(params=params, shards=shard_state(engine.optimizer), steps=engine.global_steps,
                lr=engine.get_lr(), scale=engine.optimizer.loss_scaler.scale, skipped=engine.skipped_steps,
                micro=engine.micro_steps, samples=engine.global_samples)


def resume_equals_straight(variant: str, fp16: bool, path: str):
    zc = VARIANTS[variant]
    straight = _engine(zc, fp16)
    _train(straight, 0, 10)
    expected = _state(straight)

    first = _engine(zc, fp16)
    _train(first, 0, 5)
    torch.manual_seed(123)  # the RNG state is saved and restored with the checkpoint
    first.save_checkpoint(path, client_state={"epoch": 3})
    torch.manual_seed(123)
    after_save = torch.rand(1).item()
    resumed = _engine(zc, fp16)
    torch.manual_seed(999)
    loaded, client = resumed.load_checkpoint(path)
    rng_restored = torch.rand(1).item() == after_save
    _train(resumed, 5, 10)
    got = _state(resumed)
    same_params = all(torch.equal(a, b) for a, b in zip(expected["params"], got["params"]))
    same_shards = all(torch.equal(a[k], b[k]) for a, b in zip(expected["shards"], got["shards"])
                      for k in ("master", "exp_avg", "exp_avg_sq")) and len(expected["shards"]) == len(got["shards"])
    return dict(params=same_params, shards=same_shards, client=client, path=loaded, rng=rng_restored,
                counters=[got[k] for k in ("steps", "lr", "scale", "skipped", "micro", "samples")] ==
                [expected[k] for k in ("steps", "lr", "scale", "skipped", "micro", "samples")])


@pytest.mark.parametrize("variant,fp16", [(v, False) for v in VARIANTS] + [("stage2", True), ("stage3", True)])
def test_resuming_from_a_checkpoint_equals_never_stopping(dist_run, tmp_path, variant, fp16):
    for r in dist_run(2, resume_equals_straight, variant, fp16, str(tmp_path)):
        assert r["params"] and r["shards"], r  # bitwise
        assert r["counters"] and r["rng"], r
        assert r["client"] == {"epoch": 3} and r["path"] == os.path.join(str(tmp_path), "global_step5")
    assert (tmp_path / "latest").read_text() == "global_step5"
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert all(f.endswith((".json", ".safetensors")) or f == "latest" for f in files), files
    state = json.loads((tmp_path / "global_step5" / "zero_checkpoint.json").read_text())
    assert state["progress"]["global_steps"] == 5 and state["world_size"] == 2


def loader_resumes(path: str):
    data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).view(40, 1))

    def run():
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        return zero.initialize(model=model, training_data=data, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}})

    engine, _, loader, _ = run()
    loader.sampler.set_epoch(1)
    straight = [b[0].view(-1).tolist() for b in loader]
    engine2, _, loader2, _ = run()
    loader2.sampler.set_epoch(1)
    seen = []
    for i, (x,) in enumerate(loader2):
        seen.append(x.view(-1).tolist())
        if i == 2:
            break
    engine2.save_checkpoint(path, tag="mid")
    engine3, _, loader3, _ = run()
    engine3.load_checkpoint(path, tag="mid")
    rest = [b[0].view(-1).tolist() for b in loader3]
    return straight, seen + rest


def test_the_data_loader_resumes_mid_epoch(dist_run, tmp_path):
    for straight, resumed in dist_run(2, loader_resumes, str(tmp_path)):
        assert resumed == straight and len(straight) == 10


def test_a_save_inside_an_accumulation_window_warns_and_resumes_at_the_window_start(tmp_path):
    engine = _engine({"stage": 2})
    x, y = make_batch("mlp", 4, torch.Generator().manual_seed(0))
    engine.backward(engine(x, y))
    engine.step()  # micro-step 1 of a window of 2
    with pytest.warns(UserWarning, match=r"save_checkpoint at micro-step 1, inside a gradient accumulation window"):
        engine.save_checkpoint(tmp_path)
    engine.backward(engine(x, y))  # gradients pending when the load comes: dropped by it
    engine.load_checkpoint(tmp_path)
    assert engine.micro_steps == 0 and engine.is_gradient_accumulation_boundary() is False
    assert all(s.abs().sum() == 0 for s in engine.optimizer.storage.grads.shards)


def test_model_only_loads_fill_model_and_master_with_the_saved_values(tmp_path):
    """load_optimizer_states=False and load_module_only in bf16 with a separate fp32 master (stages
    2 and 3, and stage 2 with optimizer offload): the model takes the saved 16-bit values and the
    master follows them exactly (they share one (name, offset) when read)."""
    import torch.nn as nn

    import zero

    def make(seed: int, stage: int, offload: bool):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        zc = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        engine, *_ = zero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": zc,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        return engine

    def values(engine):
        with zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().float().clone() for p in engine.module.parameters()]

    for stage, offload in ((2, False), (3, False), (2, True)):
        saver = make(0, stage, offload)
        saver.backward(saver(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().mean())
        saver.step()
        saver.save_checkpoint(tmp_path / f"s{stage}{offload}", tag="t")
        want = values(saver)
        for kwargs in ({"load_optimizer_states": False}, {"load_module_only": True}):
            engine = make(1, stage, offload)
            engine.load_checkpoint(tmp_path / f"s{stage}{offload}", tag="t", **kwargs)
            got = values(engine)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (stage, offload, kwargs)
            masters = torch.cat([s.master.reshape(-1) for s in engine.optimizer.slots()])
            assert torch.isfinite(masters).all() and masters.abs().max() <= max(w.abs().max() for w in want)
            engine.optimizer.publish()  # the master republished: the same values again
            assert all(torch.equal(a, b) for a, b in zip(values(engine), want)), (stage, offload, kwargs)

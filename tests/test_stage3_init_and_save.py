"""zero.Init builds a model already sharded; GatheredParameters reads and changes sharded
parameters; save_16bit_model writes a state dict a plain nn.Module loads with strict=True."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.testing.models import MLP
from zero.testing.training import make_batch, relative_error

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 300}


class CustomInit(nn.Module):
    """Initialises its weights after building its layers, the way HF models do, inside
    GatheredParameters so that it also works under zero.Init."""

    def __init__(self):
        super().__init__()
        self.body = MLP()
        self.scale = nn.Parameter(torch.ones(5))
        with zero.GatheredParameters(list(self.body.parameters()), modifier_rank=0):
            for layer in self.body.layers:
                nn.init.normal_(layer.weight, std=0.1)

    def forward(self, x, y):
        return F.mse_loss(self.body(x) * self.scale, y)


def train_init_built_model(steps: int = 4):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = CustomInit()
    torch.manual_seed(0)
    with zero.Init(remote_device="cpu") as init:
        net = CustomInit()
    sharded = all(p.numel() == 0 and p._zero.local.device.type == "cpu" for p in net.parameters())
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in ref.modules())
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": STAGE3}
    engine, *_ = zero.initialize(model=net, config=cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    start_error = relative_error(net, ref)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batches = [make_batch("mlp", 4, g) for _ in range(world)]
        engine.backward(engine(*batches[rank]))
        engine.step()
        ref_opt.zero_grad()
        ref(*(torch.cat(t) for t in zip(*batches))).backward()
        ref_opt.step()
    return dict(sharded=sharded, peak=init.peak_full_elements, largest_module=largest_module,
                total=sum(p.numel() for p in ref.parameters()), start_error=start_error, error=relative_error(net, ref))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_model_built_under_init_is_never_whole_and_trains_like_the_reference(dist_run, world_size):
    for r in dist_run(world_size, train_init_built_model):
        assert r["sharded"]  # only shards after construction (kept on the CPU: remote_device="cpu")
        assert r["peak"] <= r["largest_module"] < r["total"]  # at most one module's own params were whole
        assert r["start_error"] == 0.0  # same values as the plain model, custom init included
        assert r["error"] < 1e-6, r["error"]


def modify_on_rank_zero():
    torch.manual_seed(0)
    net = MLP()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}},
           "zero_optimization": STAGE3}
    engine, *_ = zero.initialize(model=net, config=cfg)
    weight = net.layers[1].weight
    with zero.GatheredParameters(weight, modifier_rank=0), torch.no_grad():
        weight.fill_(1.0 if dist.get_rank() == 0 else -7.0)  # only rank 0's change counts
    engine.backward(engine(torch.randn(4, 13), torch.randn(4, 5)))
    engine.step()  # lr 0: the update writes the fp32 master back, which must hold the new value
    with zero.GatheredParameters(weight):
        return torch.equal(weight, torch.ones_like(weight)), weight.shape == (17, 31)


def test_gathered_parameters_with_a_modifier_rank_changes_shards_and_master(dist_run):
    assert all(ok and shape for ok, shape in dist_run(3, modify_on_rank_zero))


def save_after_training(directory: str, precision: str, gather: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = MLP()
    ref = copy.deepcopy(net)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {**STAGE3, "stage3_gather_16bit_weights_on_model_save": gather}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zero.initialize(model=net, config=cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [make_batch("mlp", 4, g) for _ in range(world)]
        x, y = batches[rank]
        engine.backward(engine(x.to(engine.config.dtype), y.to(engine.config.dtype)))
        engine.step()
        ref_opt.zero_grad()
        ref(*(torch.cat(t) for t in zip(*batches))).backward()
        ref_opt.step()
    saved = engine.save_16bit_model(directory, "model.bin")
    if rank != 0 or not saved:
        return saved, None, None
    plain = MLP().to(engine.config.dtype)
    state = torch.load(os.path.join(directory, "model.bin"))
    plain.load_state_dict(state, strict=True)
    return saved, relative_error(plain, ref), {v.dtype for v in state.values()}


def test_save_16bit_model_loads_into_a_plain_module_and_equals_the_reference(dist_run, tmp_path):
    saved, error, dtypes = dist_run(3, save_after_training, str(tmp_path / "fp32"), "fp32", True)[0]
    assert saved and error < 1e-6 and dtypes == {torch.float32}
    saved, error, dtypes = dist_run(3, save_after_training, str(tmp_path / "bf16"), "bf16", True)[0]
    assert saved and error < 5e-2 and dtypes == {torch.bfloat16}
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path / "bf16"))  # written atomically


def test_without_the_gather_flag_nothing_is_saved(dist_run, tmp_path):
    results = dist_run(2, save_after_training, str(tmp_path / "none"), "fp32", False)
    assert [saved for saved, _, _ in results] == [False, False]
    assert not (tmp_path / "none" / "model.bin").exists()


def test_in_place_init_after_zero_init_sharded_is_refused_not_lost():
    """A model whose __init__ re-initialises its submodules' parameters after zero.Init sharded
    them would silently keep the default init; zero.initialize names the parameter instead."""
    class ReInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            for p in self.parameters():
                nn.init.zeros_(p)  # runs on the empty shard view: nothing happens

    with zero.Init():
        model = ReInit()
    with pytest.raises(ValueError, match=r"changed in place after zero.Init had sharded them \(first: 'a.weight'\)"):
        zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"},
                                              "zero_optimization": {"stage": 3}})


def test_init_pins_the_shard_it_keeps_after_casting_to_dtype(monkeypatch):
    """zero.Init(remote_device="cpu", pin_memory=True, dtype=bf16): the bf16 shard is page-locked,
    not an fp32 one that a cast then replaces by a pageable copy. Pinning needs CUDA, so a
    stand-in torch.empty records what it was asked to pin (and torch.cuda.is_available says yes)."""
    real_empty = torch.empty
    pinned = []

    def empty(*args, pin_memory=False, **kwargs):
        t = real_empty(*args, **kwargs)
        if pin_memory:
            pinned.append(t)
        return t

    torch.manual_seed(0)
    expected = nn.Linear(4, 3).weight.detach().to(torch.bfloat16).reshape(-1)
    torch.manual_seed(0)
    with zero.Init(remote_device="cpu", pin_memory=True, dtype=torch.bfloat16):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch, "empty", empty)
        layer = nn.Linear(4, 3)
        monkeypatch.undo()
    shard = layer.weight.ds_tensor
    assert shard.dtype == torch.bfloat16 and torch.equal(shard[: expected.numel()], expected)
    assert [t.dtype for t in pinned] == [torch.bfloat16, torch.bfloat16]  # weight, bias: once each, no fp32 copy
    assert shard.untyped_storage().data_ptr() == pinned[0].untyped_storage().data_ptr()  # the kept shard is pinned
    assert layer.bias.ds_tensor.untyped_storage().data_ptr() == pinned[1].untyped_storage().data_ptr()

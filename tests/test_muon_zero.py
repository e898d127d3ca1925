"""Muon under ZeRO (zero/optim/muon.py, [Note: placements] in zero/stages/placement.py): every stage
and world size equals single-process torch.optim.Muon + torch.optim.AdamW on DeepSpeed's split, on a
model with awkward shapes; a checkpoint resumes at another world size and stage; the bytes sent equal
Adam's."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.config.errors import ConfigError

SETTINGS = dict(lr=0.02, adam_lr=0.003, momentum=0.9, weight_decay=0.01, betas=[0.9, 0.95], eps=1e-8)
VOCAB, BATCH = 11, 12


class Awkward(nn.Module):
    """Matrices of 13x8, 8x13, 7x8 and 8x7 (sizes 2 and 3 ranks do not all divide), a token
    embedding tied to the output head, a frozen matrix and biases."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, 8)
        self.fc1, self.fc2 = nn.Linear(8, 13), nn.Linear(13, 8)
        self.mid, self.back = nn.Linear(8, 7, bias=False), nn.Linear(7, 8, bias=False)
        self.frozen = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.frozen.requires_grad_(False)

    def matrices(self) -> list[nn.Parameter]:
        return [self.fc1.weight, self.fc2.weight, self.mid.weight, self.back.weight]

    def forward(self, idx, targets):
        h = self.embed_tokens(idx)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        h = self.frozen(h + self.back(torch.tanh(self.mid(h))))
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), targets.flatten())


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, 6), generator=g), torch.randint(0, VOCAB, (BATCH, 6), generator=g)


def _engine(stage: int, client: bool, model: nn.Module, **zc):
    if stage == 3:  # mid and back persistent, fc1 and fc2 units of their own, the rest the root's
        zc.update(stage3_param_persistence_threshold=60, stage3_module_granularity_threshold=100)
    config = {"train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(), "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, **zc}}
    if client:  # torch's own Muon for the matrices; zero gives the rest AdamW with its lr and weight decay
        optimizer = torch.optim.Muon(model.matrices(), lr=0.02, momentum=0.9, weight_decay=0.01)
        return zero.initialize(model=model, optimizer=optimizer, config=config)[0]
    return zero.initialize(model=model, config={**config, "optimizer": {"type": "Muon", "params": SETTINGS}})[0]


def _train(engine, steps: range) -> None:
    rank, m = dist.get_rank(), BATCH // dist.get_world_size()
    k = engine.config.gradient_accumulation_steps
    for step in steps:
        x, y = _batch(step)
        for micro in range(k):  # the rank's samples, in k micro-batches
            lo = rank * m + micro * (m // k)
            engine.backward(engine(x[lo : lo + m // k], y[lo : lo + m // k]))
            engine.step()


def _reference(model: Awkward, client: bool, steps: int) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, one process, whole batch."""
    muon = torch.optim.Muon(model.matrices(), lr=0.02, momentum=0.9, weight_decay=0.01)
    taken = {id(p) for p in model.matrices()}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    adamw = torch.optim.AdamW(rest, lr=0.02, weight_decay=0.01) if client else \
        torch.optim.AdamW(rest, lr=0.003, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for step in range(steps):
        muon.zero_grad()
        adamw.zero_grad()
        model(*_batch(step)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        muon.step()
        adamw.step()
    return muon, adamw


def _errors(stages: tuple[int, ...]) -> dict:
    out = {}
    for stage in stages:
        for client, offload in ((False, False), (True, False), (False, True)):
            torch.manual_seed(0)
            model = Awkward()
            reference = copy.deepcopy(model)
            zc = {"reduce_bucket_size": 60} if stage < 3 else {}  # several buckets of each kind
            if offload:  # masters and momentum in host memory, Newton-Schulz where the model computes
                zc["offload_optimizer"] = {"device": "cpu"}
            engine = _engine(stage, client, model, **zc)
            _train(engine, range(5))
            _reference(reference, client, 5)
            if offload:
                assert engine.memory_report()["host_bytes"] > 0
            with zero.GatheredParameters(list(model.parameters())):  # stage 3: the owners' updates reach it
                out[f"stage {stage} {'client' if client else 'config'}{' offload' if offload else ''}"] = max(
                    ((p.detach() - q.detach()).norm() / q.detach().norm()).item()
                    for p, q in zip(model.parameters(), reference.parameters()))
                assert torch.equal(model.frozen.weight, reference.frozen.weight)
    return out


def _variant(stage: int, extra: dict, zc: dict, init: bool = False) -> float:
    torch.manual_seed(0)
    if init:  # built sharded (zero.Init): the split goes by each parameter's layer shape (ds_shape)
        with zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            model = Awkward()
        with zero.GatheredParameters(list(model.parameters())):
            reference = copy.deepcopy(model)
    else:
        model = Awkward()
        reference = copy.deepcopy(model)
    if stage == 3:
        zc = {**zc, "stage3_param_persistence_threshold": 60, "stage3_module_granularity_threshold": 100}
    config = {"train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(), "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, **zc}, "optimizer": {"type": "Muon", "params": SETTINGS},
              **extra}
    if "gradient_accumulation_steps" in extra:
        config["train_micro_batch_size_per_gpu"] //= extra["gradient_accumulation_steps"]
    engine = zero.initialize(model=model, config=config)[0]
    _train(engine, range(5))
    _reference(reference, False, 5)
    with zero.GatheredParameters(list(model.parameters())):
        return max(((p.detach() - q.detach()).norm() / q.detach().norm()).item()
                   for p, q in zip(model.parameters(), reference.parameters()))


def _edit_in_place_one_rank() -> float:
    """One rank, stage 3: the shard is the parameter; an in-place edit between steps must stand."""
    torch.manual_seed(0)
    model = Awkward()
    engine = zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {
        "stage": 3}, "optimizer": {"type": "Muon", "params": SETTINGS}})[0]
    _train(engine, range(2))
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)
        halved = model.fc1.weight.detach().clone()
    with zero.GatheredParameters([model.fc1.weight]):
        return (model.fc1.weight.detach() - halved).abs().max().item()


def _variants(world_of_one: bool) -> dict:
    if world_of_one:
        return {**{f"stage {s}, one rank": _variant(s, {}, {}) for s in (1, 2, 3)},
                "stage 3, one rank, an edit in place stands": _edit_in_place_one_rank()}
    return {"stage 2, accumulation 2": _variant(2, {"gradient_accumulation_steps": 2}, {}),
            "stage 1, accumulation 2": _variant(1, {"gradient_accumulation_steps": 2}, {}),
            "stage 2, all-reduce": _variant(2, {}, {"reduce_scatter": False}),
            "stage 3, accumulation 2": _variant(3, {"gradient_accumulation_steps": 2}, {}),
            "stage 3, optimizer and parameter offload": _variant(3, {}, {
                "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
            "stage 3, zero.Init": _variant(3, {}, {}, init=True)}


@pytest.mark.parametrize("world", [1, 2])
def test_accumulation_all_reduce_param_offload_zero_init_and_one_rank(dist_run, world):
    for errors in dist_run(world, _variants, world == 1):
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("world", [2, 3])
def test_every_stage_equals_torch_muon_and_adamw_in_one_process(dist_run, world):
    errors = dist_run(world, _errors, (0, 1, 2, 3))
    assert errors[0] == errors[-1]  # every rank holds the same model
    assert len(errors[0]) == 12 and max(errors[0].values()) < 1e-5, errors[0]


def _resume(stage: int, path: str, part: str) -> dict:
    torch.manual_seed(0)
    model = Awkward()
    engine = _engine(stage, False, model)
    if part == "second half":
        engine.load_checkpoint(path)
    _train(engine, {"whole": range(4), "first half": range(2), "second half": range(2, 4)}[part])
    if part == "first half":
        engine.save_checkpoint(path, tag="half")
    with zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().tolist() for n, p in model.named_parameters()}


def test_a_checkpoint_resumes_at_another_world_size_and_stage(dist_run, tmp_path):
    whole = dist_run(2, _resume, 1, str(tmp_path), "whole")[0]
    half = dist_run(2, _resume, 3, str(tmp_path), "first half")[0]  # saved by stage 3's owners
    for world, stage in ((3, 2), (1, 0), (3, 3)):
        resumed = dist_run(world, _resume, stage, str(tmp_path), "second half")[0]
        for name in whole:  # the momentum, the masters and AdamW's moments came back
            a, b = torch.tensor(resumed[name]), torch.tensor(whole[name])
            assert ((a - b).norm() / b.norm()).item() < 1e-6, (world, stage, name)
    from zero.checkpoint.consolidate import get_fp32_state_dict

    fp32 = get_fp32_state_dict(str(tmp_path), tag="half")  # Muon's masters are whole on their owners
    for name in ("fc1.weight", "mid.weight", "embed_tokens.weight", "fc2.bias"):
        assert torch.equal(fp32[name], torch.tensor(half[name])), name


def _bytes_per_step(kind: str, stage: int) -> dict[str, int]:
    from zero.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, n_layer=2, n_embd=48))
    zc = {"stage": stage}
    if stage == 3:  # a unit per linear layer, gathered in forward and again in backward
        zc.update(stage3_param_persistence_threshold=100, stage3_module_granularity_threshold=5000,
                  stage3_max_reuse_distance=0, stage3_max_live_parameters=0)
    optimizer = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3}} if kind == "Muon" else \
        {"type": "AdamW", "params": {"lr": 3e-3}}
    engine, *_ = zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                                      "zero_optimization": zc, "optimizer": optimizer})
    for step in range(2):
        x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x, x))
        engine.step()
    return {name: count["bytes"] for name, count in engine.comm_report().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_sends_the_bytes_adam_sends(dist_run, stage):
    adam, muon = (dist_run(2, _bytes_per_step, kind, stage)[0] for kind in ("AdamW", "Muon"))
    # the matrices' reduce-scatter and all-gather become a reduce to, and a broadcast from, each owner
    assert muon["reduce"] > 0 and muon["broadcast_params"] >= muon["reduce"]  # stage 3: a gather per pass
    assert sum(muon.values()) <= 1.1 * sum(adam.values()), (muon, adam)


def test_what_muon_cannot_do_is_refused_by_name():
    model = Awkward()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": {}}}
    for params, says in (({"ns_method": "gram"}, "'gram' variant is not implemented"),
                         ({"betas2": 0.9}, r"\['betas2'\] are not Muon keys")):
        with pytest.raises(ConfigError, match=says):
            zero.initialize(model=model, config={**config, "optimizer": {"type": "muon", "params": params}})
    with pytest.raises(ConfigError, match="tensor_parallel.size"):
        zero.config.load_config({**config, "tensor_parallel": {"size": 2}}, world_size=2)
    model.fc1.bias.use_muon = True
    with pytest.raises(ValueError, match=r"'fc1.bias' has use_muon=True but shape \(13,\)"):
        zero.initialize(model=model, config=config)


def _fp16(stage: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = Awkward()
    reference = copy.deepcopy(model)
    engine = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(), "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": SETTINGS}})[0]
    _train(engine, range(5))
    _reference(reference, False, 5)
    with zero.GatheredParameters(list(model.parameters())):
        return max(((p.detach().float() - q.detach()).norm() / q.detach().norm()).item()
                   for p, q in zip(model.parameters(), reference.parameters())), engine.optimizer.loss_scaler.scale


def test_fp16_loss_scaling_reaches_muon_unscaled(dist_run):
    """Muon sees the gradient divided by the loss scale (zero's one divisor): fp16 training follows the
    fp32 reference up to fp16's rounding of the model, the same at stage 1 and 3."""
    (one, scale), = set(dist_run(2, _fp16, 1))
    (three, _), = set(dist_run(2, _fp16, 3))
    assert scale == 256.0 and one < 2e-2 and one == three, (one, three, scale)


def _states_and_schedule(stage: int) -> dict:
    from zero.accessors import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param

    torch.manual_seed(0)
    model = Awkward()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(), "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 60,
                                    "stage3_module_granularity_threshold": 100},
              "optimizer": {"type": "Muon", "params": SETTINGS}}
    engine = zero.initialize(model=model, config=config)[0]
    _train(engine, range(3))
    muon, adamw = _reference(reference, False, 3)
    out = {}
    # the accessors: a matrix's momentum_buffer and master, whole from its owner; Adam's keys refused on it
    got = safe_get_full_optimizer_state(model.fc1.weight, "momentum_buffer")
    out["momentum"] = (got - muon.state[reference.fc1.weight]["momentum_buffer"]).abs().max().item()
    out["exp_avg of a bias"] = (safe_get_full_optimizer_state(model.fc1.bias, "exp_avg")
                                - adamw.state[reference.fc1.bias]["exp_avg"]).abs().max().item()
    for param, key, says in ((model.fc1.weight, "exp_avg", "updated by Muon, which keeps 'momentum_buffer'"),
                             (model.fc1.bias, "momentum_buffer", "updated by Adam, which keeps 'exp_avg'")):
        with pytest.raises(ValueError, match=says):
            safe_get_full_optimizer_state(param, key)
    new = safe_get_full_fp32_param(model.mid.weight) * 0.5  # a persistent matrix at stage 3
    safe_set_full_fp32_param(model.mid.weight, new)
    with zero.GatheredParameters([model.mid.weight]):
        out["set master reaches the model"] = (model.mid.weight.detach() - new).abs().max().item()
    assert safe_get_full_optimizer_state(model.frozen.weight, "momentum_buffer") is None  # frozen: nothing kept
    if stage == 3:  # a local set on the owner alone (not collective): every rank's gather sees it
        from zero.accessors import safe_get_local_fp32_param, safe_set_local_fp32_param

        doubled = safe_get_full_fp32_param(model.fc1.weight) * 2
        mine = safe_get_local_fp32_param(model.fc1.weight)
        if mine.numel():
            safe_set_local_fp32_param(model.fc1.weight, mine * 2)
        with zero.GatheredParameters([model.fc1.weight]):
            out["a local set reaches every rank"] = (model.fc1.weight.detach() - doubled).abs().max().item()
    # offload_states: stage 3 gathers the matrices from their owners' masters, so a forward waits for them
    engine.offload_states(include=["hp_params"])
    x, y = _batch(9)
    if stage == 3:
        with pytest.raises(RuntimeError, match="fp32_master"):
            engine(x[:2], y[:2])
    engine.reload_states()
    engine(x[:2], y[:2])
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_accessors_and_offload_states_on_muon_matrices(dist_run, stage):
    for out in dist_run(2, _states_and_schedule, stage):
        assert max(out.values()) < 1e-6, out


def test_a_scalar_warmup_lr_over_muons_two_lrs_warns_and_cosine_keeps_them():
    from zero.lr_schedules import WarmupCosineLR, WarmupLR

    model = Awkward()
    groups = [{"params": model.matrices(), "lr": 0.02}, {"params": [model.fc1.bias], "lr": 0.003}]
    with pytest.warns(UserWarning, match=r"warmup_max_lr=0.01 becomes the lr of every param group, replacing their "
                                         r"own lrs \[0.003, 0.02\]"):
        WarmupLR(torch.optim.SGD(groups, lr=0.1), warmup_max_lr=0.01)
    optimizer = torch.optim.SGD([{"params": model.matrices(), "lr": 0.02}, {"params": [model.fc1.bias], "lr": 0.003}],
                                lr=0.1)
    schedule = WarmupCosineLR(optimizer, total_num_steps=10, warmup_num_steps=2)
    for _ in range(4):
        schedule.step()
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert abs(lrs[0] / lrs[1] - 0.02 / 0.003) < 1e-9, lrs


def _fp32_newton_schulz(monkeypatch) -> None:
    """torch's Newton-Schulz in fp32 instead of bf16: a run that sums gradients in another order (a
    pipeline's micro-batches) flips bf16 roundings of the update, which its quintic iteration
    amplifies to ~1e-3; in fp32 the comparison stays at round-off."""
    import torch.optim._muon as torch_muon

    original = torch_muon._zeropower_via_newtonschulz

    def fp32(grad, ns_coefficients, ns_steps, eps):
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "bfloat16", lambda t: t.float())
            return original(grad, ns_coefficients, ns_steps, eps)

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", fp32)


def _pipeline_with_muon(zero_stage: int) -> dict:
    from test_parallelism import train_pipeline

    with pytest.MonkeyPatch.context() as m:
        _fp32_newton_schulz(m)
        muon = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.01}}
        return {n: p.tolist() for n, p in train_pipeline(2, "1f1b", zero_stage, 3, extra={"optimizer": muon})[1].items()}


def test_pipeline_stages_with_muon_equal_one_process(dist_run, monkeypatch):
    """2 pipeline stages x 2 data ranks (4 micro-batches, the embedding tied across the first and last
    stage, clipping over both stages): Muon on each stage's matrices, AdamW on the rest; Newton-Schulz
    in fp32 on both sides (see _fp32_newton_schulz)."""
    from test_parallelism import MICRO, M, batch, layers, loss_fn, reference_model

    _fp32_newton_schulz(monkeypatch)
    forward, params = reference_model(layers())
    matrices = [p for n, p in params.items() if p.dim() >= 2 and "embed" not in n]
    rest = [p for p in params.values() if all(p is not q for q in matrices)]
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01)
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)
    for step in range(3):
        x, y = batch(step, M * MICRO * 2)
        muon.zero_grad()
        adamw.zero_grad()
        loss_fn(forward(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
        muon.step()
        adamw.step()
    for full in dist_run(4, _pipeline_with_muon, 1):
        for name, p in full.items():
            want = params[name].detach()
            assert ((torch.tensor(p) - want).norm() / want.norm()).item() < 1e-5, name


def _hybrid_variants() -> dict:
    """4 ranks as 2 replicas of a shard group of 2 (mics_shard_size 2): owners in each group, the
    same matrices at the same place of both, their gradients summed over the replicas."""
    return {"stage 1": _variant(1, {}, {"mics_shard_size": 2}),
            "stage 2": _variant(2, {}, {"mics_shard_size": 2}),
            "stage 2, accumulation 3, offload": _variant(2, {"gradient_accumulation_steps": 3}, {
                "mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}}),
            "stage 3": _variant(3, {}, {"mics_shard_size": 2}),
            "stage 3, accumulation 3": _variant(3, {"gradient_accumulation_steps": 3}, {"mics_shard_size": 2})}


def test_muon_with_hybrid_sharding_equals_torch_muon_in_one_process(dist_run):
    errors = dist_run(4, _hybrid_variants)
    assert errors[0] == errors[-1]  # every rank, replicas too, holds the same model
    assert max(errors[0].values()) < 1e-5, errors[0]

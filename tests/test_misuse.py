"""Misuse that would train silently wrong is refused with an error that says what to do, before
anything changes; `model.load_state_dict` after initialize really loads (every stage, 16-bit too)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.testing.state import shard_state


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _config(stage: int, **extra) -> dict:
    zc = {"stage": stage}
    if stage == 3:
        zc["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zc, **extra}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_second_engine_on_the_same_parameters_is_refused(stage):
    net = _net()
    zero.initialize(model=net, config=_config(stage))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is already (trained|sharded) by another zero engine: "
                                         r"zero.initialize was called twice"):
        zero.initialize(model=net, config=_config(stage))
    shared = nn.Sequential(net[0], nn.Linear(16, 2))  # a layer shared with the first model
    with pytest.raises(ValueError, match=r"parameter '0.weight' is already (trained|sharded) by another zero engine"):
        zero.initialize(model=shared, config=_config(stage))
    if stage < 3:  # a frozen parameter shared with an engine that does not shard it is fine
        embed = nn.Linear(8, 8)
        embed.requires_grad_(False)
        zero.initialize(model=nn.Sequential(embed, nn.Linear(8, 2)), config=_config(stage))
        zero.initialize(model=nn.Sequential(embed, nn.Linear(8, 3)), config=_config(stage))
    import pickle

    pickle.dumps(net) if stage < 2 else None  # torch.save(model) of a stage 0/1 model keeps working


def test_parameters_outside_the_model_and_zero_init_models_below_stage_3_are_refused():
    net, other = _net(), _net()
    with pytest.raises(ValueError, match=r"param group 0 holds a parameter of shape \(16, 8\) that is not in the "
                                         r"model.*optimizer built over another model"):
        zero.initialize(model=net, optimizer=torch.optim.AdamW(other.parameters()), config=_config(2))
    with pytest.raises(ValueError, match="not in the model"):
        zero.initialize(model=net, model_parameters=list(net.parameters()) + [nn.Parameter(torch.ones(3))],
                        config=_config(1))
    with zero.Init():
        sharded = nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"built under zero.Init \(parameter 'weight' is partitioned\), which only "
                                         r"ZeRO stage 3 can train"):
        zero.initialize(model=sharded, config=_config(2))
    engine, *_ = zero.initialize(model=net, config=_config(2))  # nothing was claimed by the refused calls
    assert engine.global_steps == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_freezing_or_unfreezing_after_initialize_is_refused_before_the_step(stage):
    net = _net()
    net[2].bias.requires_grad_(False)
    engine, *_ = zero.initialize(model=net, config=_config(stage))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for name, param, flag in (("0.weight", net[0].weight, False), ("2.bias", net[2].bias, True)):
        param.requires_grad_(flag)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        with pytest.raises(RuntimeError, match=rf"parameter '{name}' was {'un' if flag else ''}frozen "
                                               rf"\(requires_grad={flag}\) after zero.initialize"):
            engine.step()
        param.requires_grad_(not flag)
        engine.zero_grad()
    assert engine.global_steps == 0 and engine.optimizer.step_count == 0


def test_backward_of_a_tuple_or_a_model_output_names_the_type():
    engine, *_ = zero.initialize(model=_net(), config=_config(2))
    out = engine(torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"engine.backward\(loss\) takes the scalar loss tensor, got a tuple "
                                        r"\(pass the loss inside it, e.g. outputs\[0\] or outputs.loss\)"):
        engine.backward((out.sum(), out))


def test_dist_init_required_false_under_a_launcher_without_a_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 says this process is one of several ranks, but no "
                                           r"torch.distributed process group exists"):
        zero.initialize(model=_net(), config=_config(2), dist_init_required=False)


def load_after_initialize(stage: int, dtype: str):
    """Train a step, load a state dict (new fp32 values), step with lr 0: the loaded values stay
    (the fp32 master took them), and training from them equals training a fresh copy."""
    net = _net()
    extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    engine, opt, *_ = zero.initialize(model=net, config=_config(stage, **extra))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    engine.backward(F.mse_loss(engine(x.to(net[0].weight.dtype)).float(), y))
    engine.step()
    torch.manual_seed(1)
    new = {k: torch.randn_like(v, dtype=torch.float32) for k, v in _net().state_dict().items()}
    net.load_state_dict(new)
    for group in opt.param_groups:
        group["lr"] = 0.0
    engine.backward(F.mse_loss(engine(x.to(net[0].weight.dtype)).float(), y))
    engine.step()
    with zero.GatheredParameters(list(net.parameters())):
        got = {k: v.detach().float().clone() for k, v in net.state_dict().items()}
    masters = [s["master"] for s in shard_state(opt)]
    return max((got[k] - new[k]).abs().max().item() for k in new), masters


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_load_state_dict_after_initialize_is_kept(dist_run, stage, dtype):
    results = dist_run(2, load_after_initialize, stage, dtype)
    for error, _ in results:
        assert error <= (4e-3 if dtype == "bf16" else 0.0), error  # bf16: the parameters' rounding only


def load_a_wrong_shape() -> str:
    net = _net()
    zero.initialize(model=net, config=_config(3))  # 2 ranks: the parameters are released, .data empty
    bad = copy.deepcopy(_net().state_dict())
    bad["0.weight"] = torch.zeros(3, 3)
    try:
        net.load_state_dict(bad)
        return "loaded"
    except RuntimeError as exc:
        return str(exc)


def test_a_shape_mismatch_in_load_state_dict_names_the_real_shape(dist_run):
    for message in dist_run(2, load_a_wrong_shape):
        assert ("size mismatch for 0.weight: copying a param with shape torch.Size([3, 3]) from checkpoint, the "
                "shape in current model is torch.Size([16, 8])") in message, message


def test_questionable_but_legal_use_warns():
    net = _net()
    net[0].half()
    with pytest.warns(UserWarning, match=r"2 trainable parameter\(s\) are torch.float16 \(first: '0.weight'\) but "
                                         r"the config trains in torch.float32"):
        engine, *_ = zero.initialize(model=net, config=_config(2))
    with pytest.warns(UserWarning, match=r"optimizer step 1 comes after no backward pass: it applies weight decay "
                                         r"and Adam's momentum without new gradients. Call loss.backward\(\) or "
                                         r"engine.backward\(loss\)"):
        engine.step()
    import warnings

    with warnings.catch_warnings():  # no warning for legitimate patterns with extra backward passes
        warnings.simplefilter("error")
        for stage in (1, 0):
            quiet, *_ = zero.initialize(model=_net(), config=_config(stage))
            x = torch.randn(4, 8)
            with quiet.no_sync():
                quiet.backward(quiet(x).square().mean())
            quiet.backward(quiet(x).square().mean())
            quiet.step()
            loss = quiet(x).square().mean()
            quiet.backward(loss, retain_graph=True)
            quiet.backward(loss)
            quiet.step()
    with pytest.warns(UserWarning, match=r"Adam eps is 0: an element whose gradient is 0"):
        zero.initialize(model=_net(), config={**_config(2), "optimizer": {"type": "AdamW", "params": {"eps": 0}}})
    bad = [{"params": list(_net().parameters()), "lr": float("nan")}]
    with pytest.raises(ValueError, match=r"param group 0 has lr=nan.*Check model_parameters"):
        zero.initialize(model=_net(), model_parameters=bad, config=_config(2))


def edit_in_place(stage: int):
    """Halve a weight in place between steps (lr 0): 16-bit stages 1/2 and a gathered (persistent)
    stage-3 parameter keep the edit; a released stage-3 parameter raises at the step."""
    net = _net()
    zc = {"stage3_param_persistence_threshold": 100} if stage == 3 else {}  # 2.bias (4) stays whole
    engine, opt, *_ = zero.initialize(model=net, config={**_config(stage, bf16={"enabled": True}),
                                                        "zero_optimization": {"stage": stage, **zc}})
    for group in opt.param_groups:
        group["lr"] = 0.0
    with zero.GatheredParameters([net[2].bias]):
        expected = net[2].bias.detach().float() * 0.5
    with torch.no_grad():
        net[2].bias.mul_(0.5)
    x = torch.randn(4, 8).bfloat16()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    with zero.GatheredParameters([net[2].bias]):
        kept = torch.equal(net[2].bias.detach().float(), expected)
    if stage < 3:
        return kept, None
    with torch.no_grad():
        net[0].weight.mul_(0.5)  # released: its .data is empty
    engine.backward(engine(x).float().square().mean())
    try:
        engine.step()
        return kept, "no error"
    except RuntimeError as exc:
        return kept, str(exc)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_in_place_edits_between_steps_are_kept_or_refused(dist_run, stage):
    for kept, message in dist_run(2, edit_in_place, stage):
        assert kept
        if stage == 3:
            assert message.startswith("parameter '0.weight' was changed in place while ZeRO-3 held only this rank's "
                                      "shard of it"), message


def test_a_step_checks_the_hyperparameters_and_takes_in_place_edits_once():
    engine, *_ = zero.initialize(model=_net(), config=_config(2))
    calls = []
    for owner, name in ((engine.optimizer, "check_hyperparameters"), (engine.optimizer.storage, "adopt_edits")):
        original = getattr(owner, name)
        setattr(owner, name, lambda original=original, name=name: (calls.append(name), original())[1])
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
    assert sorted(calls) == ["adopt_edits", "check_hyperparameters"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_pickled_or_deep_copied_model_is_plain_torch_and_leaves_the_engine_alone(stage):
    """torch.save(model) of a trained model, or a deepcopy for an EMA copy: the copy carries no
    optimizer state, loads state dicts and trains as plain torch, and the engine does not notice."""
    import io
    import pickle

    def saved_bytes(model: nn.Module) -> int:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        return len(buffer.getvalue())

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    plain = saved_bytes(net)  # fp32
    engine, *_ = zero.initialize(model=net, config=_config(stage, bf16={"enabled": True}))
    engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
    engine.step()
    assert saved_bytes(net) < 0.75 * plain  # its bf16 parameters: no fp32 master, no Adam state
    for copied in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        copied.load_state_dict(net.state_dict())
        copied(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        assert all(p.grad is not None for p in copied.parameters())  # plain torch: the gradients stay
    assert engine.progress.backwards == 0
    engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
    engine.step()
    assert engine.global_steps == 2

"""Every optimizer checkpoints: SGD, Lion, Adagrad (the config's) and client torch optimizers keep
their state in the storage as their update rule declares it (see [Note: declared state] in
zero/optim/rules.py), so a run saves, resumes at another world size and stage, and auto-resumes
after a killed rank, ending as the unbroken run (bitwise on the same ranks and stage; to fp32
round-off of the summation order on others)."""
import pytest
import torch
import torch.distributed as dist

import zero
from zero.testing.training import build_model, make_batch

GLOBAL_BATCH = 12  # divides 1, 2, 3 and 4 ranks: every world size trains the same samples
OPTIMIZERS = {  # the config's types with settings that exercise torch's first-step initialisation
    "SGD": {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1,
                                                    "weight_decay": 0.01}}},
    "Lion": {"optimizer": {"type": "Lion", "params": {"lr": 3e-3, "weight_decay": 0.1}}},
    "Adagrad": {"optimizer": {"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.1,
                                                            "initial_accumulator_value": 0.1}}},
    "client RMSprop": {},  # initialize(optimizer=torch.optim.RMSprop(...)): step, square_avg, momentum, grad_avg
}


def _client(kind: str, params):
    if kind == "torch Adagrad":  # `differentiable` keeps it off zero's native Adagrad: torch's own step
        return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.1, initial_accumulator_value=0.1, differentiable=True)
    return torch.optim.RMSprop(params, lr=0.01, momentum=0.5, centered=True) if kind == "client RMSprop" else None


def _engine(kind: str, stage: int, offload: bool = False):
    torch.manual_seed(0)
    model = build_model("mlp")
    world = dist.get_world_size()
    zc = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    if stage == 3:
        zc.update(stage3_param_persistence_threshold=20, stage3_module_granularity_threshold=300)
    engine, *_ = zero.initialize(model=model, optimizer=_client(kind, model.parameters()), config={
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_clipping": 1.0, "zero_optimization": zc,
        **OPTIMIZERS.get(kind, {})})
    return engine, model


def _train(engine, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    for step in steps:
        x, y = make_batch("mlp", GLOBAL_BATCH, torch.Generator().manual_seed(step))
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()


def _params(model) -> list[torch.Tensor]:
    with zero.GatheredParameters(list(model.parameters())):
        return [p.detach().float().clone() for p in model.parameters()]


def run(kind: str, stage: int, directory: str, part: str, offload: bool = False) -> list[torch.Tensor]:
    """"whole": 4 steps; "first half": 2 steps, saved; "second half": loaded, 2 more steps."""
    engine, model = _engine(kind, stage, offload)
    if part == "second half":
        engine.load_checkpoint(directory)
        assert engine.global_steps == 2
    _train(engine, range(2) if part == "first half" else range(2, 4) if part == "second half" else range(4))
    if part == "first half":
        engine.save_checkpoint(directory)
    return _params(model)


def _error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_every_optimizer_resumes_at_another_world_size_and_stage_as_the_unbroken_run(dist_run, tmp_path, kind):
    whole = dist_run(2, run, kind, 1, None, "whole")[0]
    dist_run(2, run, kind, 2, str(tmp_path), "first half")  # saved by stage 2 on two ranks
    same = dist_run(2, run, kind, 2, str(tmp_path), "second half")[0]
    assert all(torch.equal(a, b) for a, b in zip(same, whole)), (kind, _error(same, whole))  # bitwise
    for world, stage in ((3, 3), (1, 0)):
        resumed = dist_run(world, run, kind, stage, str(tmp_path), "second half")[0]
        assert _error(resumed, whole) < 1e-6, (kind, world, stage, _error(resumed, whole))  # summation order only


def test_zeros_native_adagrad_and_torchs_share_their_state_through_checkpoints(dist_run, tmp_path):
    """zero's native host Adagrad (offloaded) and torch's Adagrad keep the same state under the same
    names ("sum", "step"): a checkpoint of one loads into the other, either way."""
    whole = dist_run(2, run, "Adagrad", 3, None, "whole", True)[0]
    dist_run(2, run, "Adagrad", 3, str(tmp_path / "native"), "first half", True)
    resumed = dist_run(2, run, "torch Adagrad", 1, str(tmp_path / "native"), "second half")[0]
    assert _error(resumed, whole) < 1e-6, _error(resumed, whole)
    dist_run(2, run, "torch Adagrad", 1, str(tmp_path / "torch"), "first half")
    resumed = dist_run(2, run, "Adagrad", 3, str(tmp_path / "torch"), "second half", True)[0]
    assert _error(resumed, whole) < 1e-6, _error(resumed, whole)


def _state_names(kind: str) -> dict:
    engine, model = _engine(kind, 2)
    _train(engine, range(1))
    from zero.deepspeed.utils import safe_get_full_optimizer_state

    names = engine.optimizer.state_names(model.layers[0].weight)
    out = {name: tuple(safe_get_full_optimizer_state(model.layers[0].weight, name).shape) for name in names}
    with pytest.raises(ValueError, match="which keeps"):
        safe_get_full_optimizer_state(model.layers[0].weight, "no_such_state")
    return {"names": names, "shapes": out, "memory": engine.memory_report()["optimizer_states"]}


def test_each_optimizer_declares_its_state_and_keeps_only_that(dist_run):
    """No Adam moments for SGD or Lion: the storage holds exactly the declared state, which the
    accessors read under torch's names."""
    got = {kind: dist_run(2, _state_names, kind)[0] for kind in OPTIMIZERS}
    assert got["SGD"]["names"] == ("momentum_buffer",)
    assert got["Lion"]["names"] == ("exp_avg",)
    assert got["Adagrad"]["names"] == ("sum",)
    assert got["client RMSprop"]["names"] == ("grad_avg", "momentum_buffer", "square_avg")
    shape = tuple(build_model("mlp").layers[0].weight.shape)
    assert all(s == shape for g in got.values() for s in g["shapes"].values())
    one = got["SGD"]["memory"]  # one fp32 value per element of this rank's shard (+ padding)
    assert got["Lion"]["memory"] == one and got["client RMSprop"]["memory"] >= 3 * one
    assert one < got["Adagrad"]["memory"] <= one + 64  # the sum, and a step count per slot

"""Any element-wise torch optimizer as the client optimizer runs on each rank's shards under ZeRO 1-3
and equals the same optimizer on the whole model in one process; whole-tensor optimizers are refused."""
import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from zero.optim.lion import Lion
from zero.testing.training import build_model, make_batch, relative_error

OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "lion": lambda ps: Lion(ps, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
    "adagrad-decay": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.1, initial_accumulator_value=0.1),
}


def train_with(name: str, stage: int, offload: bool = False):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model("mlp")
    reference = copy.deepcopy(model)
    zc = {"stage": stage}
    if stage == 3:
        zc.update(stage3_param_persistence_threshold=20, stage3_module_granularity_threshold=300)
    if offload:  # the optimizer's own update on the host shards
        zc["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zero.initialize(model=model, optimizer=OPTIMIZERS[name](model.parameters()), config={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": zc})
    ref_opt = OPTIMIZERS[name](reference.parameters())
    for step in range(5):
        x, y = make_batch("mlp", 4 * world, torch.Generator().manual_seed(step))
        engine.backward(engine(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
        engine.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
    return relative_error(model, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_element_wise_optimizers_on_shards_equal_the_whole_model(dist_run, name, stage):
    for error in dist_run(2, train_with, name, stage):
        # fp32 round-off of the averaged gradient; RMSprop's normalisation amplifies it (as Adam's does)
        assert error < (1e-5 if name == "rmsprop" else 1e-6), error


def _offloaded(stages) -> dict:
    return {(name, stage): train_with(name, stage, offload=True) for name in OPTIMIZERS for stage in stages}


def test_optimizer_offload_steps_any_optimizer_on_the_host_with_the_same_numbers(dist_run):
    """DeepSpeed offloads Adam, Adagrad and Lion, FSDP2 any torch optimizer: zero too (Lion and Adagrad
    with zero's native CPU kernels, the others with their own torch update on the host shards)."""
    for errors in dist_run(2, _offloaded, (0, 1, 2, 3)):
        for (name, stage), error in errors.items():
            assert error < (1e-5 if name == "rmsprop" else 1e-6), (name, stage, error)


def test_whole_tensor_optimizers_are_refused_and_unknown_ones_warn():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"got a Adafactor, which zero cannot run on partitioned shards: its "
                                         r"factored second moments need whole matrices"):
        zero.initialize(model=model, optimizer=torch.optim.Adafactor(model.parameters()),
                        config={"train_micro_batch_size_per_gpu": 1})

    class SignSGD(torch.optim.Optimizer):  # a user's own optimizer: zero cannot know what it does
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])

    with pytest.warns(UserWarning, match=r"SignSGD is run on each rank's shards as if it were element-wise"):
        engine, *_ = zero.initialize(model=model, optimizer=SignSGD(model.parameters(), lr=0.1),
                                     config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}})
    before = model.weight.detach().clone()
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    assert torch.allclose(model.weight, before - 0.1)  # sign of a positive gradient: each weight moves by lr
    with tempfile.TemporaryDirectory() as directory:  # it keeps no state: its checkpoint holds the rest
        engine.save_checkpoint(directory)
        assert engine.load_checkpoint(directory)[0].endswith("global_step1")


CONFIG_TYPES = {
    "SGD": ({"lr": 0.05, "momentum": 0.9}, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "Adagrad": ({"lr": 0.05}, lambda ps: torch.optim.Adagrad(ps, lr=0.05)),
    "Lion": ({"lr": 0.001, "weight_decay": 0.1}, lambda ps: __import__("zero.optim").optim.Lion(
        ps, lr=0.001, weight_decay=0.1)),
}


def config_type(kind: str, stage: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model("mlp")
    reference = copy.deepcopy(model)
    params, make = CONFIG_TYPES[kind]
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": kind.lower(), "params": params},
        "zero_optimization": {"stage": stage}})
    ref_opt = make(reference.parameters())
    for step in range(5):
        x, y = make_batch("mlp", 4 * world, torch.Generator().manual_seed(step))
        engine.backward(engine(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
        engine.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
    return relative_error(model, reference)


@pytest.mark.parametrize("kind", list(CONFIG_TYPES))
def test_config_optimizer_types_sgd_adagrad_lion(dist_run, kind):
    for stage in (1, 3):
        for error in dist_run(2, config_type, kind, stage):
            assert error < 1e-6, (kind, stage, error)
    with pytest.raises(zero.ConfigError, match="'Lamb' cannot run on ZeRO's partitioned shards: LAMB's trust ratio"):
        zero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb"}})


def test_accessors_answer_for_client_optimizers():
    import zero.deepspeed as deepspeed

    model = nn.Linear(4, 4)
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                 config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}})
    assert engine.get_mom() == [0.5]
    hyper = engine.optimizer.client.hyperparameters(engine.optimizer.param_groups[0])
    assert hyper.keys() == torch.optim.SGD(model.parameters(), lr=0.1).defaults.keys()
    assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(model.weight), model.weight.detach())
    with pytest.raises(ValueError, match="'exp_avg': this parameter is updated by SGD, which keeps 'momentum_buffer'"):
        deepspeed.utils.safe_get_full_optimizer_state(model.weight, "exp_avg")
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()  # SGD's momentum is its first gradient
    assert torch.equal(deepspeed.utils.safe_get_full_optimizer_state(model.weight, "momentum_buffer"),
                       torch.ones(4, 1).expand(4, 4))
    import zero as not_deepspeed

    with pytest.raises(AttributeError, match=r"zero.add_config_arguments does not exist: .* use `import zero.deepspeed"):
        not_deepspeed.add_config_arguments  # noqa: B018
    with pytest.raises(AttributeError, match=r"zero.comm does not exist: .* use `import zero.deepspeed"):
        not_deepspeed.comm.get_rank  # noqa: B018

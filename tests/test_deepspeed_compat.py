"""A DeepSpeed-style script, written from DeepSpeed's documented API, runs on zero with one changed
import and matches a single-process torch reference; DeepSpeed names zero lacks explain themselves."""
import argparse

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero.deepspeed as deepspeed

CONFIG = """{
  // DeepSpeed reads config files as hjson: comments and trailing commas are fine
  "train_micro_batch_size_per_gpu": 4,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
  "zero_optimization": {"stage": STAGE, "stage3_param_persistence_threshold": 0,},
}"""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = deepspeed.checkpointing.checkpoint(lambda t: torch.tanh(self.mid(t)), h)  # activation checkpointing
        return F.mse_loss(self.out(h), y)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def deepspeed_script(stage: int, path: str):
    """What a DeepSpeed user writes (only the import differs)."""
    parser = argparse.ArgumentParser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config, enabled=stage == 3):
        model = Net()
    with deepspeed.zero.GatheredParameters(model.out.weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.out.weight.mul_(0.5)  # a custom initialisation, rank 0's wins
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.global_rank == rank and engine.world_size == world and engine.loss_scale == 1.0
    applied = []
    for step in range(4):
        x, y = _batch(step)
        m = x.shape[0] // world
        loss = engine(x[rank * m : (rank + 1) * m], y[rank * m : (rank + 1) * m])
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    deepspeed.comm.barrier()
    full = {n: deepspeed.utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    exp_avg = deepspeed.utils.safe_get_full_optimizer_state(model.mid.weight, "exp_avg")
    return full, exp_avg, applied, engine.get_mom()


def _reference():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.out.weight.mul_(0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for step in range(4):
        opt.zero_grad()
        model(*_batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model, opt


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_script_runs_unchanged_but_for_the_import(dist_run, tmp_path, stage):
    path = tmp_path / "ds_config.json"
    path.write_text(CONFIG.replace("STAGE", str(stage)))
    reference, opt = _reference()
    for full, exp_avg, applied, mom in dist_run(2, deepspeed_script, stage, str(path)):
        for name, p in reference.named_parameters():
            assert torch.allclose(full[name], p.detach(), rtol=1e-5, atol=1e-6), name
        assert torch.allclose(exp_avg, opt.state[reference.mid.weight]["exp_avg"], rtol=1e-5, atol=1e-7)
        assert applied == [True] * 4 and mom == [(0.9, 0.999)]


@pytest.mark.parametrize("name,says", [
    ("init_inference", "inference engines are not implemented"),
    ("ops.DeepSpeedTransformerLayer", "DeepSpeed's fused transformer layers are not implemented"),
    ("checkpointing.model_parallel_cuda_manual_seed", "keep no separate model-parallel generator"),
])
def test_deepspeed_names_zero_lacks_import_and_say_what_to_use_when_used(name, says):
    """A name DeepSpeed has and zero lacks imports (scripts import more than they use) and raises
    on use; a name DeepSpeed does not have fails at once."""
    import importlib

    module, last = name.rsplit(".", 1) if "." in name else ("", name)
    owner = importlib.import_module("zero.deepspeed" + ("." + module if module else ""))
    stand_in = getattr(owner, last)  # `from deepspeed.pipe import PipelineModule` works
    assert not isinstance(object(), stand_in)
    with pytest.raises(deepspeed.NotAvailableError, match=f"deepspeed.{name} is not available in zero: .*{says}"):
        stand_in()

    class Sub(stand_in):  # a script that subclasses PipelineModule fails when it builds one
        pass

    with pytest.raises(deepspeed.NotAvailableError, match=says):
        Sub(layers=[])
    with pytest.raises(deepspeed.NotAvailableError, match=says):
        _ = stand_in.some_attribute
    assert not hasattr(stand_in, "forward") and getattr(owner, last) is stand_in  # probing works; one object
    with pytest.raises(AttributeError, match=r"deepspeed.no_such_thing is not part of zero's DeepSpeed compat"):
        _ = deepspeed.no_such_thing
    with pytest.raises(ImportError):
        from zero.deepspeed.runtime import no_such_module  # noqa: F401
    assert deepspeed.ops.adam.DeepSpeedCPUAdam(nn.Linear(2, 2).parameters(), lr=0.1).defaults["lr"] == 0.1


def test_the_packages_of_a_feature_zero_lacks_raise_import_error_with_the_reason():
    """`try: from deepspeed.moe.layer import MoE` takes the except branch, with the reason (see [Note:
    the feature table] in zero/features.py); a name zero lacks inside a module zero has is a stand-in."""
    with pytest.raises(ImportError, match="deepspeed.moe is not available in zero: expert parallelism is not impl"):
        from zero.deepspeed.moe import layer  # noqa: F401
    with pytest.raises(ImportError, match="deepspeed.moe is not available in zero"):
        from zero.deepspeed.moe.utils import is_moe_param  # noqa: F401
    assert not hasattr(deepspeed, "moe") and not hasattr(deepspeed, "profiling")
    with pytest.raises(ImportError, match="1-bit and 0/1 Adam run inside the engine"):
        from zero.deepspeed.runtime.fp16.onebit.adam import OnebitAdam  # noqa: F401


def test_more_deepspeed_names_libraries_use():
    """What accelerate and transformers import beyond the issue's list."""
    from datetime import timedelta

    from zero.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from zero.deepspeed.ops.lion import DeepSpeedCPULion
    from zero.deepspeed.ops.op_builder import AsyncIOBuilder
    from zero.deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint
    from zero.deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from zero.deepspeed.runtime.zero.config import ZeroStageEnum
    from zero.optim.lion import Lion

    assert "WarmupLR" in VALID_LR_SCHEDULES and checkpoint is deepspeed.checkpointing.checkpoint
    base = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [base[:2]], "b": 3})
    assert cloned["a"][0].untyped_storage().nbytes() == 8 and cloned["b"] == 3 and torch.equal(cloned["a"][0], base[:2])
    assert isinstance(DeepSpeedCPULion(nn.Linear(2, 2).parameters(), lr=0.1), Lion) and ZeroStageEnum.weights == 3
    builder = AsyncIOBuilder()
    assert builder.name == "async_io" and not builder.is_compatible()
    with pytest.raises(deepspeed.NotAvailableError, match="zero has no async_io op"):
        builder.load()
    with pytest.raises(ValueError, match="without init_method, and no launcher set MASTER_ADDR"):
        deepspeed.comm.init_distributed(dist_backend="gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timedelta(seconds=5))  # no launcher


def test_leaf_marks_after_initialize_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "optimizer": {"type": "Adam"}})
    with pytest.raises(RuntimeError, match="mark leaf modules before zero.initialize"):
        deepspeed.utils.set_z3_leaf_modules(model, [nn.Sequential])
    with pytest.raises(RuntimeError, match="mark leaf modules before zero.initialize"):
        deepspeed.utils.unset_z3_leaf_modules(model, [nn.Sequential])
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    assert engine._zero3_consolidated_16bit_state_dict().keys() == model.state_dict().keys()


def test_cpu_adam_with_low_precision_state_keeps_moments_in_the_training_dtype():
    """DeepSpeedCPUAdam(fp32_optimizer_states=False) keeps Adam's moments in the parameters' dtype in
    DeepSpeed; under zero.initialize that is optimizer.params.state_dtype = the training dtype (the
    engine side is tests/test_adam_formats.py)."""
    params = list(nn.Linear(2, 2).parameters())
    low = deepspeed.ops.adam.DeepSpeedCPUAdam(params, lr=0.1, fp32_optimizer_states=False)
    assert low.zero_state_dtype == "model" and low.defaults["lr"] == 0.1
    full = deepspeed.ops.adam.DeepSpeedCPUAdam(params, lr=0.1, fp32_optimizer_states=True)
    assert not hasattr(full, "zero_state_dtype") and full.defaults["lr"] == 0.1


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_fused_adam_set_grad_none_decides_what_zero_grad_leaves(set_grad_none):
    """FusedAdam(set_grad_none=...): zero_grad() sets the gradients to None, or zeroes them in place."""
    layer = nn.Linear(2, 2)
    opt = deepspeed.ops.adam.FusedAdam(layer.parameters(), lr=0.1, set_grad_none=set_grad_none)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 0.1
    layer(torch.ones(1, 2)).sum().backward()
    grad = layer.weight.grad
    opt.zero_grad()
    if set_grad_none:
        assert layer.weight.grad is None
    else:
        assert layer.weight.grad is grad and not grad.any()
    layer(torch.ones(1, 2)).sum().backward()
    opt.zero_grad(set_to_none=True)  # an explicit argument wins
    assert layer.weight.grad is None


def test_deepspeed_zero_is_deepspeed_runtime_zero():
    """One module under both paths, as in DeepSpeed (`from .runtime import zero`), with DeepSpeed
    0.19.8's names of it: each is zero's, or a stand-in that says why when used."""
    import importlib
    import sys

    import zero.deepspeed.runtime.zero
    import zero.deepspeed.zero
    from zero.deepspeed._missing import _StandIn
    from zero.deepspeed.zero import Init, ZeroParamStatus, set_z3_leaf_modules, unwrap_model_for_generation  # noqa: F401

    module = zero.deepspeed.runtime.zero
    assert zero.deepspeed.zero is module and deepspeed.zero is module and deepspeed.runtime.zero is module
    assert sys.modules["zero.deepspeed.zero"] is module
    for name in ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
                 "ZeroParamStatus", "unwrap_model_for_generation", "set_z3_leaf_modules"):
        assert not isinstance(getattr(module, name), _StandIn), name  # zero's own
    for name in ("ZeroParamType", "DeepSpeedTensorOverride", "TiledLinear", "TiledLinearReturnBias"):
        with pytest.raises(deepspeed.NotAvailableError, match=f"deepspeed.runtime.zero.{name} is not available"):
            getattr(deepspeed.zero, name)()
    from zero.deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload  # stage 3's runtime, for isinstance

    assert deepspeed.zero.DeepSpeedZeRoOffload is DeepSpeedZeRoOffload and not isinstance(object(), DeepSpeedZeRoOffload)
    # a submodule through either path is one module, not a second copy
    via_alias = importlib.import_module("zero.deepspeed.zero.config")
    assert via_alias is importlib.import_module("zero.deepspeed.runtime.zero.config") and via_alias is module.config
    assert via_alias.ZeroStageEnum is zero.deepspeed.runtime.zero.config.ZeroStageEnum
    with pytest.raises(ImportError):
        importlib.import_module("zero.deepspeed.zero.no_such_module")

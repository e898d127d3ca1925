"""Specification of how strictly zero/config/ reads values: JSON types are not converted into one
another, and numbers that would break training later (a zero bucket, an infinite learning rate, a
loss scale of 2**2000) are refused when the config is loaded, naming the key."""
import math
import types
import typing
import warnings

import pytest
import torch

import zero
from zero.config import DEEPSPEED_SCHEDULERS, ConfigError, ConfigWarning, ZeroConfig, load_config
from zero.config.sections import _Section
from zero.lr_schedules import LRRangeTest, OneCycle, WarmupDecayLR, WarmupLR
from zero.testing.models import MLP

BASE = {"train_batch_size": 8}
FP32_MAX = torch.finfo(torch.float32).max
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


def load(extra=None, **kw):
    return load_config({**BASE, **(extra or {})}, **kw)


def issues_of(extra) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load(extra)
    return dict(info.value.issues)


def nested(path: str, value) -> dict:
    out: dict = {}
    node = out
    *heads, last = path.split(".")
    for part in heads:
        node = node.setdefault(part, {})
    node[last] = value
    if path.startswith("optimizer."):
        out["optimizer"]["type"] = "AdamW"
    return out


# ----------------------------------------------------------------------------------- JSON types

def _scalar(annotation):
    """bool, int or float for a key typed X or Optional[X]; None for anything else."""
    if annotation in (bool, int, float):
        return annotation
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):  # list[int] is not an int
        return None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and args[0] in (bool, int, float) else None


def _section(annotation):
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return annotation
    return next((m for m in map(_section, typing.get_args(annotation)) if m is not None), None)


def _typed_keys(cls=ZeroConfig, prefix=""):
    """(DeepSpeed path, bool/int/float, config builder) for every scalar key of every section."""
    for name, field in cls.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        sub = _section(field.annotation)
        if sub is not None:
            yield from _typed_keys(sub, path + ".")
        elif _scalar(field.annotation) is not None:
            yield path, _scalar(field.annotation), lambda v, path=path: nested(path, v)
    if cls is ZeroConfig:
        for schedule, params in DEEPSPEED_SCHEDULERS.items():
            for name, field in params.model_fields.items():
                if _scalar(field.annotation) is not None:
                    yield (f"scheduler.params.{name}", _scalar(field.annotation),
                           lambda v, s=schedule, n=name: {"scheduler": {"type": s, "params": {n: v}}})


EXPECTED = {bool: "expected true or false", int: "expected an integer", float: "expected a number"}
WRONG_TYPE = [pytest.param(path, build, value, f"{EXPECTED[kind]}{shown}", id=f"{path}={value!r}")
              for path, kind, build in _typed_keys()
              for value, shown in ([("false", " (a JSON boolean, without quotes), got 'false'"),
                                    (1, " (a JSON boolean), got 1")] if kind is bool else
                                   [("1", ", got the string '1'"), (True, ", got true")])]


def test_every_bool_int_and_float_key_is_covered():
    kinds = {kind for _, kind, _ in _typed_keys()}
    assert kinds == {bool, int, float} and len(WRONG_TYPE) > 150


@pytest.mark.parametrize("path, build, value, message", WRONG_TYPE)
def test_every_typed_key_refuses_another_json_type(path, build, value, message):
    found = issues_of(build(value))
    assert path in found and found[path].startswith(message), found


@pytest.mark.parametrize("extra, path, message", [
    # C01: a quoted number is not a number, at the top level and in every section
    ({"train_micro_batch_size_per_gpu": "4"}, "train_micro_batch_size_per_gpu",
     "expected an integer, got the string '4' (write numbers without quotes; the only string allowed here is \"auto\")"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "expected a number, got the string '1.0'"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": "5e7"}},
     "zero_optimization.stage3_prefetch_bucket_size", "expected an integer, got the string '5e7'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "3e-4"}}}, "optimizer.params.lr",
     "expected a number, got the string '3e-4'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "100"}}},
     "scheduler.params.warmup_num_steps", "expected an integer, got the string '100'"),
    ({"scheduler": {"type": "StepLR", "params": {"step_size": "10"}}}, "scheduler.params.step_size",
     "expected int for torch.optim.lr_scheduler.StepLR, got '10'"),
    # C03: a boolean is not a number
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu",
     "expected an integer, got true (a JSON boolean is not a number)"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": False}}}, "optimizer.params.weight_decay",
     "expected a number, got false"),
    # C05: the stage is a number too
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage", "expected an integer, got the string '3'"),
    # C07/C08: only true and false are booleans
    ({"fp16": {"enabled": "false"}}, "fp16.enabled", "expected true or false (a JSON boolean, without quotes), got 'false'"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled", "expected true or false (a JSON boolean, without quotes), got 'yes'"),
    ({"bf16": {"enabled": 1}}, "bf16.enabled", "expected true or false (a JSON boolean), got 1"),
    ({"zero_optimization": {"overlap_comm": "true"}}, "zero_optimization.overlap_comm", "expected true or false"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": 0}}},
     "zero_optimization.offload_optimizer.pin_memory", "expected true or false (a JSON boolean), got 0"),
    # floats must be finite everywhere, not only where a field says so
    ({"fp16": {"min_loss_scale": float("inf")}}, "fp16.min_loss_scale", "expected a finite number, got inf"),
    ({"scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": float("nan")}}},
     "scheduler.params.gamma", "expected a finite number, got nan"),
])
def test_json_types_are_not_converted(extra, path, message):
    found = issues_of(extra)
    assert path in found and found[path].startswith(message), found


def test_integral_floats_and_auto_still_work():
    """C06: DeepSpeed configs write sizes as 5e8, so an integral float is an integer; "auto" stays "not given"."""
    cfg = load({"zero_optimization": {"stage": 2.0, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8},
                "train_micro_batch_size_per_gpu": 8.0})
    z = cfg.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size) == (2, 500_000_000, 200_000_000)
    assert type(z.stage) is int and cfg.train_micro_batch_size_per_gpu == 8
    assert "zero_optimization.stage" in issues_of({"zero_optimization": {"stage": 2.5}})  # C02 stays an error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto",
                           "fp16": {"enabled": "auto", "initial_scale_power": "auto"}, "bf16": {"enabled": "auto"},
                           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto",
                                                                        "warmup_num_steps": "auto"}},
                           "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto",
                                                 "overlap_comm": "auto"}})
    assert (cfg.zero_optimization.stage, cfg.optimizer.params.lr, cfg.gradient_clipping) == (0, 1e-3, 0.0)  # C35
    assert cfg.fp16.initial_scale_power == 16 and cfg.scheduler.params.warmup_max_lr is None


# ----------------------------------------------------------------------------------- ranges

@pytest.mark.parametrize("extra, path, message", [
    # C10: a bucket of zero elements
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size",
     "expected a value >= 1 (elements per bucket"),
    ({"zero_optimization": {"stage": 1, "allgather_bucket_size": 0}}, "zero_optimization.allgather_bucket_size",
     "expected a value >= 1 (elements per bucket"),
    # C51: 2**initial_scale_power must be a finite fp32 number
    ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, "fp16.initial_scale_power",
     "expected 0..63: dynamic loss scaling starts at 2**initial_scale_power"),
    ({"fp16": {"enabled": True, "initial_scale_power": 64}}, "fp16.initial_scale_power", "expected 0..63"),
    ({"fp16": {"enabled": True, "loss_scale": 1e300}}, "fp16.loss_scale", "expected a loss scale <= 2**63"),
    # C54: the predivide factor divides, so it is at least 1
    ({"gradient_predivide_factor": 1e-300}, "gradient_predivide_factor", "expected a value >= 1, got 1e-300"),
    ({"gradient_predivide_factor": 0.5}, "gradient_predivide_factor", "expected a value >= 1, got 0.5"),
    ({"gradient_predivide_factor": float("inf")}, "gradient_predivide_factor", "expected a finite number"),
    # C56: a CPU Adam tile is not negative (0 is DeepSpeed's "each parameter alone": tests/test_config.py)
    ({"zero_optimization": {"stage": 2, "sub_group_size": -1, **OFFLOAD}}, "zero_optimization.sub_group_size",
     "expected a value >= 0, got -1"),
    # C60: batch keys below 2**31, given or derived
    ({"train_batch_size": 2**70}, "train_batch_size", "expected a value < 2**31 = 2147483648, got 1180591620717411303424"),
    ({"train_micro_batch_size_per_gpu": 2**31, "train_batch_size": None}, "train_micro_batch_size_per_gpu",
     "expected a value < 2**31"),
    ({"gradient_accumulation_steps": 2**40}, "gradient_accumulation_steps", "expected a value < 2**31"),
    ({"train_batch_size": None, "train_micro_batch_size_per_gpu": 2**20, "gradient_accumulation_steps": 2**20},
     "train_batch_size", "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"
     " = 1048576 * 1048576 * 1 = 1099511627776, expected a value < 2**31"),
    # C22/C23: learning rates are finite and fit a float32, in every schedule and in the optimizer
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("inf")}}}, "scheduler.params.warmup_max_lr",
     "expected a finite number, got inf"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e300}}}, "scheduler.params.warmup_max_lr",
     "expected a learning rate <= 3.40282e+38 (the largest float32), got 1e+300"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e39}}}, "scheduler.params.warmup_min_lr",
     "expected a learning rate <= 3.40282e+38"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 5,
                                                        "warmup_max_lr": 1e300}}},
     "scheduler.params.warmup_max_lr", "expected a learning rate <= 3.40282e+38"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": float("inf")}}},
     "scheduler.params.cycle_max_lr", "expected a finite number"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e300, "cycle_max_lr": 1}}},
     "scheduler.params.cycle_min_lr", "expected a learning rate <= 3.40282e+38"),
    ({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e300}}},
     "scheduler.params.lr_range_test_min_lr", "expected a learning rate <= 3.40282e+38"),
    ({"scheduler": {"type": "CyclicLR", "params": {"base_lr": 1e-3, "max_lr": 1e300}}}, "scheduler.params.max_lr",
     "expected a learning rate in [0, 3.40282e+38]"),
    ({"scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 10, "eta_min": -1.0}}},
     "scheduler.params.eta_min", "expected a learning rate in [0, 3.40282e+38]"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e300}}}, "optimizer.params.lr",
     "expected a learning rate <= 3.40282e+38"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "optimizer.params.lr", "expected a finite number"),
    # integers too large for any size field
    ({"zero_optimization": {"reduce_bucket_size": 1e30}}, "zero_optimization.reduce_bucket_size",
     "expected an integer that fits in 64 bits"),
])
def test_values_that_would_break_training_are_refused(extra, path, message):
    found = issues_of(extra)
    assert path in found and found[path].startswith(message), found


def test_edge_values_with_a_meaning_stay_accepted():
    """C58 and the other ends of the new ranges."""
    z = load({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}).zero_optimization
    assert (z.max_live_parameters, z.param_persistence_threshold, z.prefetch_bucket_size) == (0, 0, 0)
    assert load({"fp16": {"enabled": True, "initial_scale_power": 63}}).fp16.initial_scale_power == 63
    assert load({"fp16": {"enabled": True, "initial_scale_power": 0}}).fp16.initial_scale_power == 0
    assert load({"gradient_predivide_factor": 1}).gradient_predivide_factor == 1.0
    assert load({"gradient_predivide_factor": 64.0}).gradient_predivide_factor == 64.0
    assert load_config({"train_batch_size": 2**31 - 1}).train_batch_size == 2**31 - 1
    assert load({"optimizer": {"type": "AdamW", "params": {"lr": FP32_MAX}}}).optimizer.params.lr == FP32_MAX
    assert load({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1}}).zero_optimization.reduce_bucket_size == 1
    with pytest.warns(ConfigWarning, match="sub_group_size = 0 has no effect"):  # not read without offload
        load({"zero_optimization": {"stage": 3, "sub_group_size": 0}})


def test_tiny_sub_group_size_with_offload_warns_about_the_per_tile_overhead():
    with pytest.warns(ConfigWarning, match=r"sub_group_size = 10 makes CPU Adam work on tiles of 10 elements; "
                                           r"each tile has a fixed overhead"):
        cfg = load({"zero_optimization": {"stage": 2, "sub_group_size": 10, **OFFLOAD}})
    assert cfg.zero_optimization.sub_group_size == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for size in (1000, 1e9):
            load({"zero_optimization": {"stage": 2, "sub_group_size": size, **OFFLOAD}})


# ----------------------------------------------------------------------------------- where it is raised

@pytest.mark.parametrize("config, message", [
    ({"train_micro_batch_size_per_gpu": "4"}, r"train_micro_batch_size_per_gpu: expected an integer, got the string '4'"),
    ({"train_batch_size": 4, "fp16": {"enabled": True, "initial_scale_power": 2000}}, r"fp16\.initial_scale_power"),
    ({"train_batch_size": 4, "bf16": {"enabled": "yes"}}, r"bf16\.enabled: expected true or false"),
    ({"train_batch_size": 4, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e300}}},
     r"scheduler\.params\.warmup_max_lr"),
])
def test_initialize_raises_config_error_before_touching_the_model(config, message):
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=message):
        zero.initialize(model=model, config={"optimizer": {"type": "AdamW"}, **config})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _sgd(lr=0.5):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("build, pattern", [
    (lambda opt: WarmupLR(opt, warmup_max_lr=math.inf), r"WarmupLR: warmup_max_lr must be a finite learning rate"),
    (lambda opt: WarmupLR(opt, warmup_max_lr=1e300), r"WarmupLR: warmup_max_lr must be a finite learning rate in \[0, "
                                                      r"3\.40282e\+38\] \(the largest float32\), got 1e\+300"),
    (lambda opt: WarmupLR(opt, warmup_min_lr=-0.1), r"WarmupLR: warmup_min_lr must be a finite learning rate"),
    (lambda opt: WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=5, warmup_max_lr=math.nan),
     r"WarmupDecayLR: warmup_max_lr must be a finite"),
    (lambda opt: OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1e300), r"OneCycle: cycle_max_lr must be a finite"),
    (lambda opt: LRRangeTest(opt, lr_range_test_min_lr=[math.inf]), r"LRRangeTest: lr_range_test_min_lr\[0\] must be"),
])
def test_schedulers_built_directly_refuse_learning_rates_fp32_cannot_hold(build, pattern):
    opt = _sgd()
    with pytest.raises(ValueError, match=pattern):
        build(opt)
    assert opt.param_groups[0]["lr"] == 0.5

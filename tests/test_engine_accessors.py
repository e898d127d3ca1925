"""Specification of zero/deepspeed/engine_accessors.py and zero/deepspeed/runtime/config.py: DeepSpeedEngine's
config accessors and DeepSpeed's config objects give DeepSpeed's values for the same config, read
from zero's config (its validation, errors and batch rule).

The values are checked by hand below; where DeepSpeed is installed, every accessor is also compared
with DeepSpeed's own accessor over DeepSpeed's own DeepSpeedConfig of the same dict."""
import copy
import inspect
import json
import os
import warnings

import pytest
import torch
from pydantic import BaseModel

import zero.deepspeed as deepspeed
from zero.config import ConfigError, ConfigWarning, load_config
from zero.config.errors import DeepSpeedConfigError
from zero.deepspeed.engine_accessors import ConfigAccessors
from zero.deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum
from zero.deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum, get_zero_config
from zero.deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)
from zero.testing.models import MLP

# Every config gives gradient_clipping and offload pin_memory: their defaults differ between DeepSpeed
# versions (0.19 clips at 1.0 and pins by default; zero's config follows 0.17: 0 and false).
CONFIGS = {
    "stage0_fp32": {"train_batch_size": 8, "gradient_clipping": 0.0},
    "stage1_fp16_dynamic": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 1.0,
        "steps_per_print": 10, "wall_clock_breakdown": True, "prescale_gradients": True,
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100, "hysteresis": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
    },
    "stage2_bf16_offload": {
        "train_batch_size": 4, "gradient_clipping": 0.5, "communication_data_type": "fp32",
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "allgather_bucket_size": 5e8,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    },
    "stage3_fp16_static_offload": {
        "train_batch_size": 4, "gradient_clipping": 2.0,
        "fp16": {"enabled": True, "loss_scale": 128},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10, "stage3_prefetch_bucket_size": 1000,
                              "stage3_max_live_parameters": 2000, "stage3_gather_16bit_weights_on_model_save": True,
                              "sub_group_size": 100000,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": False}},
    },
    "stage2_sgd": {
        "train_batch_size": 4, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 2},
    },
}


class _Holder(ConfigAccessors):
    """The accessors over a config alone (and what an engine would hold beside it)."""

    def __init__(self, config, comm=None, client_optimizer=None):
        self.config, self.comm, self.client_optimizer = config, comm, client_optimizer


def accessors(engine):
    """The engine itself when it is the DeepSpeedEngine facade; otherwise the mixin over its config."""
    return engine if isinstance(engine, ConfigAccessors) else _Holder(engine.config, engine.comm)


@pytest.fixture(scope="module")
def engines():
    built = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, config in CONFIGS.items():
            torch.manual_seed(0)
            built[name] = deepspeed.initialize(model=MLP(), config=copy.deepcopy(config))[0]  # the facade's engine
    return built


# ----------------------------------------------------------------------------------- by hand

def test_stage_accessors_follow_zero_optimization_stage(engines):
    for name, stage in (("stage0_fp32", 0), ("stage1_fp16_dynamic", 1), ("stage2_bf16_offload", 2),
                        ("stage3_fp16_static_offload", 3)):
        e = accessors(engines[name])
        assert e.zero_optimization_stage() == stage == ZeroStageEnum(stage)
        assert e.zero_optimization() is (stage > 0)
        assert e.zero_optimization_partition_gradients() is (stage >= 2)
        assert e.zero_optimization_partition_weights() is e.is_first_weights_partition_group() is (stage == 3)
        assert e.zero_overlap_comm() is (stage >= 2)  # DeepSpeed's default is stage 3 only; stage 2 sets it
        assert e._config.zero_enabled is (stage > 0) and e._config.zero_config.stage == stage


def test_batch_and_training_loop_accessors(engines):
    e = accessors(engines["stage1_fp16_dynamic"])
    assert (e.train_batch_size(), e.train_micro_batch_size_per_gpu(), e.gradient_accumulation_steps()) == (6, 2, 3)
    assert e.steps_per_print() == 10 and e.wall_clock_breakdown() is True and e.memory_breakdown() is False
    assert e.gradient_clipping() == 1.0 and e.postscale_gradients() is False and e.gradient_predivide_factor() == 1.0
    assert e.managed_gradient_accumulation() is True and e.dump_state() is False and e.dataloader_drop_last() is False
    e0 = accessors(engines["stage0_fp32"])
    assert (e0.train_batch_size(), e0.train_micro_batch_size_per_gpu(), e0.gradient_accumulation_steps()) == (8, 8, 1)
    assert e0.steps_per_print() is None and e0.gradient_clipping() == 0.0 and e0.postscale_gradients() is True


def test_precision_accessors(engines):
    fp16 = accessors(engines["stage1_fp16_dynamic"])
    assert fp16.fp16_enabled() is True and fp16.bfloat16_enabled() is False and fp16.fp16_auto_cast() is False
    assert fp16.dynamic_loss_scale() is True and fp16.initial_dynamic_scale() == 2**12
    assert fp16.dynamic_loss_scale_args() == {"init_scale": 2**12, "scale_window": 100, "delayed_shift": 3,
                                              "consecutive_hysteresis": False, "min_scale": 1}
    assert fp16.communication_data_type == torch.float16
    assert fp16.get_data_types() == (torch.float16, torch.float16)
    static = accessors(engines["stage3_fp16_static_offload"])
    assert static.dynamic_loss_scale() is False and static._config.float16_config.loss_scale == 128
    bf16 = accessors(engines["stage2_bf16_offload"])
    assert bf16.bfloat16_enabled() is True and bf16.fp16_enabled() is False
    assert bf16.communication_data_type == torch.float32  # given explicitly
    assert bf16.get_data_types() == (torch.bfloat16, torch.bfloat16)
    fp32 = accessors(engines["stage0_fp32"])
    assert fp32.communication_data_type == torch.float32 and fp32.get_data_types() == (torch.float32, torch.float32)
    for e in (fp16, bf16, fp32):
        assert not (e.fp16_master_weights_and_gradients() or e.bf16_master_weights_and_gradients()
                    or e.bf16_optimizer_states() or e.amp_enabled() or e.torch_autocast_enabled())


def test_offload_accessors(engines):
    none = accessors(engines["stage1_fp16_dynamic"])
    assert none.zero_offload_optimizer() is None and none.zero_offload_param() is None
    assert not (none.zero_cpu_offload() or none.zero_use_cpu_optimizer() or none.zero_nvme_offload_optimizer())
    assert none.zero_partial_offload() == 1.0 and none.super_offload() is False
    s2 = accessors(engines["stage2_bf16_offload"])
    opt = s2.zero_offload_optimizer()
    assert isinstance(opt, DeepSpeedZeroOffloadOptimizerConfig)
    assert (opt.device, opt.pin_memory, opt.pipeline, opt.pipeline_read, opt.ratio, opt.buffer_count) == (
        "cpu", True, True, True, 1.0, 4)  # zero reads ahead and writes behind by default (used with nvme)
    assert opt.device == OffloadDeviceEnum.cpu
    assert s2.zero_cpu_offload() is True and s2.zero_use_cpu_optimizer() is True and s2.zero_offload_param() is None
    s3 = accessors(engines["stage3_fp16_static_offload"])
    param = s3.zero_offload_param()
    assert isinstance(param, DeepSpeedZeroOffloadParamConfig)
    assert (param.device, param.pin_memory, param.buffer_count, param.max_in_cpu) == ("cpu", True, 5, 10**9)
    assert s3.zero_sub_group_size() == 100000 and s3.zero_cpu_offload() is True


def test_zero_section_accessors(engines):
    s3 = accessors(engines["stage3_fp16_static_offload"])
    assert s3.zero_param_persistence_threshold() == 10 and s3.zero_prefetch_bucket_size() == 1000
    assert s3.zero_max_live_parameters() == 2000 and s3.zero_max_reuse_distance() == 10**9
    assert s3.zero_gather_16bit_weights_on_model_save() is True
    s1 = accessors(engines["stage1_fp16_dynamic"])
    assert s1.zero_reduce_bucket_size() == 1000 and s1.zero_allgather_bucket_size() == 500_000_000
    assert s1.zero_reduce_scatter() and s1.zero_contiguous_gradients() and s1.zero_allgather_partitions()
    assert s1.zero_gather_16bit_weights_on_model_save() is False and s1.zero_ignore_unused_parameters() is True
    assert s1.zero_compute_grad_norm() is True and s1.zero_hpz_partition_size() == 1
    assert not (s1.zero_quantized_weights() or s1.zero_quantized_gradients() or s1.zero_legacy_stage1()
                or s1.zero_round_robin_gradients() or s1.zero_parameter_alignment() or s1.is_sanity_checks_enabled())
    assert s1.zenflow_config() is None and s1.zeropp_loco_param() is None and s1.mics_shard_size() == -1
    assert isinstance(accessors(engines["stage2_bf16_offload"]).zero_allgather_bucket_size(), int)  # 5e8 in the JSON


def test_optimizer_and_scheduler_accessors(engines):
    s1 = accessors(engines["stage1_fp16_dynamic"])
    assert s1.optimizer_name() == "adamw"  # DeepSpeed spells its own optimizers in lower case
    assert s1.optimizer_params() == {"lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.1}  # as given
    assert s1.scheduler_name() == "WarmupLR" and s1.scheduler_params() == {"warmup_num_steps": 10, "warmup_max_lr": 0.01}
    assert s1.optimizer_legacy_fusion() is False
    sgd = accessors(engines["stage2_sgd"])
    assert sgd.optimizer_name() == "SGD" and sgd.optimizer_params() == {"lr": 0.1, "momentum": 0.9}
    none = accessors(engines["stage0_fp32"])
    assert none.optimizer_name() is None and none.optimizer_params() is None and none.scheduler_name() is None


def test_optimizer_name_is_the_client_optimizers_class():
    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": "AdamW"}})
    model = MLP()
    assert _Holder(cfg).optimizer_name() == "adamw"
    assert _Holder(cfg, client_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).optimizer_name() == "SGD"


def test_features_zero_lacks_read_as_off(engines):
    with pytest.warns(ConfigWarning):  # enabled but ignored (warned): still off
        cfg = load_config({"train_batch_size": 2, "flops_profiler": {"enabled": True}, "autotuning": {"enabled": True}})
    for e in (_Holder(cfg), *map(accessors, engines.values())):
        assert not (e.flops_profiler_enabled() or e.autotuning_enabled() or e.autotuning_profile_model_info()
                    or e.data_efficiency_enabled() or e.data_sampling_enabled() or e.curriculum_learning_enabled()
                    or e.random_ltd_enabled() or e.curriculum_enabled_legacy() or e.pld_enabled()
                    or e.eigenvalue_enabled() or e.elasticity_enabled() or e.is_deepcompile_enabled()
                    or e.is_deepcompile_active() or e.compile_zero_optimization_stage() or e.compile_autotp()
                    or e.uses_parallelization_pass_only() or e.sparse_gradients_enabled() or e.graph_harvesting()
                    or e.load_universal_checkpoint() or e.use_node_local_storage() or e.checkpoint_writer_enabled())
        assert e.flops_profiler_profile_step() == 1 and e.flops_profiler_module_depth() == -1
        assert e.flops_profiler_detailed() is True and e.flops_profiler_output_file() is None
        assert e.autotuning_start_profile_step() == 3 and e.autotuning_end_profile_step() == 5
        assert e.autotuning_metric() == "throughput"
        assert e.autotuning_metric_path() == os.path.join(os.getcwd(), "autotuning_metric.json")
        assert e.checkpoint_tag_validation_enabled() is True and e.checkpoint_tag_validation_fail() is False
        assert e.checkpoint_serialization_enabled() is True and e.autotp_size() == 0
        assert e.get_pld_theta() is None and e.pld_params() is False and e.amp_params() is False
        assert e.swap_tensor_config() is None and e.aio_config()["block_size"] == 1048576
        assert e.torch_autocast_lower_precision_safe_modules()[0] == "torch.nn.modules.linear.Linear"
        assert e.quantize_training() == (False, False, 1, False, 0.001, "symmetric", "nearest", False, False)


def test_the_view_follows_a_replaced_config_and_refuses_edits():
    holder = _Holder(load_config({"train_batch_size": 4}))
    view = holder._config
    assert holder._config is view and holder.train_batch_size() == 4
    with pytest.raises(AttributeError, match="read-only in zero.*set_train_batch_size"):
        view.train_batch_size = 8  # the engine would not train with it: refused rather than ignored
    holder.config = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 2}})
    assert holder._config is not view and holder.zero_optimization_stage() == 2 and holder.train_batch_size() == 4


# ------------------------------------------------------------------------ DeepSpeed's config objects

def test_deepspeed_config_loads_as_zero_does(tmp_path):
    cfg = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 2)
    assert cfg.bfloat16_enabled and cfg.bfloat16_config.enabled and not cfg.fp16_enabled and cfg.world_size == 1
    assert cfg.zero_optimization_stage == 0 and cfg.zero_enabled is False and isinstance(cfg.zero_config, DeepSpeedZeroConfig)
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 3, // hjson, as DeepSpeed reads\n}')
    assert DeepSpeedConfig(str(path)).train_batch_size == 3
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization\.stag: unknown key 'stag'; did you mean 'stage'"):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stag": 1}})
    with pytest.raises(ConfigError, match=r"train_batch_size must equal"):
        DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1})
    with pytest.raises(DeepSpeedConfigError, match=r"zeropp_loco_param: set to .*which zero does not implement"):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}})
    assert issubclass(ConfigError, DeepSpeedConfigError) and issubclass(ConfigError, ValueError)


def test_deepspeed_config_batch_arithmetic_is_zeros():
    cfg = DeepSpeedConfig({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2})
    assert cfg.gradient_accumulation_steps == 6
    cfg.train_batch_size, cfg.gradient_accumulation_steps = None, 4  # re-derived, as DeepSpeed's method does
    cfg._configure_train_batch_size()
    assert cfg.train_batch_size == 8
    cfg.train_batch_size = 9
    with pytest.raises(ConfigError, match=r"9 != 2 \* 4 \* 1"):
        cfg._configure_train_batch_size()


def test_deepspeed_config_checks_an_mpu_against_the_config():
    class Mpu:
        def get_data_parallel_world_size(self):
            return 2

    with pytest.raises(ConfigError, match="data-parallel size is 2"):
        DeepSpeedConfig({"train_batch_size": 4}, mpu=Mpu())


def test_deepspeed_zero_config_built_directly_validates_as_zero_does():
    z = DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=10, offload_optimizer={"device": "cpu"})
    assert z.prefetch_bucket_size == 10 and z.overlap_comm is True and z.stage == ZeroStageEnum.weights
    assert isinstance(z.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig) and z.offload_optimizer.pipeline is True
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        old = DeepSpeedZeroConfig(stage=2, cpu_offload=True)
    assert isinstance(old.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig) and old.offload_optimizer.device == "cpu"
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_sise: unknown key.*'reduce_bucket_size'"):
        DeepSpeedZeroConfig(reduce_bucket_sise=1)
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.nvme_path: is missing"):
        DeepSpeedZeroOffloadParamConfig(device="nvme")
    with pytest.warns(ConfigWarning, match="nvme_path"):
        DeepSpeedZeroOffloadParamConfig(device="cpu", nvme_path="/tmp")
    assert get_zero_config({"zero_optimization": {"stage": 2}}).stage == 2 and get_zero_config({}).stage == 0
    assert [s.value for s in OffloadStateTypeEnum] == ["optim_states", "hp_params", "lp_params", "lp_grads",
                                                      "contiguous_grad_buffer"]
    assert DtypeEnum("bf16").value is torch.bfloat16 and DtypeEnum("half") is DtypeEnum.fp16


# --------------------------------------------------------------------------- against DeepSpeed itself

# accessors whose DeepSpeed counterpart cannot be called or returns another type, and why
NOT_COMPARED = {
    "swap_tensor_config": "DeepSpeed 0.19's reads a DeepSpeedConfig attribute it never sets (AttributeError)",
    "compile_zero_optimization_stage": "DeepSpeed 0.19's raises TypeError when compile.passes is None (its default)",
    "tensor_parallel_config": "DeepSpeed's TPTrainingConfig; zero's namespace holds the fields zero has "
                              "(autotp_size() is compared)",
}
# DeepSpeedConfig values that differ on purpose: (attribute path) -> why
KNOWN_DIFFERENCES = {
    "pipeline": "zero's pipeline keys are added, and stages is resolved (DeepSpeed keeps 'auto')",
    "timers_config.enabled": "DeepSpeed's throughput timer is on by default; zero has none",
    "bfloat16_config.check_grad_overflow": "DeepSpeed 0.19's default is true, 0.17's (zero's config) false; zero "
                                           "always checks",
    "tensor_parallel_config.dtype": "DeepSpeed's default is fp16 whatever the training dtype; zero's is the training dtype",
    "zero_config.stage3_gather_fp16_weights_on_model_save": "zero keeps the deprecated key None when it is not given",
    "zero_config.leaf_module": "DeepSpeed 0.19 lists MoE blocks of transformers as leaves by default; zero marks none",
}


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the values are checked by hand above",
                        exc_type=ImportError)
    from deepspeed.runtime.config import DeepSpeedConfig as TheirConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    return TheirConfig, DeepSpeedEngine


def _same(ours, theirs, path, differences):
    """Compare recursively; record (path) where they differ."""
    if path in KNOWN_DIFFERENCES:
        return
    if isinstance(theirs, BaseModel):
        for name in type(theirs).model_fields:
            if hasattr(ours, name):
                _same(getattr(ours, name), getattr(theirs, name), f"{path}.{name}", differences)
            else:
                differences.append(f"{path}.{name}: missing")
    elif isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        if list(ours) != list(theirs):
            differences.append(f"{path}: {ours!r} != {theirs!r}")
    elif hasattr(theirs, "__dict__") and not isinstance(theirs, (type, torch.dtype)) and not callable(theirs):
        for name, value in vars(theirs).items():
            if not name.startswith("_") and hasattr(ours, name):
                _same(getattr(ours, name), value, f"{path}.{name}", differences)
    elif ours != theirs:
        differences.append(f"{path}: {ours!r} != {theirs!r}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_accessor_matches_deepspeeds_for_the_same_config(engines, name):
    TheirConfig, DeepSpeedEngine = _deepspeed()
    ours = accessors(engines[name])
    theirs_config = TheirConfig(copy.deepcopy(CONFIGS[name]))
    compared = [n for n in dir(ConfigAccessors) if not n.startswith("_") and hasattr(DeepSpeedEngine, n)
                and n not in NOT_COMPARED]
    members = {n: inspect.getattr_static(DeepSpeedEngine, n) for n in compared}
    theirs = type("DeepSpeedAccessors", (), members)()
    theirs._config, theirs.client_optimizer, theirs.optimizer = theirs_config, None, None  # no NVMe swapper
    differences: list[str] = []
    for n in compared:
        a, b = getattr(ours, n), getattr(theirs, n)
        if callable(b):
            a, b = a(), b()
        _same(a, b, n, differences)
    assert not differences, "\n".join(differences)
    assert len(compared) >= 110  # DeepSpeed 0.19.8: 113


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deepspeed_config_has_deepspeeds_attributes_and_values(name):
    TheirConfig, _ = _deepspeed()
    theirs = TheirConfig(copy.deepcopy(CONFIGS[name]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = DeepSpeedConfig(copy.deepcopy(CONFIGS[name]))
    assert set(vars(theirs)) <= set(vars(ours)), f"missing: {set(vars(theirs)) - set(vars(ours))}"
    differences: list[str] = []
    for key, value in vars(theirs).items():
        _same(getattr(ours, key), value, key, differences)
    assert not differences, "\n".join(differences)
    assert json.dumps(ours._param_dict) == json.dumps(CONFIGS[name])


def test_accessors_cover_deepspeeds_config_accessors():
    """Every DeepSpeedEngine member the mixin leaves out acts on the engine (the Engine's own), or is
    listed here with its reason."""
    _, DeepSpeedEngine = _deepspeed()
    behaviour = {
        "all_gather_scalar", "allreduce_and_copy", "allreduce_bucket", "allreduce_gradients", "allreduce_no_retain",
        "backward", "buffered_allreduce_fallback", "clip_fp32_gradients", "coalesce_grad_reduction",
        "collect_python_gc", "deepspeed_io", "destroy", "empty_partition_cache", "get_autosp_backend",
        "get_autotp_backend", "get_batch_info", "get_compile_time", "get_data_parallel_rank",
        "get_deepcompile_backend", "get_deepspeed_compile_backend", "get_global_grad_norm", "get_lr",
        "get_model_parallel_rank", "get_mom", "get_optimizer_configuration", "get_sequence_parallel_group",
        "get_tensor_parallel_rank", "get_type", "get_wall_clock_timers", "is_compiled", "is_gradient_accumulation_boundary",
        "is_iterable_style_dataset", "is_map_style_dataset", "load_checkpoint", "load_module_state_dict",
        "load_moe_state_dict", "module_state_dict", "no_sync", "offload_states", "print_forward_breakdown",
        "random_ltd_initialize", "register_compile_pass", "reload_states", "save_16bit_model", "save_checkpoint",
        "save_fp16_model", "scale", "set_custom_curriculum_learning_schedule", "set_data_post_process_func",
        "set_gradient_accumulation_boundary", "set_train_batch_size", "set_train_micro_batch_size", "sparse_all_gather",
        "sparse_allreduce", "sparse_allreduce_bucket", "sparse_allreduce_no_retain", "step", "was_step_applied",
        # a config accessor in DeepSpeed (fp16.loss_scale), but zero's Engine has `loss_scale` as the current scale
        "loss_scale",
    }
    members = {n for n in dir(DeepSpeedEngine) if not n.startswith("_") and n not in dir(torch.nn.Module)}
    ours = {n for n in dir(ConfigAccessors) if not n.startswith("_")}
    assert members - ours - behaviour == set()
    assert not ours & behaviour


def test_deepspeed_zero_config_has_every_field_of_deepspeeds():
    _deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig as TheirZero
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig as TheirOptimizer
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig as TheirParam

    for ours, theirs in ((DeepSpeedZeroConfig, TheirZero), (DeepSpeedZeroOffloadOptimizerConfig, TheirOptimizer),
                         (DeepSpeedZeroOffloadParamConfig, TheirParam)):
        instance = ours()
        missing = [f for f in theirs.model_fields if not hasattr(instance, f)]
        assert not missing, f"{ours.__name__} lacks {missing}"
        aliases = {f.alias for f in theirs.model_fields.values() if f.alias}
        assert aliases <= {f.alias for f in ours.model_fields.values() if f.alias}

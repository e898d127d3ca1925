"""`deepspeed.runtime.config`: `DeepSpeedConfig`, a DeepSpeed-shaped view of a `ZeroConfig`.

[Note: DeepSpeedConfig is a view]
DeepSpeed code and scripts read a config through `DeepSpeedConfig` attributes
(`ds_config.zero_config.stage`, `.train_micro_batch_size_per_gpu`, `.fp16_enabled`) and the
engine's accessors (zero/deepspeed/engine_accessors.py) read them through `engine._config`. Here the config is
loaded once by zero's `load_config`: the same validation, errors (`ConfigError`, which is a
`DeepSpeedConfigError`), warnings and batch-size rule as `zero.initialize`; a key zero refuses is
refused here too. `DeepSpeedConfig` then only names its values as DeepSpeed does, in three kinds:

- a key zero reads, or a DeepSpeed key it accepts with its type (`gradient_clipping`,
  `zero_optimization.*`, `disable_allgather`): the config's value;
- a DeepSpeed feature section zero does not model (`flops_profiler`, `autotuning`, `monitor`
  sections, `compile`, `data_efficiency`, ...): DeepSpeed's defaults, the feature off, since zero
  does not run it (enabling one is refused, or warned about and ignored, by `load_config`);
- a DeepSpeed setting zero has no key for (`disable_python_gc`, `log_level`, `param_dtype`):
  DeepSpeed's default.

Attributes of both DeepSpeed 0.17 (`fp16_enabled`, `loss_scale`, `pld_enabled`, `eigenvalue_*`) and
0.19 (`float16_config`, `bfloat16_config`, `torch_autocast_*`) are set. Where the versions' defaults
differ, zero's config follows 0.17 (`gradient_clipping` 0, offload `pin_memory` false; see
docs/config.md).
"""
from __future__ import annotations

import base64
import copy
import enum
import json
import logging
import os
import pathlib
import types
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from pydantic import BaseModel

from zero.config import ConfigError, ZeroConfig, load_config
from zero.config.errors import DeepSpeedConfigError
from zero.config.loading import _read, _resolve_batch
from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from zero.deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum  # noqa: F401
from zero.optim.choice import CLIENT_OPTIMIZERS

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigWriter", "DtypeEnum", "ZeroStageEnum"]

log = logging.getLogger("zero")

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
# the optimizer types DeepSpeed spells in lower case (`optimizer_name`); others keep their spelling
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
TENSOR_CORE_ALIGN_SIZE = 8


class DtypeEnum(enum.Enum):
    """A torch dtype by any of its config spellings: `DtypeEnum("bf16").value is torch.bfloat16`."""

    fp16 = torch.float16, "torch.float16", "fp16", "float16", "half"
    fp32 = torch.float32, "torch.float32", "fp32", "float32", "float"
    int8 = torch.int8, "torch.int8", "int8"
    bf16 = torch.bfloat16, "torch.bfloat16", "bf16", "bfloat16"

    def __new__(cls, dtype: torch.dtype, *spellings: str):
        member = object.__new__(cls)
        member._value_ = dtype
        member.spellings = spellings
        return member

    @classmethod
    def _missing_(cls, value: Any):
        return next((m for m in cls if value in m.spellings), None)


class ValidationMode:
    """DeepSpeed's checkpoint tag validation modes (`checkpoint.tag_validation`, any case)."""

    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


# ---------------------------------------------------------------------------------------------
# DeepSpeed's defaults for what zero does not model (see [Note: DeepSpeedConfig is a view])
# ---------------------------------------------------------------------------------------------

_NS = types.SimpleNamespace

_FLOPS_PROFILER = dict(enabled=False, recompute_fwd_factor=0.0, profile_step=1, module_depth=-1, top_modules=1,
                       detailed=True, output_file=None)
_AUTOTUNING = dict(enabled=False, start_step=None, end_step=None, metric_path=None, arg_mappings=None,
                   metric="throughput", model_info=None, results_dir="autotuning_results", exps_dir="autotuning_exps",
                   overwrite=True, fast=True, start_profile_step=3, end_profile_step=5, tuner_type="gridsearch",
                   tuner_early_stopping=5, tuner_num_trials=50, model_info_path=None, mp_size=1,
                   max_train_batch_size=None, min_train_batch_size=1, max_train_micro_batch_size_per_gpu=1024,
                   min_train_micro_batch_size_per_gpu=1, num_tuning_micro_batch_sizes=3)
_ACTIVATION_CHECKPOINTING = dict(partition_activations=False, contiguous_memory_optimization=False,
                                 cpu_checkpointing=False, number_checkpoints=None,
                                 synchronize_checkpoint_boundary=False, profile=False)
_HYBRID_ENGINE = dict(enabled=False, max_out_tokens=512, inference_tp_size=1, release_inference_cache=False,
                      pin_parameters=True, tp_gather_partition_size=8, enable_cuda_graph=False)
_COMPILE = dict(deepcompile=False, autoep_non_moe=False, free_activation=False, free_activation_threshold=10485760,
                offload_activation=False, offload_activation_pin_memory=True, offload_opt_states=False,
                double_buffer=True, symmetric_memory=False, debug_log=False, offload_parameters=False,
                sync_before_reduce=False, sync_after_reduce=False,
                sync_before_allgather=False, sync_after_allgather=False, keep_int_input_tensors=True,
                keep_all_input_tensors=False, passes=None)
_DATA_EFFICIENCY = {
    "enabled": False, "seed": 1234,
    "data_sampling": {"enabled": False, "num_epochs": 1000, "num_workers": 0, "pin_memory": False,
                      "curriculum_learning": {"enabled": False},
                      "dynamic_batching": {"enabled": False, "lr_scaling_method": "linear", "min_batch_size": 1,
                                           "max_batch_size": None, "sequence_picking_order": "dataloader",
                                           "verbose": False}},
    "data_routing": {"enabled": False, "random_ltd": {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}},
}
_AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
        "overlap_events": True, "use_gds": False}
_PIPELINE = {"stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
             "pipe_partitioned": True, "grad_partitioned": True}
# compression_training's weight quantization (MoQ) settings that DeepSpeed 0.17's engine reads
_WEIGHT_QUANTIZATION = {"quantize_weight_in_forward": False, "enabled": False, "quantize_groups": 1,
                        "fp16_mixed_quantize": False, "quantize_change_ratio": 0.001, "quantization_type": "symmetric",
                        "rounding": "nearest", "quantize_verbose": False, "quantizer_kernel": False}
_EIGENVALUE = dict(enabled=False, verbose=False, max_iter=100, tol=1e-2, stability=1e-6, gas_boundary_resolution=1,
                   layer_name="bert.encoder.layer", layer_num=0)


def _monitor_config() -> types.SimpleNamespace:
    """DeepSpeed's monitor sections, all off (zero has no monitoring backends)."""
    return _NS(enabled=False,
               tensorboard=_NS(enabled=False, output_path="", job_name="DeepSpeedJobName"),
               wandb=_NS(enabled=False, group=None, team=None, project="deepspeed"),
               csv_monitor=_NS(enabled=False, output_path="", job_name="DeepSpeedJobName"),
               comet=_NS(enabled=False, samples_log_interval=100, project=None, workspace=None, api_key=None,
                         experiment_name=None, experiment_key=None, online=None, mode=None))


def _as_dict(params: Any) -> Optional[dict]:
    """Section params as DeepSpeed holds them: the dict of the keys the config gave (JSON values)."""
    if params is None:
        return None
    if isinstance(params, BaseModel):
        return params.model_dump(mode="json", exclude_unset=True, by_alias=True)
    return dict(params)


def _copied(cls: type[BaseModel], section: BaseModel) -> BaseModel:
    """DeepSpeed's model `cls` holding the values of zero's validated `section` (same field names)."""
    return cls.model_construct(**{name: getattr(section, name) for name in cls.model_fields})


def _data_parallel_size(cfg: ZeroConfig, world_size: int) -> int:
    """The ranks loading different samples (a sequence-parallel group shares its samples; see
    [Note: parallel dimensions] in zero/parallel/dims.py)."""
    from zero.parallel.dims import ParallelDims

    try:
        return ParallelDims.from_config(cfg, world_size).size("batch")
    except ValueError as err:
        raise ConfigError(str(err)) from None


# ---------------------------------------------------------------------------------------------
# DeepSpeedConfig
# ---------------------------------------------------------------------------------------------

class DeepSpeedConfig:
    """DeepSpeed's parsed config, read from zero's (see [Note: DeepSpeedConfig is a view]).

    Args:
        config: a dict, a path to a JSON (or hjson) file, a base64-encoded JSON string (as
            DeepSpeed's launcher passes one), or a loaded `ZeroConfig`.
        mpu: a model-parallel unit; zero takes the mesh from the config (`pipeline.stages`,
            `tensor_parallel.size`), so its data-parallel size must be the config's.
        mesh_device: a torch DeviceMesh with a "data_parallel" dimension; checked likewise.

    Raises:
        ConfigError (a `DeepSpeedConfigError`): whatever `zero.load_config` refuses, or an mpu or
            mesh whose data-parallel size is not the config's.

    Attributes are DeepSpeed's (`train_batch_size`, `zero_config`, `zero_optimization_stage`,
    `fp16_enabled`, `float16_config`, `optimizer_name`, ...); `config` is the `ZeroConfig` viewed.
    Batch sizes follow zero's rule over the data-parallel ranks (`world_size`).
    """

    def __init__(self, config: Union[Mapping[str, Any], str, os.PathLike, ZeroConfig], mpu: Any = None,
                 mesh_device: Any = None):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() \
            else (0, 1)
        if isinstance(config, ZeroConfig):
            cfg, param_dict = config, config.model_dump(mode="json", by_alias=True, exclude_unset=True)
        else:
            config = _decoded(config)
            cfg = load_config(config, world_size=world)
            param_dict = _read(config)[0]
        dp = _data_parallel_size(cfg, world)
        for what, given in (("mpu", _mpu_size(mpu)), ("mesh_device", _mesh_size(mesh_device))):
            if given is not None and given != dp:
                raise ConfigError(f"DeepSpeedConfig({what}=...): its data-parallel size is {given}, but the config "
                                  f"splits the world of {world} ranks into {dp} data-parallel ranks "
                                  f"(pipeline.stages x tensor_parallel.size x data-parallel; see "
                                  f"docs/parallelism.md); zero takes the mesh from the config")
        self._initialize_params(cfg, param_dict, dp, rank)

    @classmethod
    def of(cls, cfg: ZeroConfig, world_size: int, global_rank: int = 0) -> DeepSpeedConfig:
        """The view of a loaded config over `world_size` data-parallel ranks (an engine's), without
        loading or checking it again.

        Args:
            cfg: a config from `load_config`, with its batch sizes resolved.
            world_size: the data-parallel ranks the batch sizes count.
            global_rank: this process's rank.
        """
        self = cls.__new__(cls)
        self._initialize_params(cfg, cfg.model_dump(mode="json", by_alias=True, exclude_unset=True), world_size,
                                global_rank)
        self._read_only = True  # an engine's view: its values come from the engine's config
        return self

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_read_only"):
            raise AttributeError(f"engine._config.{name} is read-only in zero: it mirrors engine.config, which the "
                                 f"engine was built from; change the batch size with engine.set_train_batch_size() / "
                                 f"set_train_micro_batch_size(), anything else in the config given to initialize")
        super().__setattr__(name, value)

    def _initialize_params(self, cfg: ZeroConfig, param_dict: dict, world_size: int, global_rank: int) -> None:
        """Every attribute DeepSpeed's constructor sets, from `cfg` (given as `param_dict`)."""
        self._param_dict = param_dict
        self.config = cfg
        self.global_rank = global_rank
        self.world_size = world_size
        self._batch(cfg)
        self._training(cfg)
        self._precision(cfg)
        self._optimizer_and_scheduler(cfg)
        self._checkpointing(cfg)
        self._features_off()

    def _batch(self, cfg: ZeroConfig) -> None:
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.managed_gradient_accumulation = cfg.managed_gradient_accumulation
        self.dataloader_drop_last = cfg.dataloader_drop_last

    def _training(self, cfg: ZeroConfig) -> None:
        self.steps_per_print = cfg.steps_per_print
        self.dump_state = cfg.dump_state
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.memory_breakdown = cfg.memory_breakdown
        self.disable_allgather = cfg.disable_allgather
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        self.communication_data_type = names.get(cfg.communication_data_type)
        self.seq_parallel_communication_data_type = torch.float32
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.gradient_allreduce_op = cfg.gradient_allreduce_op
        self.gradient_clipping = cfg.gradient_clipping
        self.sparse_gradients_enabled = cfg.sparse_gradients
        self.zero_config = DeepSpeedZeroConfig.of(cfg.zero_optimization)
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.mics_shard_size = self.zero_config.mics_shard_size
        self.mics_hierarchial_params_gather = self.zero_config.mics_hierarchical_params_gather  # DeepSpeed's spelling
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = cfg.zero_force_ds_cpu_optimizer
        self.use_data_before_expert_parallel_ = cfg.use_data_before_expert_parallelism
        self.graph_harvesting = cfg.graph_harvesting
        # DeepSpeed's own pipeline keys with their defaults, then zero's (stages and micro_batches resolved)
        self.pipeline = {**_PIPELINE, **cfg.pipeline.model_dump()}
        size = cfg.tensor_parallel.size
        self.tensor_parallel_config = _NS(
            autotp_size=size if "size" in cfg.tensor_parallel.model_fields_set else 0, dtype=cfg.dtype,
            tp_overlap_comm=False, tensor_parallel=_NS(tp_size=size, tp_grain_size=1, mpu=None, tp_group=None),
            vocab_parallel_lm_head=None, vocab_parallel_ce_backend="torch", injection_policy_tuple=None,
            partition_config=None, preset_model=None, keep_module_on_host=False, replace_with_kernel_inject=False)

    def _precision(self, cfg: ZeroConfig) -> None:
        fp16, bf16 = cfg.fp16, cfg.bf16
        self.float16_config = _copied(DeepSpeedFP16Config, fp16)
        self.bfloat16_config = _copied(DeepSpeedBF16Config, bf16)
        self.fp16_enabled = fp16.enabled
        self.fp16_auto_cast = fp16.auto_cast
        self.fp16_master_weights_and_gradients = fp16.fp16_master_weights_and_grads
        self.bfloat16_enabled = bf16.enabled
        self.bfloat16_immediate_grad_update = bf16.immediate_grad_update
        self.bfloat16_check_overflow = bf16.check_grad_overflow
        self.loss_scale = fp16.loss_scale
        self.initial_dynamic_scale = 2 ** fp16.initial_scale_power
        self.dynamic_loss_scale_args = self.float16_config.dynamic_loss_scale_args()
        self.torch_autocast_enabled = False
        self.torch_autocast_dtype = None
        self.torch_autocast_lower_precision_safe_modules = None
        self.amp_enabled = False
        self.amp_params = False
        self.grad_accum_dtype = cfg.data_types.grad_accum_dtype
        self.param_dtype = None
        self.buffer_dtype = None
        self.keep_in_fp32_modules = "auto"

    def _optimizer_and_scheduler(self, cfg: ZeroConfig) -> None:
        opt = cfg.optimizer
        name = None if opt is None else opt.type
        self.optimizer_name = name.lower() if name is not None and name.lower() in DEEPSPEED_OPTIMIZERS else name
        if opt is None:
            self.optimizer_params = None
        else:
            self.optimizer_params = dict(opt.other_params) if opt.type in CLIENT_OPTIMIZERS else _as_dict(opt.params)
        self.optimizer_legacy_fusion = False if opt is None else opt.legacy_fusion
        sched = cfg.scheduler
        self.scheduler_name = None if sched is None else sched.type
        self.scheduler_params = None if sched is None else _as_dict(sched.params)

    def _checkpointing(self, cfg: ZeroConfig) -> None:
        ck = cfg.checkpoint
        mode = ck.tag_validation.upper()
        self.checkpoint_tag_validation_enabled = mode != ValidationMode.IGNORE
        self.checkpoint_tag_validation_fail = mode == ValidationMode.FAIL
        self.checkpoint_config = {"tag_validation": mode, "checkpoint_serialization": True, "writer": None}
        self.load_universal_checkpoint = ck.load_universal
        self.use_node_local_storage = ck.use_node_local_storage
        self.checkpoint_parallel_write_pipeline = ck.parallel_write.pipeline_stage
        self.elasticity_enabled = cfg.elasticity.enabled
        self.elastic_model_parallel_size = cfg.elasticity.model_parallel_size
        self.elasticity_version = cfg.elasticity.version

    def _features_off(self) -> None:
        """DeepSpeed features zero does not run: their settings with DeepSpeed's defaults."""
        self.activation_checkpointing_config = _NS(**_ACTIVATION_CHECKPOINTING)
        self.comms_config = _NS(comms_logger_enabled=False)
        self.monitor_config = _monitor_config()
        self.flops_profiler_config = _NS(**_FLOPS_PROFILER)
        self.autotuning_config = _NS(**_AUTOTUNING)
        self.hybrid_engine = _NS(**_HYBRID_ENGINE)
        self.compile_config = _NS(**_COMPILE)
        self.timers_config = _NS(enabled=False, synchronized=True)
        self.expert_parallel_config = _NS(enabled=False, autoep_size=1)
        self.datastates_config = _NS(enabled=False, config=None)
        self.nebula_config = _NS(enabled=False)
        self.data_efficiency_enabled = False
        self.data_efficiency_config = copy.deepcopy(_DATA_EFFICIENCY)
        self.aio_config = dict(_AIO)
        self.weight_quantization_config = None
        self.compression_config = {"weight_quantization": {"shared_parameters": dict(_WEIGHT_QUANTIZATION)}}
        self.sparse_attention = None
        self.pld_enabled = False
        self.pld_params = False
        self.curriculum_enabled_legacy = False
        self.curriculum_params_legacy = False
        for key, value in _EIGENVALUE.items():
            setattr(self, f"eigenvalue_{key}", value)
        self.disable_python_gc = False
        self.log_level = None

    # -- DeepSpeed's batch-size methods, with zero's rule ------------------------------------------

    def _configure_train_batch_size(self) -> None:
        """Derive the batch sizes not given (None) from the others, and check the three agree with
        `world_size`, by zero's rule (`zero.config.loading`): a ConfigError naming the key if not."""
        given = self.config.model_copy(update={"train_batch_size": self.train_batch_size,
                                               "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
                                               "gradient_accumulation_steps": self.gradient_accumulation_steps})
        for key, value in _resolve_batch(given, self.world_size).items():
            setattr(self, key, value)

    _set_batch_related_parameters = _batch_assertion = _configure_train_batch_size

    # -- printing ----------------------------------------------------------------------------------

    def print_user_config(self) -> None:
        """Log the config as given (the keys set), as JSON."""
        log.info("  json = %s", json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        """Log every attribute, then the config as given."""
        log.info("%s:", name)
        for key in sorted(vars(self)):
            if key not in ("_param_dict", "config"):
                log.info("  %s %s %s", key, "." * (29 - len(key)), getattr(self, key))
        self.print_user_config()

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, stage={self.zero_optimization_stage}, "
                f"precision={self.config.precision!r}, world_size={self.world_size})")


def _decoded(config: Any) -> Any:
    """A string that names no file but is base64 of a JSON object (DeepSpeed's launcher passes
    configs so): the dict; anything else as it is (load_config reports what is wrong)."""
    if isinstance(config, str) and not pathlib.Path(config).exists():
        try:
            data = json.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
        except ValueError:  # binascii.Error, UnicodeDecodeError and JSONDecodeError are ValueErrors
            return config
        if isinstance(data, dict):
            return data
    return config


def _mpu_size(mpu: Any) -> Optional[int]:
    if mpu is None:
        return None
    if not hasattr(mpu, "get_data_parallel_world_size"):
        raise ConfigError("DeepSpeedConfig(mpu=...): an mpu must have get_data_parallel_world_size() (zero's "
                          "sequence parallelism is the config's sequence_parallel_size)")
    return int(mpu.get_data_parallel_world_size())


def _mesh_size(mesh_device: Any) -> Optional[int]:
    if mesh_device is None:
        return None
    return dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))


class DeepSpeedConfigWriter:
    """Write a config file from a dict, key by key (DeepSpeed's helper for templates)."""

    def __init__(self, data: Optional[dict] = None):
        self.data = data if data is not None else {}

    def add_config(self, key: str, value: Any) -> None:
        self.data[key] = value

    def load_config(self, filename: Union[str, os.PathLike]) -> None:
        self.data = _read(filename)[0]

    def write_config(self, filename: Union[str, os.PathLike]) -> None:
        with open(filename, "w") as out:
            json.dump(self.data, out)


def __getattr__(name: str):
    return missing(__name__, name)

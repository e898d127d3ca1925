"""The DeepSpeed keys `zero` accepts but does not read: each refused or warned about, with its reason."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import BaseModel

from zero.config.errors import _raise, _warn
from zero.config.model import ZeroConfig

# ---------------------------------------------------------------------------------------------
# [Note: what zero does with a DeepSpeed key]
# Every key `zero` accepts is one of three kinds; none is accepted and silently ignored.
#
# - READ: it changes what zero does. These are the typed fields of the section models that the
#   engine reads. A value zero cannot honour is refused by that field's validator, with the key's
#   path (offload `device: "nvme"`, `offload_optimizer.ratio` < 1, `amsgrad`, an optimizer type
#   other than Adam/AdamW). A READ key that cannot matter in some combination of settings warns
#   from `ZeroOptimizationConfig`'s validator (`offload_param` below stage 3, `sub_group_size`
#   without optimizer offload, `pin_memory` with `device: "none"`).
# - REFUSED: zero does not implement it and setting it would change what training computes:
#   a `ConfigError`.
# - WARNED: zero does not implement it and results are unaffected (logging, monitoring,
#   profiling, DeepSpeed's own memory and speed knobs, training checkpoints): a `ConfigWarning`.
#
# REFUSED and WARNED keys are the rows of `UNIMPLEMENTED_FEATURES`, one row per key with its
# reason, and nowhere else. A row fires only when the key is set to a value that would matter: by
# default, a value other than DeepSpeed's default, so a config that spells out the defaults loads
# quietly. `load_config` checks the table after validation, before any model or process group is
# touched. tests/test_config.py::test_every_key_is_read_refused_or_warned keeps this complete: a
# new field must be added to its READ list or to this table.
# ---------------------------------------------------------------------------------------------

Predicate = Callable[[Any], bool]


@dataclass(frozen=True)
class UnimplementedFeature:
    """One DeepSpeed key that `zero` does not read. See [Note: what zero does with a DeepSpeed key].

    Args:
        path: the key's dotted path, in DeepSpeed's spelling.
        kind: "error" if setting it would change results (refused), "warning" if not (warned).
        reason: what zero does instead, or what to use; ends the message.
        is_set: whether a value counts as set. None: it differs from the field's default. Given
            for keys inside raw DeepSpeed sections (no model, so no default) and where only some
            non-default values matter (`zero_hpz_partition_size` > 1).
    """

    path: str
    kind: Literal["error", "warning"]
    reason: str
    is_set: Optional[Predicate] = None


def _refused(path: str, reason: str, is_set: Optional[Predicate] = None) -> UnimplementedFeature:
    return UnimplementedFeature(path, "error", reason, is_set)


def _warned(path: str, reason: str, is_set: Optional[Predicate] = None) -> UnimplementedFeature:
    return UnimplementedFeature(path, "warning", reason, is_set)


def _present(section: Any) -> bool:
    return bool(section)


def _any_enabled(section: Any) -> bool:
    """Sections such as compression_training nest `enabled` flags several levels deep."""
    if isinstance(section, dict):
        return any(v is True if k == "enabled" else _any_enabled(v) for k, v in section.items())
    return False


def _any_true(section: Any) -> bool:
    """Any option switched on or given a number: all-false/null sections (DeepSpeed's defaults) are quiet."""
    if isinstance(section, dict):
        return any(_any_true(v) for v in section.values())
    return bool(section)


def _above(limit: int) -> Predicate:
    return lambda v: int(v) > limit


_NVME_ONLY = "only NVMe offload uses it, and zero offloads to the CPU only"
_NO_CHECKPOINTS = "zero's training checkpoints do not use it (see docs/checkpoint.md)"
_NOT_MONITORED = "zero has no monitoring backends; log from your training loop"

UNIMPLEMENTED_FEATURES: tuple[UnimplementedFeature, ...] = (
    # --- changes the math or the training procedure: ConfigError ---------------------------------
    _refused("amp.enabled", "Apex AMP; use fp16 or bf16", bool),
    _refused("torch_autocast.enabled", "torch.autocast mixed precision; use fp16 or bf16", bool),
    _refused("sparse_gradients", "gradients are always dense"),
    _refused("sparse_attention", "sparse attention is a model layer in zero (zero.sparse_attention."
             "SparseSelfAttention with a SparsityConfig; docs/sparse_attention.md), not a config section", _present),
    _refused("progressive_layer_drop.enabled", "layers would be skipped during training", bool),
    _refused("curriculum_learning.enabled", "the data order and sequence lengths would change", bool),
    _refused("data_efficiency.enabled", "data sampling and routing would change", bool),
    _refused("compression_training", "compression changes the weights or activations", _any_enabled),
    _refused("quantize_training.enabled", "MoQ quantizes the weights during training", bool),
    _refused("eigenvalue.enabled", "the eigenvalue schedule of MoQ", bool),
    _refused("elasticity.enabled", "elastic batch sizes; set the batch keys explicitly", bool),
    _refused("hybrid_engine.enabled", "the RLHF hybrid engine", bool),
    _refused("weight_quantization", "quantized weights", _present),
    _refused("compile.deepcompile", "DeepCompile; call torch.compile on the model yourself", bool),
    _refused("nebula.enabled", "checkpoints would not go where you expect", bool),
    _refused("datastates.enabled", "checkpoints would not go where you expect", bool),
    _refused("sequence_parallel_size", "Ulysses sequence parallelism; zero is data-parallel only"),
    _refused("use_data_before_expert_parallelism", "zero has no expert parallelism"),
    _refused("managed_gradient_accumulation", "zero always tracks the accumulation boundary itself"),
    _refused("gradient_allreduce_op", "gradients are always averaged across ranks"),
    _refused("data_types.grad_accum_dtype", "zero chooses the gradient accumulation dtype itself"),
    _refused("checkpoint.load_universal", "zero cannot read DeepSpeed's universal checkpoints"),
    _refused("fp16.fp16_master_weights_and_grads", "master weights and their gradients are fp32"),
    _refused("bf16.bf16_master_weights_and_grads", "master weights and their gradients are fp32"),
    _refused("bf16.bf16_optimizer_states", "Adam moments are fp32"),
    _refused("zero_optimization.legacy_stage1", "DeepSpeed's old stage-1 code; use stage 1"),
    _refused("zero_optimization.zero_hpz_partition_size", "ZeRO++ hierarchical partitioning (hpZ)", _above(1)),
    _refused("zero_optimization.zero_quantized_weights", "ZeRO++ quantized weights (qwZ)"),
    _refused("zero_optimization.zero_quantized_nontrainable_weights", "ZeRO++ quantized frozen weights"),
    _refused("zero_optimization.zero_quantized_gradients", "ZeRO++ quantized gradients (qgZ)"),
    _refused("zero_optimization.zeropp_loco_param", "LoCo-ZeRO++ error feedback"),
    _refused("zero_optimization.mics_shard_size", "MiCS shard groups", _above(0)),
    _refused("zero_optimization.mics_hierarchical_params_gather", "MiCS"),
    _refused("zero_optimization.zenflow", "ZenFlow's asynchronous updates"),
    _refused("zero_optimization.offload_optimizer.super_offload", "SuperOffload"),
    # --- logging, monitoring, profiling: ConfigWarning --------------------------------------------
    _warned("tensorboard.enabled", _NOT_MONITORED, bool),
    _warned("wandb.enabled", _NOT_MONITORED, bool),
    _warned("csv_monitor.enabled", _NOT_MONITORED, bool),
    _warned("comet.enabled", _NOT_MONITORED, bool),
    _warned("flops_profiler.enabled", "use torch.profiler", bool),
    _warned("comms_logger.enabled", "the engine counts communicated bytes itself", bool),
    _warned("autotuning.enabled", "zero has no autotuner", bool),
    _warned("timers", "wall_clock_breakdown times forward, backward and step", _any_enabled),
    _warned("activation_checkpointing", "zero.deepspeed.checkpointing.checkpoint (torch's checkpoint) recomputes "
                                        "activations; partitioned, CPU and contiguous activation memory are not "
                                        "implemented", _any_true),
    _warned("aio", _NVME_ONLY, _present),
    _warned("graph_harvesting", "zero does not capture CUDA graphs"),
    _warned("vocabulary_size", "DeepSpeed only checks it for tensor-core alignment; zero does not"),
    # --- DeepSpeed's own memory and speed knobs: ConfigWarning ------------------------------------
    _warned("disable_allgather", "updated shards are always all-gathered"),
    _warned("zero_allow_untested_optimizer", "zero implements Adam and AdamW only, and refuses any other "
                                             "optimizer whatever this says"),
    _warned("zero_force_ds_cpu_optimizer", "with optimizer offload, zero always steps with its own CPU Adam"),
    _warned("optimizer.legacy_fusion", "a switch of DeepSpeed's fp16 optimizer; zero has one fp16 path"),
    _warned("optimizer.params.torch_adam", "the engine always steps with its own Adam kernels"),
    _warned("optimizer.params.cuda_aware", "zero's 1-bit exchange goes through torch.distributed (NCCL or gloo), "
                                           "not MPI", _any_true),
    _warned("bf16.check_grad_overflow", "zero always skips a step whose gradients hold inf or NaN, in every "
                                        "precision (see docs/engine.md)"),
    _warned("bf16.immediate_grad_update", "a scheduling knob of DeepSpeed's bf16 optimizer; zero's "
                                          "updates do not depend on it"),
    _warned("zero_optimization.contiguous_gradients", "gradients are always reduced from contiguous buckets"),
    _warned("zero_optimization.allgather_partitions", "updated shards are always all-gathered"),
    _warned("zero_optimization.use_multi_rank_bucket_allreduce",
            "how DeepSpeed schedules its bucket all-reduce; zero's reduction does not depend on it"),
    _warned("zero_optimization.round_robin_gradients", "gradient shards are already contiguous per bucket"),
    _warned("zero_optimization.stage3_use_all_reduce_for_fetch_params",
            "stage 3 always fetches a unit with one all-gather"),
    _warned("zero_optimization.stage3_allgather_sequential", "stage 3 always fetches a unit with one all-gather"),
    _warned("zero_optimization.memory_efficient_linear",
            "stage 3 frees what autograd saves of a gathered weight anyway"),
    _warned("zero_optimization.cpu_offload_use_pin_memory", "deprecated, without effect in DeepSpeed too; "
                                                             "set pin_memory in offload_optimizer / offload_param"),
    _warned("zero_optimization.offload_optimizer.nvme_path", _NVME_ONLY),
    _warned("zero_optimization.offload_optimizer.buffer_count", _NVME_ONLY),
    _warned("zero_optimization.offload_optimizer.pipeline_read", _NVME_ONLY),
    _warned("zero_optimization.offload_optimizer.pipeline_write", _NVME_ONLY),
    _warned("zero_optimization.offload_optimizer.fast_init", _NVME_ONLY),
    _warned("zero_optimization.offload_param.nvme_path", _NVME_ONLY),
    _warned("zero_optimization.offload_param.buffer_count", _NVME_ONLY),
    _warned("zero_optimization.offload_param.buffer_size", _NVME_ONLY),
    _warned("zero_optimization.offload_param.max_in_cpu", _NVME_ONLY),
    # --- training checkpoints: ConfigWarning --------------------------------------------------------
    _warned("zero_optimization.load_from_fp32_weights", _NO_CHECKPOINTS),
    _warned("zero_optimization.elastic_checkpoint", _NO_CHECKPOINTS),
    _warned("zero_optimization.pipeline_loading_checkpoint", _NO_CHECKPOINTS),
    _warned("checkpoint.tag_validation", _NO_CHECKPOINTS),
    _warned("checkpoint.use_node_local_storage", _NO_CHECKPOINTS),
    _warned("checkpoint.parallel_write.pipeline_stage", _NO_CHECKPOINTS),
)


# ---------------------------------------------------------------------------------------------
# Checking a config against the table
# ---------------------------------------------------------------------------------------------

_ABSENT = object()  # the key is not there: a section above it is not given, or a raw section lacks it


def _field_name(cls: type, key: str) -> Optional[str]:
    for name, field in cls.model_fields.items():
        if key in (name, field.alias):
            return name
    return None


def _value_and_default(cfg: ZeroConfig, path: str) -> tuple[Any, Any]:
    """The value at `path` and its default (`_ABSENT` inside a raw DeepSpeed section)."""
    obj: Any = cfg
    default: Any = _ABSENT
    for part in path.split("."):
        if isinstance(obj, BaseModel):
            name = _field_name(type(obj), part)
            if name is None:
                raise KeyError(f"UNIMPLEMENTED_FEATURES row {path!r}: {type(obj).__name__} has no key {part!r}")
            default = type(obj).model_fields[name].default
            obj = getattr(obj, name)
        elif isinstance(obj, dict):
            obj, default = obj.get(part, _ABSENT), _ABSENT
        else:
            return _ABSENT, _ABSENT
    return obj, default


def _shown(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, {...}), shortened."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_set(feat: UnimplementedFeature, cfg: ZeroConfig) -> tuple[bool, Any]:
    value, default = _value_and_default(cfg, feat.path)
    if value is _ABSENT or value is None:
        return False, value
    if feat.is_set is None:
        return value != default, value
    return bool(feat.is_set(value)), value


def _check_unimplemented(cfg: ZeroConfig) -> None:
    """Raise one ConfigError for every refused key that is set; warn once for each warned key."""
    errors: list[tuple[tuple, str]] = []
    for feat in UNIMPLEMENTED_FEATURES:
        loc = tuple(feat.path.split("."))
        try:
            is_set, value = _is_set(feat, cfg)
        except (TypeError, ValueError):
            errors.append((loc, f"unexpected value {_shown(_value_and_default(cfg, feat.path)[0])}"))
            continue
        if not is_set:
            continue
        if feat.kind == "error":
            errors.append((loc, f"set to {_shown(value)}, which zero does not implement and which would "
                                f"change results: {feat.reason}. Remove it."))
        else:
            _warn(f"{feat.path} = {_shown(value)} has no effect in zero and is ignored: {feat.reason}. "
                  f"Training results are unaffected.")
    if errors:
        _raise(errors)

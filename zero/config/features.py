"""DeepSpeed features `zero` does not implement (refused or warned about), and `check_supported`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from pydantic import BaseModel

from zero.config.errors import ConfigError, _fmt, _path, _raise, _warn
from zero.config.model import ZeroConfig

# ---------------------------------------------------------------------------------------------
# [Note: unimplemented DeepSpeed features]
# A DeepSpeed key we do not implement is accepted (so the message can say "not implemented" rather
# than "unknown key"), then refused if enabling it would change what training computes, or warned
# about if it only logs, profiles or tunes. One row per feature: (path, kind, is_enabled, note).
# ---------------------------------------------------------------------------------------------

def _on(section: Optional[dict]) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _present(section: Optional[dict]) -> bool:
    return bool(section)


def _any_enabled(section: Optional[dict]) -> bool:
    """compression_training nests `enabled` flags several levels deep."""
    if isinstance(section, dict):
        return any(v is True if k == "enabled" else _any_enabled(v) for k, v in section.items())
    return False


@dataclass(frozen=True)
class UnimplementedFeature:
    path: str
    kind: Literal["error", "warning"]
    is_enabled: Callable[[Any], bool]
    note: str


_E, _W = "error", "warning"
UNIMPLEMENTED_FEATURES: tuple[UnimplementedFeature, ...] = (
    # changes the math or the training procedure -> ConfigError
    UnimplementedFeature("amp.enabled", _E, _on, "use fp16 or bf16 instead of Apex AMP"),
    UnimplementedFeature("torch_autocast.enabled", _E, _on, "use fp16 or bf16"),
    UnimplementedFeature("sparse_gradients", _E, bool, "gradients are always dense"),
    UnimplementedFeature("sparse_attention", _E, _present, ""),
    UnimplementedFeature("pipeline", _E, _present, "pipeline parallelism is not implemented"),
    UnimplementedFeature("progressive_layer_drop.enabled", _E, _on, ""),
    UnimplementedFeature("curriculum_learning.enabled", _E, _on, ""),
    UnimplementedFeature("data_efficiency.enabled", _E, _on, ""),
    UnimplementedFeature("compression_training", _E, _any_enabled, ""),
    UnimplementedFeature("quantize_training.enabled", _E, _on, ""),
    UnimplementedFeature("eigenvalue.enabled", _E, _on, ""),
    UnimplementedFeature("elasticity.enabled", _E, _on, "set the batch keys explicitly"),
    UnimplementedFeature("hybrid_engine.enabled", _E, _on, ""),
    UnimplementedFeature("weight_quantization", _E, _present, ""),
    UnimplementedFeature("tensor_parallel.autotp_size", _E,
                         lambda s: isinstance(s, dict) and int(s.get("autotp_size", 1) or 1) > 1, ""),
    UnimplementedFeature("compile.deepcompile", _E, lambda s: isinstance(s, dict) and bool(s.get("deepcompile")),
                         "call torch.compile on the model yourself"),
    UnimplementedFeature("nebula.enabled", _E, _on, "checkpoints would not go where you expect"),
    UnimplementedFeature("datastates.enabled", _E, _on, "checkpoints would not go where you expect"),
    UnimplementedFeature("sequence_parallel_size", _E, lambda v: v > 1, ""),
    UnimplementedFeature("use_data_before_expert_parallelism", _E, bool, ""),
    UnimplementedFeature("managed_gradient_accumulation", _E, lambda v: not v, ""),
    UnimplementedFeature("gradient_allreduce_op", _E, lambda v: v == "sum", "gradients are averaged"),
    UnimplementedFeature("data_types.grad_accum_dtype", _E, lambda v: v is not None,
                         "gradients accumulate in the parameter dtype"),
    UnimplementedFeature("checkpoint.load_universal", _E, bool, ""),
    UnimplementedFeature("fp16.fp16_master_weights_and_grads", _E, bool, "master weights are fp32"),
    UnimplementedFeature("bf16.bf16_master_weights_and_grads", _E, bool, "master weights are fp32"),
    UnimplementedFeature("bf16.bf16_optimizer_states", _E, bool, "optimizer states are fp32"),
    UnimplementedFeature("zero_optimization.legacy_stage1", _E, bool, ""),
    UnimplementedFeature("zero_optimization.zero_hpz_partition_size", _E, lambda v: v > 1, "ZeRO++ hpZ"),
    UnimplementedFeature("zero_optimization.zero_quantized_weights", _E, bool, "ZeRO++ qwZ"),
    UnimplementedFeature("zero_optimization.zero_quantized_nontrainable_weights", _E, bool, "ZeRO++"),
    UnimplementedFeature("zero_optimization.zero_quantized_gradients", _E, bool, "ZeRO++ qgZ"),
    UnimplementedFeature("zero_optimization.zeropp_loco_param", _E, lambda v: v is not None, "LoCo-ZeRO++"),
    UnimplementedFeature("zero_optimization.mics_shard_size", _E, lambda v: v > 0, "MiCS"),
    UnimplementedFeature("zero_optimization.mics_hierarchical_params_gather", _E, bool, "MiCS"),
    UnimplementedFeature("zero_optimization.zenflow", _E, lambda v: v is not None, "ZenFlow"),
    UnimplementedFeature("zero_optimization.offload_optimizer.super_offload", _E, bool, "SuperOffload"),
    # logging, monitoring, profiling, tuning: results are unchanged -> ConfigWarning
    UnimplementedFeature("tensorboard.enabled", _W, _on, ""),
    UnimplementedFeature("wandb.enabled", _W, _on, ""),
    UnimplementedFeature("csv_monitor.enabled", _W, _on, ""),
    UnimplementedFeature("comet.enabled", _W, _on, ""),
    UnimplementedFeature("flops_profiler.enabled", _W, _on, ""),
    UnimplementedFeature("comms_logger.enabled", _W, _on, "the engine counts communicated bytes itself"),
    UnimplementedFeature("autotuning.enabled", _W, _on, ""),
    UnimplementedFeature("timers", _W, _present, ""),
    UnimplementedFeature("activation_checkpointing", _W, _present,
                         "use torch.utils.checkpoint in the model"),
    UnimplementedFeature("aio", _W, _present, "only used by NVMe offload"),
    UnimplementedFeature("graph_harvesting", _W, bool, ""),
    # performance knobs of DeepSpeed's own implementation: results are unchanged -> ConfigWarning
    UnimplementedFeature("disable_allgather", _W, bool, ""),
    UnimplementedFeature("optimizer.legacy_fusion", _W, bool, ""),
    UnimplementedFeature("bf16.immediate_grad_update", _W, bool, ""),
    UnimplementedFeature("zero_optimization.use_multi_rank_bucket_allreduce", _W, lambda v: not v,
                         "we always reduce-scatter buckets"),
)


def _lookup(cfg: ZeroConfig, path: str) -> Any:
    """Value at `path`, descending into a section only as far as the feature's own key."""
    obj: Any = cfg
    for part in path.split("."):
        if isinstance(obj, BaseModel):
            if part not in type(obj).model_fields:
                return obj  # a raw dict section: the predicate looks inside
            obj = getattr(obj, part)
        else:
            return obj
    return obj


def _check_unimplemented(cfg: ZeroConfig) -> None:
    errors = []
    for feat in UNIMPLEMENTED_FEATURES:
        value = _lookup(cfg, feat.path)
        try:
            enabled = value is not None and feat.is_enabled(value)
        except (TypeError, ValueError):
            errors.append((tuple(feat.path.split(".")), f"unexpected value {_fmt(value)}"))
            continue
        if not enabled:
            continue
        note = f" ({feat.note})" if feat.note else ""
        if feat.kind == "error":
            errors.append((tuple(feat.path.split(".")), f"this DeepSpeed feature is not implemented in "
                                                        f"zero and would change results; remove it{note}"))
        else:
            _warn(f"{feat.path}: this DeepSpeed feature is not implemented in zero and is ignored; "
                  f"training results are unaffected{note}")
    if errors:
        _raise(errors)


# ---------------------------------------------------------------------------------------------
# Features a caller implements
# ---------------------------------------------------------------------------------------------

FEATURES = ("stage1", "stage2", "stage3", "offload_optimizer", "offload_param", "nvme")


def check_supported(cfg: ZeroConfig, implemented: set[str]) -> None:
    """Refuse valid settings whose implementation has not landed yet.

    Args:
        cfg: a config from `load_config`.
        implemented: names from `FEATURES` that the calling engine implements, e.g.
            {"stage1", "stage2", "offload_optimizer"}. Stage 0 needs nothing. NVMe offload is
            never supported, whatever `implemented` says.

    Raises:
        ConfigError: listing every setting that is valid but not yet supported.
    """
    unknown = set(implemented) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown feature names {sorted(unknown)}; known: {', '.join(FEATURES)}")
    z = cfg.zero_optimization
    issues: list[tuple[tuple, str]] = []
    have = ", ".join(sorted(implemented)) or "nothing"
    if z.stage > 0 and f"stage{z.stage}" not in implemented:
        issues.append((("zero_optimization", "stage"), f"zero_optimization.stage={z.stage} is not yet "
                       f"supported (implemented: {have})"))
    for name, section in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if section is None or section.device == "none":
            continue
        key = ("zero_optimization", name, "device")
        if section.device == "nvme":
            issues.append((key, f"zero_optimization.{name}.device='nvme' is not yet supported; use 'cpu'"))
        elif name == "offload_param" and z.stage != 3:
            continue  # no effect below stage 3 (warned at load)
        elif name == "offload_optimizer" and section.ratio < 1:
            issues.append((("zero_optimization", name, "ratio"), f"zero_optimization.offload_optimizer."
                           f"ratio={section.ratio} (partial offload) is not yet supported; use 1.0"))
        elif name not in implemented:
            issues.append((key, f"zero_optimization.{name}.device='cpu' is not yet supported "
                                f"(implemented: {have})"))
    if issues:
        flat = [(_path(loc), msg) for loc, msg in issues]
        raise ConfigError("; ".join(m for _, m in flat), flat)

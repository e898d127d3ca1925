"""Parse and validate a DeepSpeed-style config; the one place in `zero` that knows key names.

    cfg = load_config("ds_config.json", world_size=dist.get_world_size())
    cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.precision, ...

Key names, aliases and defaults follow DeepSpeed (see docs/config.md for the version and for what
we do not implement). Everything is checked here, before any model or process group is touched:

- a misspelt key is a `ConfigError` naming its full path and the closest valid key;
- a bad value is a `ConfigError` naming its path and the expected type or range;
- a DeepSpeed feature we do not implement is a `ConfigError` if enabling it changes the results,
  and a `ConfigWarning` if it only logs, profiles or tunes (see `UNIMPLEMENTED_FEATURES`).

[Note: "auto" values]
HuggingFace writes "auto" where its Trainer fills a value in. DeepSpeed's own config models drop
"auto" (the key counts as not given, so its default applies); we do the same for every key, after
first filling the values the caller supplies (`auto_values=`, as the HF integration does, including
bucket sizes derived from "hidden_size"). Batch keys left "auto" are simply not given, so the
batch rule below derives them. A key that is "auto" and has no default is reported as missing.
"""
from __future__ import annotations

import copy
import difflib
import inspect
import json
import pathlib
import sys
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

__all__ = [
    "ConfigError", "ConfigWarning", "ZeroConfig", "load_config", "resolve_auto", "check_supported",
    "FEATURES", "UNIMPLEMENTED_FEATURES", "DEEPSPEED_VERSION",
]

DEEPSPEED_VERSION = "0.17"  # defaults and key names follow DeepSpeed master of 2025 (>= v0.17)
AUTO = "auto"


class ConfigError(ValueError):
    """A config that cannot be used: unknown key, bad value, or unsupported feature.

    `issues` holds (key path, message) pairs; `str(err)` lists them all.
    """

    def __init__(self, message: str, issues: Optional[list[tuple[str, str]]] = None):
        super().__init__(message)
        self.issues = issues or []


class ConfigWarning(UserWarning):
    """A config key that is accepted but has no effect in `zero` (logging, profiling, deprecated)."""


def _warn(msg: str) -> None:
    warnings.warn(msg, ConfigWarning, stacklevel=4)


# ---------------------------------------------------------------------------------------------
# Base model and error translation
# ---------------------------------------------------------------------------------------------

class _Section(BaseModel):
    """Frozen, strict: unknown keys are errors; "auto" on a known key means "not given"."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              validate_default=False, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _drop_auto_and_check_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = _keys_of(cls)
        out = {k: v for k, v in data.items() if not (isinstance(v, str) and v == AUTO and k in known)}
        for name, field in cls.model_fields.items():
            if field.alias and field.alias != name and name in out and field.alias in out:
                raise ValueError(f"both '{field.alias}' and its alias '{name}' are given; keep one")
        return out


class _NestedIssues(ValueError):
    """Raised inside a validator to report issues at paths relative to the validated value."""

    def __init__(self, issues: list[tuple[tuple, str]]):
        super().__init__("; ".join(m for _, m in issues))
        self.issues = issues


def _keys_of(cls: type) -> set[str]:
    keys = set()
    for name, field in getattr(cls, "model_fields", {}).items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _submodel(annotation: Any) -> Optional[type]:
    """The _Section class inside Optional[X] / X, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _model_at(root: type, loc: tuple) -> Optional[type]:
    cls = root
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = None
        for name, f in cls.model_fields.items():
            if part in (name, f.alias):
                field = f
                break
        if field is None:
            return None
        cls = _submodel(field.annotation)
    return cls


def _all_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """Leaf key name -> full dotted path, for "did you mean section.key" hints."""
    out: dict[str, str] = {}
    for name, field in cls.model_fields.items():
        key = field.alias or name
        sub = _submodel(field.annotation)
        if sub is not None:
            out.update({k: v for k, v in _all_paths(sub, f"{prefix}{key}.").items() if k not in out})
        out.setdefault(key, f"{prefix}{key}")
    return out


def _suggest(bad: str, valid: set[str], root: Optional[type] = None) -> str:
    close = difflib.get_close_matches(bad, sorted(valid), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    if root is not None:
        path = _all_paths(root).get(bad)
        if path and "." in path:
            return f"; did you mean '{path}'?"
    return ""


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _issues_from(err: ValidationError, root: type, prefix: tuple = ()) -> list[tuple[tuple, str]]:
    """Turn pydantic's errors into (path, readable message) pairs."""
    issues: list[tuple[tuple, str]] = []
    for e in err.errors(include_url=False):
        loc = prefix + tuple(e["loc"])
        kind = e["type"]
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _NestedIssues):
            issues.extend((loc + sub, msg) for sub, msg in ctx_err.issues)
            continue
        if kind == "extra_forbidden":
            bad = str(e["loc"][-1])
            valid = _keys_of(_model_at(root, tuple(e["loc"][:-1])) or object)
            issues.append((loc, f"unknown key '{bad}'{_suggest(bad, valid, root)}"))
            continue
        if kind == "missing":
            issues.append((loc, "required key is missing (or was \"auto\" with no value supplied)"))
            continue
        msg = e["msg"]
        for head in ("Value error, ", "Assertion failed, "):
            if msg.startswith(head):
                msg = msg[len(head):]
        msg = msg.replace("Input should be", "expected")
        for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<="),
                            ("greater than", ">"), ("less than", "<")):
            msg = msg.replace(f"expected {words} ", f"expected a value {sign} ")
        if kind in ("int_from_float", "int_parsing", "int_type"):
            msg = "expected an integer"
        if kind != "value_error":
            msg += f", got {_fmt(e.get('input'))}"
        issues.append((loc, msg))
    return issues


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<config>"


def _raise(issues: list[tuple[tuple, str]], source: str = "") -> typing.NoReturn:
    flat = [(_path(loc), msg) for loc, msg in issues]
    where = f" in {source}" if source else ""
    if len(flat) == 1:
        raise ConfigError(f"invalid config{where}: {flat[0][0]}: {flat[0][1]}", flat)
    lines = "\n".join(f"  - {p}: {m}" for p, m in flat)
    raise ConfigError(f"invalid config{where} ({len(flat)} problems):\n{lines}", flat)


def _validate_nested(model: type, value: Any) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise _NestedIssues(_issues_from(err, model)) from None


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------

class FP16Config(_Section):
    """`fp16`: fp16 mixed precision with (dynamic) loss scaling."""

    enabled: bool = Field(False, description="Train with fp16 params/grads and fp32 master weights.")
    auto_cast: bool = Field(False, description="Cast floating-point inputs of forward to fp16.")
    loss_scale: float = Field(0.0, ge=0, allow_inf_nan=False,
                              description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: int = Field(16, ge=0, description="Dynamic scaling starts at 2**power.")
    loss_scale_window: int = Field(1000, gt=0,
                                   description="Overflow-free steps before the dynamic scale doubles.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale is lowered.")
    consecutive_hysteresis: bool = Field(False, description="Refill hysteresis after a step without overflow.")
    min_loss_scale: float = Field(1.0, ge=0, description="Lower bound of the dynamic loss scale.")
    fp16_master_weights_and_grads: bool = Field(False, description="Keep master weights in fp16 (not implemented).")


class BF16Config(_Section):
    """`bf16` (old name `bfloat16`): bf16 mixed precision, no loss scaling."""

    enabled: bool = Field(False, description="Train with bf16 params/grads and fp32 master weights.")
    immediate_grad_update: bool = Field(False, description="DeepSpeed BF16 optimizer knob; no effect here.")
    check_grad_overflow: bool = Field(False, description="Check bf16 grads for inf/nan before stepping.")
    bf16_master_weights_and_grads: bool = Field(False, description="Keep master weights in bf16 (not implemented).")
    bf16_optimizer_states: bool = Field(False, description="Keep Adam m/v in bf16 (not implemented).")


# ---------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW")
_DEEPSPEED_ONLY_OPTIMIZERS = ("adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam",
                              "muadamw", "musgd", "lion", "muon")


class AdamParams(_Section):
    """`optimizer.params` for Adam/AdamW (DeepSpeed FusedAdam / DeepSpeedCPUAdam defaults)."""

    lr: float = Field(1e-3, ge=0, allow_inf_nan=False, description="Learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="(beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, ge=0, allow_inf_nan=False, description="Added to the denominator.")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False,
                                description="Weight decay; decoupled (AdamW) unless adam_w_mode is false.")
    bias_correction: bool = Field(True, description="Apply Adam's bias correction to m and v.")
    adam_w_mode: bool = Field(True, description="Decoupled weight decay (AdamW). DeepSpeed's default is "
                              "true, so type Adam means AdamW unless this is set to false.")
    torch_adam: bool = Field(False, description="Use torch.optim.Adam/AdamW instead of our fused kernel.")
    amsgrad: bool = Field(False, description="Not supported (DeepSpeed's fused Adam rejects it too).")

    @model_validator(mode="before")
    @classmethod
    def _max_grad_norm(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_grad_norm" in data:
            raise ValueError("'max_grad_norm' is not an optimizer parameter; use the top-level "
                             "'gradient_clipping' key (as DeepSpeed requires)")
        return data

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v: Any) -> Any:
        ok = (isinstance(v, (list, tuple)) and len(v) == 2
              and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v))
        if not ok:
            raise ValueError(f"expected a pair [beta1, beta2] with 0 <= beta < 1, got {_fmt(v)}")
        return tuple(float(b) for b in v)

    @field_validator("amsgrad")
    @classmethod
    def _amsgrad(cls, v: bool) -> bool:
        if v:
            raise ValueError("amsgrad is not supported; remove it or set it to false")
        return v


class OptimizerConfig(_Section):
    """`optimizer`: which optimizer the engine builds when the caller passes none."""

    type: str = Field(..., description="Adam or AdamW (case-insensitive).")
    params: AdamParams = Field(default_factory=AdamParams, description="Constructor arguments.")
    legacy_fusion: bool = Field(False, description="DeepSpeed legacy fp16 optimizer switch; no effect here.")

    @model_validator(mode="before")
    @classmethod
    def _misplaced(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("adam_w_mode", "torch_adam", "lr", "betas", "eps", "weight_decay"):
                if key in data:
                    raise ValueError(f"'{key}' belongs inside optimizer.params, not optimizer")
        return data

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        for name in SUPPORTED_OPTIMIZERS:
            if v.lower() == name.lower():
                return name
        raise ValueError(f"optimizer type {v!r} is not supported; supported types: "
                         f"{', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive), or pass your own "
                         f"torch optimizer to initialize()")

    @property
    def adamw(self) -> bool:
        """True when weight decay is decoupled: type AdamW, or Adam with adam_w_mode (DeepSpeed rule)."""
        return self.type == "AdamW" or self.params.adam_w_mode


# ---------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------

class WarmupLRParams(_Section):
    """WarmupLR: lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stays."""

    warmup_min_lr: float = Field(0.0, ge=0, description="Starting learning rate.")
    warmup_max_lr: Optional[float] = Field(None, ge=0, description="Peak lr; None uses the optimizer's lr.")
    warmup_num_steps: int = Field(1000, gt=0, description="Steps of warmup.")
    warmup_type: Literal["log", "linear"] = Field("log", description="Shape of the warmup curve.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: int = Field(..., gt=0, description="Step at which the lr reaches 0.")
    warmup_max_lr: float = Field(0.001, ge=0, description="Peak learning rate.")


class WarmupCosineLRParams(_Section):
    """WarmupCosineLR: ratio of the optimizer lr warms up, then follows a cosine to cos_min_ratio."""

    total_num_steps: int = Field(..., gt=0, description="Total steps of the schedule.")
    warmup_min_ratio: float = Field(0.0, ge=0, le=1, description="Starting ratio of the optimizer lr.")
    warmup_num_steps: int = Field(1000, gt=0, description="Steps of warmup.")
    cos_min_ratio: float = Field(0.0001, ge=0, le=1, description="Final ratio of the optimizer lr.")
    warmup_type: Literal["log", "linear"] = Field("log", description="Shape of the warmup curve.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")


class OneCycleParams(_Section):
    """OneCycle: lr (and momentum) cycle between bounds, then decay."""

    cycle_min_lr: float = Field(..., ge=0, description="Lower lr bound.")
    cycle_max_lr: float = Field(..., ge=0, description="Upper lr bound.")
    decay_lr_rate: float = Field(0.0, ge=0, description="Post-cycle lr decay rate.")
    cycle_first_step_size: int = Field(2000, gt=0, description="Steps in the rising half.")
    cycle_second_step_size: Optional[int] = Field(None, gt=0, description="Falling half; None = first.")
    cycle_first_stair_count: int = Field(0, ge=0, description="Stairs in the rising half; 0 = smooth.")
    cycle_second_stair_count: Optional[int] = Field(None, ge=0, description="None = first stair count.")
    decay_step_size: int = Field(0, ge=0, description="Interval of post-cycle decay; 0 = no decay.")
    cycle_momentum: bool = Field(True, description="Cycle beta1 inversely to the lr.")
    cycle_min_mom: float = Field(0.8, ge=0, lt=1, description="Lower momentum bound.")
    cycle_max_mom: float = Field(0.9, ge=0, lt=1, description="Upper momentum bound.")
    decay_mom_rate: float = Field(0.0, ge=0, description="Post-cycle momentum decay rate.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")


class LRRangeTestParams(_Section):
    """LRRangeTest: lr grows from lr_range_test_min_lr to find a usable maximum."""

    lr_range_test_min_lr: float = Field(1e-3, ge=0, description="Starting learning rate.")
    lr_range_test_step_size: int = Field(2000, gt=0, description="Steps per increase.")
    lr_range_test_step_rate: float = Field(1.0, ge=0, description="Growth rate.")
    lr_range_test_staircase: bool = Field(False, description="Grow in stairs instead of smoothly.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")


DEEPSPEED_SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams,
}


def _torch_scheduler(name: str) -> Optional[type]:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or torch.optim.lr_scheduler._LRScheduler
    ok = isinstance(cls, type) and (issubclass(cls, base) or name == "ReduceLROnPlateau")
    return cls if ok else None


def _check_torch_scheduler_params(cls: type, params: dict) -> dict:
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in list(sig.parameters.values())[2:]
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # skip self, optimizer
    names = {p.name for p in accepted}
    issues = []
    for key in params:
        if key not in names:
            issues.append(((key,), f"unknown key '{key}' for torch.optim.lr_scheduler.{cls.__name__}"
                                   f"{_suggest(key, names)}"))
    for p in accepted:
        if p.default is inspect.Parameter.empty and p.name not in params:
            issues.append(((p.name,), f"required by torch.optim.lr_scheduler.{cls.__name__}"))
    if issues:
        raise _NestedIssues(issues)
    return dict(params)


class SchedulerConfig(_Section):
    """`scheduler`: a DeepSpeed schedule (params validated) or a torch.optim.lr_scheduler class."""

    type: str = Field(..., description="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, "
                      "or the name of a torch.optim.lr_scheduler class (e.g. CosineAnnealingLR).")
    params: Any = Field(default_factory=dict, description="Arguments of the schedule (per type).")

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v in DEEPSPEED_SCHEDULERS or _torch_scheduler(v) is not None:
            return v
        names = list(DEEPSPEED_SCHEDULERS) + [n for n in dir(torch.optim.lr_scheduler)
                                               if _torch_scheduler(n) is not None]
        close = difflib.get_close_matches(v, names, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"unknown scheduler type {v!r}{hint} (DeepSpeed schedules: "
                         f"{', '.join(DEEPSPEED_SCHEDULERS)}; or any torch.optim.lr_scheduler class)")

    @model_validator(mode="after")
    def _params(self) -> "SchedulerConfig":
        params = self.params
        if isinstance(params, BaseModel):
            return self
        if not isinstance(params, dict):
            raise _NestedIssues([(("params",), f"expected a dictionary, got {_fmt(params)}")])
        try:
            if self.type in DEEPSPEED_SCHEDULERS:
                value = _validate_nested(DEEPSPEED_SCHEDULERS[self.type], params)
            else:
                value = _check_torch_scheduler_params(
                    _torch_scheduler(self.type), {k: v for k, v in params.items() if v != AUTO})
        except _NestedIssues as err:
            raise _NestedIssues([(("params",) + loc, msg) for loc, msg in err.issues]) from None
        self.__dict__["params"] = value
        return self


# ---------------------------------------------------------------------------------------------
# ZeRO
# ---------------------------------------------------------------------------------------------

class OffloadOptimizerConfig(_Section):
    """`zero_optimization.offload_optimizer`: fp32 master weights, Adam state and step on the CPU."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where optimizer state lives.")
    nvme_path: Optional[pathlib.Path] = Field(None, description="Directory for NVMe offload.")
    buffer_count: int = Field(4, ge=0, description="NVMe swap buffers.")
    pin_memory: bool = Field(False, description="Page-locked CPU buffers for faster copies.")
    pipeline_read: bool = Field(False, description="NVMe: overlap reading the next tile.")
    pipeline_write: bool = Field(False, description="NVMe: overlap writing the previous tile.")
    fast_init: bool = Field(False, description="NVMe: fast optimizer initialization.")
    ratio: float = Field(1.0, ge=0, le=1, description="Fraction of optimizer state offloaded (1 = all).")
    super_offload: bool = Field(False, description="DeepSpeed SuperOffload (not implemented).")


class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: stage-3 parameter shards on the CPU."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where parameter shards live.")
    nvme_path: Optional[pathlib.Path] = Field(None, description="Directory for NVMe offload.")
    buffer_count: int = Field(5, ge=0, description="NVMe swap buffers.")
    buffer_size: int = Field(100_000_000, ge=0, description="NVMe swap buffer size (elements).")
    max_in_cpu: int = Field(1_000_000_000, ge=0, description="NVMe: elements kept in CPU memory.")
    pin_memory: bool = Field(False, description="Page-locked CPU buffers for faster copies.")


def _stage(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= 3:
        raise ValueError(f"expected a ZeRO stage 0, 1, 2 or 3, got {v}")
    return v


class ZeroOptimizationConfig(_Section):
    """`zero_optimization`: what is partitioned across data-parallel ranks, and how."""

    stage: int = Field(0, description="0: off; 1: optimizer state; 2: + gradients; 3: + parameters.")
    contiguous_gradients: bool = Field(True, description="Copy grads into one contiguous buffer.")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter, not all-reduce.")
    reduce_bucket_size: int = Field(500_000_000, ge=0, description="Elements reduced at a time.")
    use_multi_rank_bucket_allreduce: bool = Field(True, description="DeepSpeed perf knob; no effect here.")
    allgather_partitions: bool = Field(True, description="All-gather updated params (vs broadcasts).")
    allgather_bucket_size: int = Field(500_000_000, ge=0, description="Elements all-gathered at a time.")
    overlap_comm: Optional[bool] = Field(None, description="Overlap reduction with backward; "
                                         "default true for stage 3, false otherwise.")
    load_from_fp32_weights: bool = Field(True, description="Restore fp32 master weights from checkpoints.")
    elastic_checkpoint: bool = Field(False, description="Legacy elastic checkpoint (stage 1/2).")
    offload_param: Optional[OffloadParamConfig] = Field(None, description="Stage-3 parameter offload.")
    offload_optimizer: Optional[OffloadOptimizerConfig] = Field(None, description="Optimizer offload.")
    sub_group_size: int = Field(1_000_000_000, ge=0, description="Elements per optimizer step tile.")
    cpu_offload: Optional[bool] = Field(None, description="Deprecated: offload_optimizer.device=cpu.")
    cpu_offload_param: Optional[bool] = Field(None, description="Deprecated: offload_param.device=cpu.")
    cpu_offload_use_pin_memory: Optional[bool] = Field(None, description="Deprecated; no effect "
                                                       "(as in DeepSpeed).")
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size",
                                      description="Stage 3: elements prefetched ahead of use.")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold",
                                             description="Stage 3: params smaller than this stay whole.")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold",
                                             description="Stage 3: cap on elements kept unpartitioned.")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters",
                                     description="Stage 3: gathered elements kept before releasing.")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance",
                                    description="Stage 3: keep a param gathered if reused this soon.")
    gather_16bit_weights_on_model_save: bool = Field(
        False, alias="stage3_gather_16bit_weights_on_model_save",
        description="Stage 3: gather full 16-bit weights when saving the model.")
    stage3_gather_fp16_weights_on_model_save: Optional[bool] = Field(
        None, description="Deprecated name of stage3_gather_16bit_weights_on_model_save.")
    module_granularity_threshold: int = Field(0, ge=0, alias="stage3_module_granularity_threshold",
                                              description="Stage 3: fetch fine-grained modules as a unit.")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params",
                                                  description="Stage 3: fetch params with all-reduce.")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential",
                                       description="Stage 3: gather params one by one, unbucketed.")
    ignore_unused_parameters: bool = Field(True, description="Allow params that get no gradient.")
    legacy_stage1: bool = Field(False, description="DeepSpeed's old stage 1 (not implemented).")
    round_robin_gradients: bool = Field(False, description="Offload perf knob for stage 1/2.")
    zero_hpz_partition_size: int = Field(1, ge=0, description="ZeRO++ hpZ group size (> 1 not implemented).")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ (not implemented).")
    zero_quantized_nontrainable_weights: bool = Field(False, description="ZeRO++ (not implemented).")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ (not implemented).")
    zeropp_loco_param: Optional[dict[str, Any]] = Field(None, description="LoCo-ZeRO++ (not implemented).")
    mics_shard_size: int = Field(-1, description="MiCS shard size; > 0 not implemented.")
    mics_hierarchical_params_gather: bool = Field(False, description="MiCS (not implemented).")
    memory_efficient_linear: bool = Field(True, description="Stage 3 memory-efficient linear.")
    pipeline_loading_checkpoint: bool = Field(False, description="Stage 3 pipeline checkpoint loading.")
    override_module_apply: bool = Field(True, description="Stage 3: gather params in nn.Module.apply.")
    log_trace_cache_warnings: bool = Field(False, description="Stage 3 trace-cache logging.")
    enable_sanity_checks: bool = Field(False, description="Extra internal consistency checks.")
    zenflow: Optional[dict[str, Any]] = Field(None, description="ZenFlow (not implemented).")

    _check_stage = field_validator("stage")(_stage)

    @model_validator(mode="after")
    def _resolve(self) -> "ZeroOptimizationConfig":
        d = self.__dict__
        if self.overlap_comm is None:  # DeepSpeed: on for stage 3, off otherwise
            d["overlap_comm"] = self.stage == 3
        if self.cpu_offload is not None:
            _warn("zero_optimization.cpu_offload is deprecated; use offload_optimizer.device='cpu'")
            if self.offload_optimizer is not None and "offload_optimizer" in self.model_fields_set:
                raise ValueError("give either cpu_offload (deprecated) or offload_optimizer, not both")
            if self.cpu_offload:
                d["offload_optimizer"] = OffloadOptimizerConfig(device="cpu")
        if self.cpu_offload_param is not None:
            _warn("zero_optimization.cpu_offload_param is deprecated; use offload_param.device='cpu'")
            if self.offload_param is not None and "offload_param" in self.model_fields_set:
                raise ValueError("give either cpu_offload_param (deprecated) or offload_param, not both")
            if self.cpu_offload_param:
                d["offload_param"] = OffloadParamConfig(device="cpu")
        if self.cpu_offload_use_pin_memory is not None:
            _warn("zero_optimization.cpu_offload_use_pin_memory is deprecated and has no effect; "
                  "set pin_memory in offload_optimizer / offload_param")
        if self.stage3_gather_fp16_weights_on_model_save is not None:
            _warn("stage3_gather_fp16_weights_on_model_save is deprecated; use "
                  "stage3_gather_16bit_weights_on_model_save")
            if "gather_16bit_weights_on_model_save" in self.model_fields_set:
                raise ValueError("give either stage3_gather_fp16_weights_on_model_save (deprecated) or "
                                 "stage3_gather_16bit_weights_on_model_save, not both")
            d["gather_16bit_weights_on_model_save"] = self.stage3_gather_fp16_weights_on_model_save
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1 and self.stage != 3:
            raise ValueError("offload_optimizer.ratio < 1 (partial offload) requires stage 3")
        if self.offload_param is not None and self.offload_param.device != "none" and self.stage != 3:
            _warn(f"zero_optimization.offload_param has no effect at stage {self.stage}; "
                  "parameter offload needs stage 3 (as in DeepSpeed)")
        return self


# ---------------------------------------------------------------------------------------------
# Other sections
# ---------------------------------------------------------------------------------------------

class ParallelWriteConfig(_Section):
    pipeline_stage: bool = Field(False, description="Pipeline-parallel checkpoint writing.")


class CheckpointConfig(_Section):
    """`checkpoint`: checkpoint tag validation and loading options."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = Field("Warn", description="Check that all ranks "
                                                               "save/load the same tag (case-insensitive).")
    load_universal: bool = Field(False, description="Load a DeepSpeed universal checkpoint (not implemented).")
    use_node_local_storage: bool = Field(False, description="Each node writes to its own storage.")
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig,
                                                description="Parallel write options.")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _tag(cls, v: Any) -> Any:
        return v.capitalize() if isinstance(v, str) else v


class DataTypesConfig(_Section):
    """`data_types`."""

    grad_accum_dtype: Optional[str] = Field(None, description="Gradient accumulation dtype "
                                            "(only the default, matching the params, is implemented).")


_DTYPE_SPELLINGS = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}


def _dtype_name(v: Any) -> Any:
    if v is None or isinstance(v, torch.dtype):
        v = {None: None, torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(v, v)
    if v is None:
        return None
    if isinstance(v, str):
        for canon, spellings in _DTYPE_SPELLINGS.items():
            if v.lower() in spellings:
                return canon
    raise ValueError(f"expected one of 'fp32', 'fp16', 'bf16' (or null), got {_fmt(v)}")


_Section_ = Optional[dict[str, Any]]  # an accepted-but-unimplemented DeepSpeed section


class ZeroConfig(_Section):
    """The whole config. Build it with `load_config` (which also resolves the batch sizes)."""

    # batch: train = micro * accumulation * world_size; see load_config
    train_batch_size: Optional[int] = Field(None, gt=0, description="Samples per optimizer step, all ranks.")
    train_micro_batch_size_per_gpu: Optional[int] = Field(None, gt=0, description="Samples per forward "
                                                          "on one rank.")
    gradient_accumulation_steps: Optional[int] = Field(None, gt=0, description="Micro-batches per step.")
    managed_gradient_accumulation: bool = Field(True, description="Engine tracks accumulation boundaries "
                                                "(false is not implemented).")
    # training
    gradient_clipping: float = Field(0.0, ge=0, allow_inf_nan=False, description="Clip the global grad "
                                     "norm to this value; 0 disables clipping.")
    prescale_gradients: bool = Field(False, description="Divide grads by world size before reducing.")
    gradient_predivide_factor: float = Field(1.0, gt=0, description="Divide grads by this before the "
                                             "reduction and by world_size/factor after.")
    gradient_allreduce_op: Literal["mean", "sum"] = Field("mean", description="Average or sum grads "
                                                          "across ranks ('sum' not implemented).")
    communication_data_type: Optional[str] = Field(None, description="dtype of gradient communication: "
                                                   "fp32, fp16, bf16; null = the training dtype.")
    sparse_gradients: bool = Field(False, description="CSR gradients for embeddings (not implemented).")
    disable_allgather: bool = Field(False, description="Legacy DeepSpeed knob; no effect here.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision "
                             "(old name: bfloat16).")
    optimizer: Optional[OptimizerConfig] = Field(None, description="Optimizer to build; None = the "
                                                 "caller passes one.")
    scheduler: Optional[SchedulerConfig] = Field(None, description="LR scheduler to build.")
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig,
                                                      description="ZeRO stage and its knobs.")
    zero_allow_untested_optimizer: bool = Field(False, description="Allow a client optimizer that is "
                                                "not Adam/AdamW with ZeRO.")
    zero_force_ds_cpu_optimizer: bool = Field(True, description="With offload, require our CPU Adam.")
    # logging / io
    steps_per_print: Optional[int] = Field(None, ge=0, description="Log progress every N steps; null = never.")
    wall_clock_breakdown: bool = Field(False, description="Time forward/backward/step.")
    memory_breakdown: bool = Field(False, description="Log memory use.")
    dump_state: bool = Field(False, description="Print the engine state after initialization.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch.")
    vocabulary_size: Optional[int] = Field(None, gt=0, description="Only used for an alignment warning.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint options.")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Extra dtypes.")
    # DeepSpeed features we accept only to refuse or ignore them: see UNIMPLEMENTED_FEATURES
    amp: _Section_ = Field(None, description="NVIDIA Apex AMP (not implemented).")
    torch_autocast: _Section_ = Field(None, description="torch.autocast mixed precision (not implemented).")
    sparse_attention: _Section_ = Field(None, description="Sparse attention (not implemented).")
    pipeline: _Section_ = Field(None, description="Pipeline parallelism (not implemented).")
    progressive_layer_drop: _Section_ = Field(None, description="Not implemented.")
    curriculum_learning: _Section_ = Field(None, description="Not implemented.")
    data_efficiency: _Section_ = Field(None, description="Not implemented.")
    compression_training: _Section_ = Field(None, description="Not implemented.")
    quantize_training: _Section_ = Field(None, description="MoQ (not implemented).")
    eigenvalue: _Section_ = Field(None, description="Not implemented.")
    elasticity: _Section_ = Field(None, description="Not implemented.")
    hybrid_engine: _Section_ = Field(None, description="Not implemented.")
    weight_quantization: _Section_ = Field(None, description="Not implemented.")
    tensor_parallel: _Section_ = Field(None, description="AutoTP (not implemented).")
    compile: _Section_ = Field(None, description="DeepCompile (not implemented).")
    nebula: _Section_ = Field(None, description="Nebula checkpoint service (not implemented).")
    datastates: _Section_ = Field(None, description="DataStates checkpointing (not implemented).")
    sequence_parallel_size: int = Field(1, ge=1, description="Ulysses sequence parallelism (> 1 not implemented).")
    use_data_before_expert_parallelism: bool = Field(False, description="MoE topology (not implemented).")
    tensorboard: _Section_ = Field(None, description="Monitoring (ignored with a warning).")
    wandb: _Section_ = Field(None, description="Monitoring (ignored with a warning).")
    csv_monitor: _Section_ = Field(None, description="Monitoring (ignored with a warning).")
    comet: _Section_ = Field(None, description="Monitoring (ignored with a warning).")
    flops_profiler: _Section_ = Field(None, description="Profiling (ignored with a warning).")
    comms_logger: _Section_ = Field(None, description="Communication logging (ignored with a warning).")
    autotuning: _Section_ = Field(None, description="Autotuner (ignored with a warning).")
    timers: _Section_ = Field(None, description="Throughput timers (ignored with a warning).")
    activation_checkpointing: _Section_ = Field(None, description="deepspeed.checkpointing options "
                                                "(ignored with a warning; use torch.utils.checkpoint).")
    aio: _Section_ = Field(None, description="Async I/O for NVMe offload (ignored with a warning).")
    graph_harvesting: bool = Field(False, description="CUDA graph harvesting (ignored with a warning).")

    @model_validator(mode="before")
    @classmethod
    def _legacy_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "bfloat16" in data:
            if "bf16" in data:
                raise ValueError("both 'bf16' and its old name 'bfloat16' are given; keep 'bf16'")
            data["bf16"] = data.pop("bfloat16")
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):  # DeepSpeed's oldest form: "zero_optimization": true means stage 1
            _warn("'zero_optimization': true/false is deprecated; use {'stage': N}")
            data["zero_optimization"] = {"stage": 1 if zero else 0}
        return data

    _check_comm_dtype = field_validator("communication_data_type", mode="before")(
        classmethod(lambda cls, v: _dtype_name(v)))

    @model_validator(mode="after")
    def _precision(self) -> "ZeroConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise _NestedIssues([(("bf16", "enabled"), "fp16.enabled and bf16.enabled are both true; "
                                                        "enable at most one")])
        return self

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32": the dtype of parameters and gradients during forward/backward."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        """`precision` as a torch dtype."""
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.precision]

    @property
    def communication_dtype(self) -> torch.dtype:
        """dtype gradients are reduced in: communication_data_type, else the training dtype."""
        name = self.communication_data_type or self.precision
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


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
# "auto" values (see [Note: "auto" values])
# ---------------------------------------------------------------------------------------------

_HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "param_persistence_threshold")


def resolve_auto(config: Mapping[str, Any], values: Optional[Mapping[str, Any]] = None) -> dict:
    """Return a copy of `config` with "auto" values filled from `values`, as HF's Trainer does.

    Args:
        config: a DeepSpeed-style config dict (not modified).
        values: dotted key path -> value, e.g. {"optimizer.params.lr": 3e-4,
            "train_micro_batch_size_per_gpu": 8}. The special key "hidden_size" fills
            zero_optimization.reduce_bucket_size = h*h and, at stage 3,
            stage3_prefetch_bucket_size = int(0.9*h*h) and stage3_param_persistence_threshold = 10*h.

    Only keys whose value is "auto" are filled; "auto" keys without a supplied value are left as
    they are (load_config then treats them as not given).
    """
    out = copy.deepcopy(dict(config))
    values = dict(values or {})
    hidden = values.pop("hidden_size", None)

    def fill(path: str, value: Any) -> None:
        parts = path.split(".")
        node = out
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return
        if node.get(parts[-1]) == AUTO:
            node[parts[-1]] = value

    for path, value in values.items():
        fill(path, value)
    zero = out.get("zero_optimization")
    if hidden is not None and isinstance(zero, dict):
        h = int(hidden)
        fill("zero_optimization.reduce_bucket_size", h * h)
        if zero.get("stage") == 3:
            for prefix in ("stage3_", ""):
                fill(f"zero_optimization.{prefix}prefetch_bucket_size", int(0.9 * h * h))
                fill(f"zero_optimization.{prefix}param_persistence_threshold", 10 * h)
    return out


# ---------------------------------------------------------------------------------------------
# Batch sizes
# ---------------------------------------------------------------------------------------------

def _resolve_batch(cfg: ZeroConfig, world_size: int) -> dict[str, int]:
    """DeepSpeed's rule: train = micro * accum * world; any two give the third; one alone gives what
    it can (train -> micro = train/world, accum = 1; micro -> accum = 1)."""
    train, micro, accum = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                           cfg.gradient_accumulation_steps)
    names = "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps"

    def exact(what: str, given: str, factor: int) -> int:
        if train % (factor * world_size) != 0 or train // (factor * world_size) == 0:
            _raise([((what,), f"cannot be derived: train_batch_size ({train}) must be a positive multiple "
                     f"of {given} * world_size = {factor} * {world_size} = {factor * world_size}")])
        return train // (factor * world_size)

    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world_size:
            _raise([(("train_batch_size",), f"train_batch_size must equal train_micro_batch_size_per_gpu"
                     f" * gradient_accumulation_steps * world_size, but {train} != {micro} * {accum} * "
                     f"{world_size} = {micro * accum * world_size}")])
    elif train is not None and micro is not None:
        accum = exact("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", micro)
    elif train is not None and accum is not None:
        micro = exact("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", accum)
    elif micro is not None and accum is not None:
        train = micro * accum * world_size
    elif train is not None:
        accum = 1
        micro = exact("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", 1)
    elif micro is not None:
        accum, train = 1, micro * world_size
    else:
        _raise([(("train_batch_size",), f"batch size not given: set train_batch_size or "
                 f"train_micro_batch_size_per_gpu (of {names}, any two determine the third)")])
    return {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum}


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _read(config: Union[Mapping[str, Any], str, pathlib.Path]) -> tuple[dict, str]:
    if isinstance(config, Mapping):
        return dict(config), ""
    if isinstance(config, (str, pathlib.Path)):
        path = pathlib.Path(config)
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror or err}") from None
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except ValueError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
        return data, str(path)
    raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def load_config(config: Union[Mapping[str, Any], str, pathlib.Path], world_size: int = 1, *,
                auto_values: Optional[Mapping[str, Any]] = None) -> ZeroConfig:
    """Parse, validate and resolve a DeepSpeed-style config.

    Args:
        config: a dict, or a path (str or pathlib.Path) to a JSON file.
        world_size: number of data-parallel ranks, used by the batch-size rule.
        auto_values: values for "auto" keys, by dotted path (see `resolve_auto`).

    Returns:
        A frozen `ZeroConfig` whose three batch keys are all set.

    Raises:
        ConfigError: unknown key, bad value, inconsistent batch sizes, or a DeepSpeed feature that
            is not implemented and would change results. Warnings (`ConfigWarning`) are issued for
            accepted keys that have no effect (logging/monitoring, deprecated spellings).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    data, source = _read(config)
    data = resolve_auto(data, auto_values)
    try:
        cfg = ZeroConfig.model_validate(data)
    except ValidationError as err:
        _raise(_issues_from(err, ZeroConfig), source)
    _check_unimplemented(cfg)
    return cfg.model_copy(update=_resolve_batch(cfg, world_size))


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

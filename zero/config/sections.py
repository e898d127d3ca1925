"""The pydantic models of the config's sections (`fp16`, `optimizer`, `scheduler`, `zero_optimization`...).

Every section is frozen and strict: an unknown key is an error, "auto" on a known key means "not
given" (see [Note: "auto" values] in zero/config/loading.py). The root model is `ZeroConfig`
(zero/config/model.py).
"""
from __future__ import annotations

import math
import os
import pathlib
import sys
import typing
from typing import Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zero.config.elasticity import LATEST_VERSION as LATEST_ELASTICITY_VERSION
from zero.config.errors import _fmt, _keys_of, _NestedIssues, _warn
from zero.config.features import with_placeholders

AUTO = "auto"

FP32_MAX = torch.finfo(torch.float32).max  # the largest learning rate (or scale) a float32 can hold


# ---------------------------------------------------------------------------------------------
# Base section
# ---------------------------------------------------------------------------------------------

# [Note: JSON types are strict]
# pydantic's lax mode reads "4" as 4, true as 1, and "false", "yes" or 0 as booleans. In JSON those
# are different types, and a quoted number or a string boolean is nearly always a mistake (a
# template or shell variable pasted in quotes), which lax mode would turn into a plausible value
# without a word. So every bool, int and float field of every section accepts only
# its own JSON type: true/false for a bool, a number that is not a boolean for an int or a float.
# "auto" is the one string any field accepts (see [Note: "auto" values] in zero/config/loading.py).
# An int field still accepts a float with an integral value, because DeepSpeed configs write sizes
# as 5e8 (a JSON float); a fractional one is an error. A float must be finite: no field of this
# config has a meaning for inf or nan. `_Section` checks all of this before pydantic converts
# anything, so a new field gets the same rules without doing anything.

_JSON_SCALARS = (bool, int, float)


def _scalar_type(annotation: Any) -> Optional[type]:
    """bool, int or float for a field typed X or Optional[X] with X one of those; else None."""
    if annotation in _JSON_SCALARS:
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Union and len(args) == 1 and args[0] in _JSON_SCALARS:
        return args[0]
    return None


def _json_type_problem(kind: type, value: Any) -> Optional[str]:
    """Why `value` is not a JSON `kind` (see [Note: JSON types are strict]); None if it is one."""
    if value is None:
        return None  # whether null is allowed is the field's business
    if kind is bool:
        if isinstance(value, bool):
            return None
        quoted = " (a JSON boolean, without quotes)" if isinstance(value, str) else " (a JSON boolean)"
        return f"expected true or false{quoted}, got {_fmt(value)}"
    what = "an integer" if kind is int else "a number"
    if isinstance(value, bool):
        return f"expected {what}, got {str(value).lower()} (a JSON boolean is not a number)"
    if isinstance(value, str):
        return (f"expected {what}, got the string {_fmt(value)} (write numbers without quotes; the only "
                f"string allowed here is \"auto\")")
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        return f"expected a finite number, got {value}"
    return None


class _Section(BaseModel):
    """Frozen, strict: unknown keys are errors; "auto" on a known key means "not given"; JSON types
    are not converted into one another (see [Note: JSON types are strict])."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              validate_default=False, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _drop_auto_and_check_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = _keys_of(cls)
        out = {k: v for k, v in data.items() if not (isinstance(v, str) and v == AUTO and k in known)}
        kinds: dict[str, type] = {}
        for name, field in cls.model_fields.items():
            if field.alias and field.alias != name and name in out and field.alias in out:
                raise ValueError(f"both '{field.alias}' and '{name}' are given, two names of one key; keep one")
            kind = _scalar_type(field.annotation)
            if kind is not None:
                kinds.update({name: kind, **({field.alias: kind} if field.alias else {})})
        issues = [((key,), problem) for key, value in out.items() if key in kinds
                  and (problem := _json_type_problem(kinds[key], value)) is not None]
        if issues:
            raise _NestedIssues(issues)
        return out


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------

# A loss scale above 2**63 is far past any useful one (fp16 tops out near 2**16, so gradients
# scaled that much overflow on every step) and 2**63 * loss stays finite in fp32 (max ~2**128) for
# any loss below 2**64. DeepSpeed's default initial_scale_power is 16; it sets no bound, and a
# power of 2000 overflows Python's float when the scaler is built.
MAX_LOSS_SCALE_POWER = 63


@with_placeholders("fp16")
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

    @field_validator("initial_scale_power")
    @classmethod
    def _power(cls, v: int) -> int:
        if v > MAX_LOSS_SCALE_POWER:
            raise ValueError(f"expected 0..{MAX_LOSS_SCALE_POWER}: dynamic loss scaling starts at "
                             f"2**initial_scale_power, which must stay finite in fp32 (DeepSpeed's default is 16), "
                             f"got {v}")
        return v

    @field_validator("loss_scale", "min_loss_scale")
    @classmethod
    def _scale(cls, v: float) -> float:
        if v > 2.0 ** MAX_LOSS_SCALE_POWER:
            raise ValueError(f"expected a loss scale <= 2**{MAX_LOSS_SCALE_POWER}: the scaled loss must stay "
                             f"finite in fp32, got {v!r}")
        return v


@with_placeholders("bf16")
class BF16Config(_Section):
    """`bf16` (old name `bfloat16`): bf16 mixed precision, no loss scaling."""

    enabled: bool = Field(False, description="Train with bf16 params/grads and fp32 master weights.")
    bf16_master_weights_and_grads: bool = Field(
        False, description="Keep the master weights and the gradient shards in bf16 (2 bytes each instead of 4): "
        "the bf16 parameters are their own master. The update is rounded stochastically unless "
        "bf16.stochastic_rounding is false (see docs/config.md, 'State formats').")
    bf16_optimizer_states: bool = Field(
        False, description="Keep Adam's exp_avg and exp_avg_sq in bf16 (the same as optimizer.params.state_dtype "
        "'bf16').")
    stochastic_rounding: Optional[bool] = Field(
        None, description="zero's key: round bf16 master weights and bf16 moments stochastically (unbiased: the "
        "expected stored value is the fp32 result). null = true whenever the master or the moments are bf16; "
        "false = round to nearest even, as DeepSpeed does (comparable with it bit for bit).")


# ---------------------------------------------------------------------------------------------
# Learning rates (the optimizer section is in zero/config/optimizer.py)
# ---------------------------------------------------------------------------------------------

def _lr(v: Optional[float]) -> Optional[float]:
    """A learning rate must fit a float32: optimizers and schedulers compute with it in fp32."""
    if v is not None and v > FP32_MAX:
        raise ValueError(f"expected a learning rate <= {FP32_MAX:.6g} (the largest float32), got {v!r}")
    return v


# ---------------------------------------------------------------------------------------------
# ZeRO
# ---------------------------------------------------------------------------------------------

def _check_nvme(section: _Section, name: str, keys: tuple[str, ...]) -> None:
    """NVMe-only `keys` set with another device warn; `device: nvme` needs an existing, writable
    directory, checked before anything is built."""
    if section.device != "nvme":
        for key in sorted(section.model_fields_set & set(keys)):
            _warn(f"zero_optimization.{name}.{key} = {getattr(section, key)} has no effect in zero with device "
                  f"{section.device!r}: only device 'nvme' uses it")
        return
    _check_nvme_path(name, section.nvme_path)


def _check_nvme_path(section: str, path: Optional[pathlib.Path]) -> None:
    if path is None:
        problem = (f"is missing: {section}.device 'nvme' needs the directory (on the NVMe drive) where each rank "
                   f"keeps its swap files")
    elif not path.is_dir():
        problem = f"{str(path)!r} is not an existing directory (create it on the NVMe drive first)"
    elif not os.access(path, os.W_OK | os.X_OK):
        problem = f"{str(path)!r} is not writable by this process"
    else:
        return
    raise _NestedIssues([(("nvme_path",), problem)])


@with_placeholders("zero_optimization.offload_optimizer")
class OffloadOptimizerConfig(_Section):
    """`zero_optimization.offload_optimizer`: fp32 master weights, optimizer state and step on the CPU,
    the state in host memory (`cpu`) or in files on an NVMe drive (`nvme`)."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where optimizer state lives: none, cpu "
                                                   "(host memory) or nvme (files in nvme_path).")
    nvme_path: Optional[pathlib.Path] = Field(None, description="NVMe: the directory of the swap files (must "
                                              "exist and be writable).")
    buffer_count: int = Field(4, ge=1, description="NVMe: host buffers of one sub-group's state each; reads ahead "
                              "and writes behind are bounded by them.")
    pin_memory: bool = Field(False, description="Page-locked CPU buffers for faster copies.")
    pipeline_read: bool = Field(True, description="NVMe: read the next sub-groups while one is stepped (zero's "
                                "default true; DeepSpeed's false).")
    pipeline_write: bool = Field(True, description="NVMe: write a stepped sub-group back while the next is "
                                 "stepped (zero's default true; DeepSpeed's false).")
    ratio: float = Field(1.0, ge=0, le=1, description="Fraction of optimizer state offloaded; only 1 (all) "
                         "is implemented, < 1 is refused.")

    @field_validator("ratio")
    @classmethod
    def _whole(cls, v: float) -> float:
        if v < 1:
            raise ValueError(f"ratio={v} (partial offload) is not yet supported in zero; use 1.0 "
                             f"(all optimizer state offloaded)")
        return v

    @model_validator(mode="after")
    def _nvme(self) -> OffloadOptimizerConfig:
        _check_nvme(self, "offload_optimizer", ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write"))
        return self


@with_placeholders("zero_optimization.offload_param")
class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: stage-3 parameter shards in host memory (`cpu`) or in files
    on an NVMe drive (`nvme`), fetched ahead of the modules that use them."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where parameter shards live: none, cpu "
                                                   "(host memory) or nvme (files in nvme_path).")
    nvme_path: Optional[pathlib.Path] = Field(None, description="NVMe: the directory of the swap files (must "
                                              "exist and be writable).")
    pin_memory: bool = Field(False, description="Page-locked CPU buffers for faster copies.")
    buffer_count: int = Field(5, ge=1, description="NVMe: host buffers of one unit's shard each, read ahead of "
                              "the modules that use them.")
    buffer_size: int = Field(100_000_000, ge=1, description="NVMe: elements a buffer holds; at least the largest "
                             "unit's shard (checked at initialize).")
    max_in_cpu: int = Field(1_000_000_000, ge=0, description="NVMe: elements of parameter shards kept in host memory "
                            "(the first units, and the small persistent parameters always); the rest live on disk.")

    @model_validator(mode="after")
    def _nvme(self) -> OffloadParamConfig:
        _check_nvme(self, "offload_param", ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"))
        return self


@with_placeholders("aio")
class AioConfig(_Section):
    """`aio`: how NVMe offload reads and writes its swap files (zero/ops/aio.py)."""

    block_size: int = Field(1_048_576, ge=4096, description="Bytes per read or write request.")
    queue_depth: int = Field(8, ge=1, description="Blocks the I/O queue holds before it grows (zero's threads "
                             "each keep one transfer in flight).")
    intra_op_parallelism: int = Field(1, ge=1, alias="thread_count",
                                      description="I/O threads (DeepSpeed's older name: thread_count).")


# CPU Adam runs on tiles of `sub_group_size` elements, and each tile has a fixed cost (a Python
# iteration, five slices, a kernel call, a copy back): about 25 us, as long as Adam takes on ~15,000
# elements. Measured on a 1M-parameter model: 1.5 ms per step with large tiles, 3.8 ms with 10,000,
# 26 ms with 1,000 (17x), 25 s with 1 (15,000x). Tiles below SMALL_SUB_GROUP_SIZE warn. 1000 is
# lower than the overhead argues for (~100,000 would keep it near 15%) because configs and tests
# use sub_group_size 1000 for small models; below it the step is always > 10x slower.
SMALL_SUB_GROUP_SIZE = 1000


def _stage(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= 3:
        raise ValueError(f"expected a ZeRO stage 0, 1, 2 or 3, got {v}")
    return v


@with_placeholders("zero_optimization")
class ZeroOptimizationConfig(_Section):
    """`zero_optimization`: what is partitioned across data-parallel ranks, and how."""

    stage: int = Field(0, description="0: off; 1: optimizer state; 2: + gradients; 3: + parameters.")
    reduce_scatter: bool = Field(True, description="Stages 1/2: reduce gradients with reduce-scatter; false "
                                 "all-reduces whole buckets (same numbers, twice the traffic).")
    reduce_bucket_size: int = Field(500_000_000, ge=0, description="Elements reduced at a time.")
    allgather_bucket_size: int = Field(500_000_000, ge=0, description="Elements all-gathered at a time.")
    overlap_comm: Optional[bool] = Field(None, description="Overlap reduction with backward; "
                                         "default true for stage 3, false otherwise.")
    zero_hpz_partition_size: int = Field(1, ge=1, description="ZeRO++ hpZ (stage 3): ranks of a node that keep a "
                                         "secondary shard of each unit from forward, so backward gathers inside the "
                                         "node; 1: off.")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ (stage 3): all-gather parameters as int8 "
                                         "blocks with one scale per 256 elements (about half the bytes of bf16); "
                                         "masters, optimizer states and gradient reductions stay exact.")
    zero_quantized_nontrainable_weights: bool = Field(False, description="ZeRO++ (stage 3): the same for the units "
                                                      "of frozen parameters only (LoRA's base weights).")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ (stage 3): reduce-scatter gradients as "
                                           "two int8 all-to-alls, inside each node and then across nodes; the "
                                           "optimizer's masters and states stay exact.")
    mics_hierarchical_params_gather: bool = Field(False, description="Stage 3: all-gather parameters in two hops, "
                                                  "across nodes among the ranks at one place of every node, then "
                                                  "inside each node (exact copies; 1 / ranks-per-node of the bytes "
                                                  "across nodes). Needs the same number of ranks on every node.")
    mics_shard_size: Union[int, Literal["node"]] = Field(-1, description="Hybrid sharding (MiCS, HSDP): shard the "
                                                         "states over groups of this many data-parallel ranks and "
                                                         "replicate them across the groups; \"node\": the data-parallel "
                                                         "ranks of one node (torchrun's LOCAL_WORLD_SIZE); -1: over "
                                                         "every rank.")
    offload_param: Optional[OffloadParamConfig] = Field(None, description="Stage-3 parameter offload.")
    offload_optimizer: Optional[OffloadOptimizerConfig] = Field(None, description="Optimizer offload.")
    sub_group_size: int = Field(1_000_000_000, ge=0, description="With offload_optimizer: elements per CPU "
                                "Adam tile (the engine caps it). Without it: no effect (changed: warns).")
    cpu_offload: Optional[bool] = Field(None, description="Deprecated: offload_optimizer.device=cpu.")
    cpu_offload_param: Optional[bool] = Field(None, description="Deprecated: offload_param.device=cpu.")
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
    ignore_unused_parameters: bool = Field(True, description="Allow trainable params that get no gradient; "
                                           "false makes one an error at the end of backward.")
    override_module_apply: bool = Field(True, description="Stage 3: module.apply(fn) sees gathered parameters.")
    log_trace_cache_warnings: bool = Field(False, description="Stage 3: warn when the recorded order of units "
                                           "changes.")
    enable_sanity_checks: bool = Field(False, description="Stage 3: check every collective's rank-divergence "
                                       "tag before issuing it (one synchronisation per collective).")

    _check_stage = field_validator("stage")(_stage)

    @field_validator("reduce_bucket_size", "allgather_bucket_size")
    @classmethod
    def _bucket(cls, v: int) -> int:
        if v == 0:
            raise ValueError("expected a value >= 1 (elements per bucket; 0 would make every bucket empty; "
                             "DeepSpeed's default is 5e8), got 0")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> ZeroOptimizationConfig:
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
        if self.stage3_gather_fp16_weights_on_model_save is not None:
            _warn("stage3_gather_fp16_weights_on_model_save is deprecated; use "
                  "stage3_gather_16bit_weights_on_model_save")
            if "gather_16bit_weights_on_model_save" in self.model_fields_set:
                raise ValueError("give either stage3_gather_fp16_weights_on_model_save (deprecated) or "
                                 "stage3_gather_16bit_weights_on_model_save, not both")
            d["gather_16bit_weights_on_model_save"] = self.stage3_gather_fp16_weights_on_model_save
        self._check_sub_group_size()
        self._warn_without_effect()
        return self

    def _check_sub_group_size(self) -> None:
        """With optimizer offload, sub_group_size is the CPU Adam tile: 0 (DeepSpeed's "each parameter
        alone") takes the largest tile, with a warning, and small ones warn.
        Without it the key is not read (0 appears in published configs), see _warn_without_effect."""
        if self.offload_optimizer is None or self.offload_optimizer.device == "none":
            return
        if self.sub_group_size == 0:  # in published configs (axolotl's): DeepSpeed then steps each parameter alone
            _warn("zero_optimization.sub_group_size = 0: DeepSpeed then updates each parameter as a sub-group of "
                  "its own; zero's CPU Adam tiles do not follow parameters (the results are the same either "
                  "way), so it takes its largest tile (4M elements), as for DeepSpeed's default 1e9")
            return
        if self.sub_group_size < SMALL_SUB_GROUP_SIZE:
            _warn(f"zero_optimization.sub_group_size = {self.sub_group_size} makes CPU Adam work on tiles of "
                  f"{self.sub_group_size} elements; each tile has a fixed overhead worth ~15,000 elements of Adam, "
                  f"so the optimizer step is more than 10x slower than with large tiles. Use at least "
                  f"{SMALL_SUB_GROUP_SIZE}, better 1e5 or more (DeepSpeed's default 1e9 is fine: zero caps tiles "
                  f"at 4M elements)")

    def _warn_without_effect(self) -> None:
        """READ keys that cannot matter with the other settings (see [Note: what zero does with a
        DeepSpeed key] in zero/config/features.py)."""
        if self.offload_param is not None and self.offload_param.device != "none" and self.stage != 3:
            _warn(f"zero_optimization.offload_param has no effect at stage {self.stage}; "
                  "parameter offload needs stage 3 (as in DeepSpeed)")
        for name, section in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if section is not None and section.device == "none" and section.pin_memory:
                _warn(f"zero_optimization.{name}.pin_memory has no effect with device 'none'")
        offloaded = self.offload_optimizer is not None and self.offload_optimizer.device != "none"
        if self.sub_group_size != type(self).model_fields["sub_group_size"].default and not offloaded:
            _warn(f"zero_optimization.sub_group_size = {self.sub_group_size} has no effect without "
                  "offload_optimizer: zero uses it only as the tile size of its CPU Adam")
        if self.stage in (0, 3) and not self.reduce_scatter:
            _warn(f"zero_optimization.reduce_scatter = false has no effect at stage {self.stage}: stage 0 "
                  "all-reduces and stage 3 always reduce-scatters (the numbers are the same either way)")
        for key in ("allgather_bucket_size", "reduce_bucket_size"):
            if self.stage == 3 and getattr(self, key) != type(self).model_fields[key].default:
                _warn(f"zero_optimization.{key} has no effect at stage 3: parameters are gathered and their "
                      f"gradients reduced one unit at a time (see stage3_module_granularity_threshold), with at "
                      f"most one reduction in flight")


# ---------------------------------------------------------------------------------------------
# Other sections
# ---------------------------------------------------------------------------------------------

@with_placeholders("checkpoint.parallel_write")
class ParallelWriteConfig(_Section):
    """`checkpoint.parallel_write`: DeepSpeed's keys only (see UNIMPLEMENTED_FEATURES)."""


@with_placeholders("activation_checkpointing")
class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing`: ZeRO-R's checkpoints for deepspeed.checkpointing.checkpoint (see
    [Note: ZeRO-R checkpoints] in zero/activations.py); DeepSpeed's layout and timing knobs warn."""

    partition_activations: bool = Field(False, description="Keep each checkpointed block's inputs as a 1/T slice "
                                        "over the tensor-parallel group, all-gathered before the recomputation.")
    cpu_checkpointing: bool = Field(False, description="Keep checkpointed inputs in host memory (a no-op, logged, "
                                    "on a CPU-only run).")


@with_placeholders("checkpoint")
class CheckpointConfig(_Section):
    """`checkpoint`: training-checkpoint options (see docs/checkpoint.md). `async_save` is zero's;
    DeepSpeed's other keys change nothing here and warn (`load_universal` is refused)."""

    async_save: bool = Field(False, description="save_checkpoint snapshots the state to host memory and writes it in "
                             "the background while training goes on.")
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig,
                                                description="Parallel write options.")

    tag_validation: Literal["Ignore", "Warn", "Fail"] = Field(
        "Warn", description="When ranks pass different tags to save_checkpoint: 'Warn' warns and saves under rank "
        "0's tag, 'Ignore' saves under rank 0's tag, 'Fail' raises naming the tags (case-insensitive).")
    dir: Optional[str] = Field(None, description="zero's: the directory of periodic checkpoints (save_interval) and of "
                            "auto_resume: shared by all ranks, or each node's own with use_node_local_storage.")
    save_interval: Optional[int] = Field(None, ge=1, description="zero's: save to `dir` after every this many optimizer "
                                      "steps (asynchronously with async_save).")
    keep_last: Optional[int] = Field(None, ge=1, description="zero's: keep only the newest this many periodic "
                                  "checkpoints in `dir` (default: all).")
    use_node_local_storage: bool = Field(False, description="Each node writes its own ranks' files to its own disk "
                                         "(no shared filesystem needed); a load needs every node's files on that "
                                         "node and refuses, naming the node and the missing rank files, when they "
                                         "are absent.")
    auto_resume: bool = Field(False, description="zero's: initialize loads the newest complete checkpoint in `dir` "
                              "(every rank the same; incomplete ones skipped with a log line), data loader position "
                              "and RNG included; a fresh start when there is none.")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _tag(cls, v: Any) -> Any:
        return v.capitalize() if isinstance(v, str) else v


@with_placeholders("elasticity")
class ElasticityConfig(_Section):
    """`elasticity`: DeepSpeed's elastic batch sizes, versions 0.1 and 0.2 (zero/config/elasticity.py,
    docs/checkpoint.md "Restarting on another number of ranks")."""

    enabled: bool = Field(False, description="Choose the global batch from this section, so that a restart on "
                          "another number of ranks keeps it (the batch keys outside it are then errors unless "
                          "ignore_non_elastic_batch_info).")
    max_train_batch_size: Optional[int] = Field(None, ge=1, description="The largest global batch accepted "
                                                "(needed when enabled).")
    micro_batch_sizes: Optional[list[int]] = Field(None, min_length=1, description="The micro-batch sizes a rank "
                                                   "may run (needed when enabled); the largest that divides a "
                                                   "rank's share is used.")
    min_gpus: int = Field(1, ge=1, description="The fewest ranks the batch should suit.")
    max_gpus: int = Field(10000, ge=1, description="The most ranks the batch should suit.")
    prefer_larger_batch: bool = Field(True, description="Of batches that suit equally many rank counts, take the "
                                      "larger.")
    ignore_non_elastic_batch_info: bool = Field(False, description="Let the section override the batch keys set "
                                                "outside it (else setting them is an error).")
    version: float = Field(LATEST_ELASTICITY_VERSION, description="0.1: count ranks, fail on a world size that "
                           "cannot keep the batch; 0.2: count nodes of num_gpus_per_node ranks with "
                           "model_parallel_size per replica, and give another size a batch of its own.")
    num_gpus_per_node: int = Field(1, ge=1, description="Version 0.2: ranks per node.")
    model_parallel_size: int = Field(1, ge=1, description="Version 0.2: ranks per model replica (pipeline stages x "
                                     "tensor slices x sequence ranks).")

    @field_validator("micro_batch_sizes")
    @classmethod
    def _positive(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and any(m < 1 for m in v):
            raise ValueError(f"must be positive integers, got {v}")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: float) -> float:
        if v not in (0.1, 0.2):
            raise ValueError(f"must be 0.1 or 0.2, got {v}")
        return v

    @model_validator(mode="after")
    def _complete(self) -> ElasticityConfig:
        if not self.enabled:
            return self
        missing = [k for k in ("max_train_batch_size", "micro_batch_sizes") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"enabled elasticity needs {' and '.join(missing)}")
        if self.max_gpus < self.min_gpus:
            raise ValueError(f"max_gpus ({self.max_gpus}) is below min_gpus ({self.min_gpus})")
        if max(self.micro_batch_sizes) > self.max_train_batch_size:
            raise ValueError(f"micro_batch_sizes {self.micro_batch_sizes} has a size above max_train_batch_size "
                             f"({self.max_train_batch_size})")
        return self


@with_placeholders("data_types")
class DataTypesConfig(_Section):
    """`data_types`: DeepSpeed's keys only (see UNIMPLEMENTED_FEATURES)."""

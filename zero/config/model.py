"""`ZeroConfig`: the whole config, its top-level keys and the sections under them."""
from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from zero.config.errors import _fmt, _NestedIssues, _warn
from zero.config.features import with_placeholders
from zero.config.monitor import MonitorConfig, TensorBoardConfig
from zero.config.optimizer import OptimizerConfig
from zero.config.parallel import PipelineConfig, TensorParallelConfig
from zero.config.rules import Caller, combination_issues
from zero.config.scheduler import SchedulerConfig
from zero.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    ElasticityConfig,
    FP16Config,
    ZeroOptimizationConfig,
    _Section,
)

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


# The batch keys count samples (or micro-batches): 2**31 or more is a typo or an overflow upstream,
# not a batch, and would overflow any int32 that holds it later. DeepSpeed sets no bound.
MAX_BATCH = 2**31


# DeepSpeed keys zero refuses or warns about are added from their UNIMPLEMENTED_FEATURES rows, here and
# in every section (see [Note: what zero does with a DeepSpeed key] in zero/config/features.py).
@with_placeholders("")
class ZeroConfig(_Section):
    """The whole config. Build it with `load_config` (which also resolves the batch sizes)."""

    # batch: train = micro * accumulation * world_size; see load_config
    train_batch_size: Optional[int] = Field(None, gt=0, description="Samples per optimizer step, all ranks.")
    train_micro_batch_size_per_gpu: Optional[int] = Field(None, gt=0, description="Samples per forward "
                                                          "on one rank.")
    gradient_accumulation_steps: Optional[int] = Field(None, gt=0, description="Micro-batches per step.")
    # training
    gradient_clipping: float = Field(0.0, ge=0, allow_inf_nan=False, description="Clip the global grad "
                                     "norm to this value; 0 disables clipping.")
    prescale_gradients: bool = Field(False, description="Divide grads by world size before reducing.")
    gradient_predivide_factor: float = Field(1.0, description="Divide grads by this before the "
                                             "reduction and by world_size/factor after.")
    communication_data_type: Optional[str] = Field(None, description="dtype of gradient communication: "
                                                   "fp32, fp16, bf16; null = the training dtype.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision "
                             "(old name: bfloat16).")
    optimizer: Optional[OptimizerConfig] = Field(None, description="Optimizer to build; None = the "
                                                 "caller passes one.")
    scheduler: Optional[SchedulerConfig] = Field(None, description="LR scheduler to build.")
    aio: AioConfig = Field(default_factory=AioConfig, description="How NVMe offload reads and writes its swap "
                           "files.")
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig,
                                                      description="ZeRO stage and its knobs.")
    # logging / io
    steps_per_print: Optional[int] = Field(None, ge=0, description="Log progress every N steps; null = never.")
    wall_clock_breakdown: bool = Field(False, description="Time forward/backward/step.")
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="DeepSpeed's CSV monitor: the "
                                       "learning rate and loss scale per step in csv files (zero/events.py).")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="The same events for "
                                           "TensorBoard.")
    memory_breakdown: bool = Field(False, description="Log memory use.")
    dump_state: bool = Field(False, description="Print the engine state after initialization.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint options.")
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig, description="Elastic batch sizes "
                                         "(zero/config/elasticity.py).")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="ZeRO-R activation checkpoints "
        "(deepspeed.checkpointing).")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Extra dtypes.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Pipeline parallelism "
                                     "(see docs/parallelism.md).")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig,
                                                  description="Tensor slicing (see docs/parallelism.md).")
    sequence_parallel_size: int = Field(1, ge=1, description="DeepSpeed-Ulysses sequence parallelism: groups of "
                                        "this many consecutive ranks each hold a slice of every sequence of the "
                                        "same samples (zero.sequence); ZeRO partitions over all ranks, and the "
                                        "batch sizes count world / sequence_parallel_size data-parallel ranks.")
    spatial_parallel_size: int = Field(1, ge=1, description="Spatial parallelism: groups of this many consecutive "
                                       "ranks each hold a slab of every activation volume of the same samples "
                                       "(zero.spatial, docs/spatial.md); ZeRO partitions over all ranks, and the "
                                       "batch sizes count world / spatial_parallel_size data-parallel ranks.")
    spatial_parallel_dims: list[int] = Field([2], description="The dimensions of an (N, C, *spatial) activation "
                                             "the volumes are split along: one (slabs), or two or three (blocks of "
                                             "a grid, as even as spatial_parallel_size's factors allow: "
                                             "zero.spatial.grid_shape).")

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

    @field_validator("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    @classmethod
    def _batch_bound(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v >= MAX_BATCH:
            raise ValueError(f"expected a value < 2**31 = {MAX_BATCH}, got {v}")
        return v

    @field_validator("gradient_predivide_factor")
    @classmethod
    def _predivide(cls, v: float) -> float:
        if not v >= 1:
            raise ValueError(f"expected a value >= 1, got {v!r}: gradients are divided by it before the reduction "
                             f"(to keep fp16 sums from overflowing) and multiplied back after, so a value below 1 "
                             f"multiplies them instead; 1 (the default) turns it off")
        return v

    @model_validator(mode="after")
    def _combinations(self, info: ValidationInfo) -> ZeroConfig:
        """Settings that cannot go together, here or with the caller's model and optimizer (see
        [Note: rules that combine settings] in zero/config/rules.py)."""
        issues = []
        if self.fp16.enabled and self.bf16.enabled:
            issues.append((("bf16", "enabled"), "fp16.enabled and bf16.enabled are both true; enable at most one"))
        caller = (info.context or {}).get("caller") or Caller()
        issues += combination_issues(self, caller)
        if issues:
            raise _NestedIssues(issues)
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

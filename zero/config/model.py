"""`ZeroConfig`: the whole config, its top-level keys and the sections under them."""
from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field, field_validator, model_validator

from zero.config.errors import _fmt, _NestedIssues, _warn
from zero.config.optimizer import OptimizerConfig
from zero.config.parallel import PipelineConfig, TensorParallelConfig
from zero.config.sections import (
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    FP16Config,
    SchedulerConfig,
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


_Section_ = Optional[dict[str, Any]]  # an accepted-but-unimplemented DeepSpeed section

# The batch keys count samples (or micro-batches): 2**31 or more is a typo or an overflow upstream,
# not a batch, and would overflow any int32 that holds it later. DeepSpeed sets no bound.
MAX_BATCH = 2**31


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
    gradient_predivide_factor: float = Field(1.0, description="Divide grads by this before the "
                                             "reduction and by world_size/factor after.")
    gradient_allreduce_op: Literal["mean", "sum"] = Field("mean", description="Average or sum grads "
                                                          "across ranks ('sum' not implemented).")
    communication_data_type: Optional[str] = Field(None, description="dtype of gradient communication: "
                                                   "fp32, fp16, bf16; null = the training dtype.")
    sparse_gradients: bool = Field(False, description="CSR gradients for embeddings (not implemented).")
    disable_allgather: bool = Field(False, description="Legacy DeepSpeed knob; no effect in zero (true warns).")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision "
                             "(old name: bfloat16).")
    optimizer: Optional[OptimizerConfig] = Field(None, description="Optimizer to build; None = the "
                                                 "caller passes one.")
    scheduler: Optional[SchedulerConfig] = Field(None, description="LR scheduler to build.")
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig,
                                                      description="ZeRO stage and its knobs.")
    zero_allow_untested_optimizer: bool = Field(False, description="DeepSpeed: allow a client optimizer "
                                                "that is not Adam/AdamW. zero refuses one anyway (true warns).")
    zero_force_ds_cpu_optimizer: bool = Field(True, description="DeepSpeed: with offload, require its CPU Adam. "
                                              "zero always uses its own (false warns).")
    # logging / io
    steps_per_print: Optional[int] = Field(None, ge=0, description="Log progress every N steps; null = never.")
    wall_clock_breakdown: bool = Field(False, description="Time forward/backward/step.")
    memory_breakdown: bool = Field(False, description="Log memory use.")
    dump_state: bool = Field(False, description="Print the engine state after initialization.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch.")
    vocabulary_size: Optional[int] = Field(None, gt=0, description="DeepSpeed checks it for tensor-core "
                                           "alignment; no effect in zero (set: warns).")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint options.")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Extra dtypes.")
    # DeepSpeed features we accept only to refuse them or warn: see UNIMPLEMENTED_FEATURES
    amp: _Section_ = Field(None, description="NVIDIA Apex AMP (not implemented).")
    torch_autocast: _Section_ = Field(None, description="torch.autocast mixed precision (not implemented).")
    sparse_attention: _Section_ = Field(None, description="Sparse attention (not implemented).")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Pipeline parallelism "
                                     "(see docs/parallelism.md).")
    progressive_layer_drop: _Section_ = Field(None, description="Not implemented.")
    curriculum_learning: _Section_ = Field(None, description="Not implemented.")
    data_efficiency: _Section_ = Field(None, description="Not implemented.")
    compression_training: _Section_ = Field(None, description="Not implemented.")
    quantize_training: _Section_ = Field(None, description="MoQ (not implemented).")
    eigenvalue: _Section_ = Field(None, description="Not implemented.")
    elasticity: _Section_ = Field(None, description="Not implemented.")
    hybrid_engine: _Section_ = Field(None, description="Not implemented.")
    weight_quantization: _Section_ = Field(None, description="Not implemented.")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig,
                                                  description="Tensor slicing (see docs/parallelism.md).")
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
    def _precision(self) -> ZeroConfig:
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

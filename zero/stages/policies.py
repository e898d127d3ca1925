"""Frozen policies: what the config asks of the ZeRO core, decided once when the engine is built.

The optimizers and the stage-3 runtime take these instead of a dozen loose arguments, and every
rule that derives one setting from others (the gradient dtype, whether an fp32 master exists, the
default unit size) lives here, once.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zero.offload.policy import OffloadPolicy, OnDevice, ParamNVMe, offload_policy, param_nvme_policy
from zero.ops.adam_formats import PLAIN, AdamFormat

if TYPE_CHECKING:
    from zero.config import ZeroConfig

DEFAULT_UNIT_ELEMENTS = 1_000_000  # stage3_module_granularity_threshold 0 means this


@dataclass(frozen=True)
class Precision:
    """The dtypes of one training run.

    Args:
        param: dtype of parameters and gradients in forward/backward (fp32, bf16 or fp16).
        reduce: dtype gradients are communicated in (`communication_data_type`, else `param`).
        grad: dtype of the gradient shard: fp32 when several micro-batches are accumulated or
            training is fp32, else `reduce` (the Adam kernels read 16-bit gradients directly).
    """

    param: torch.dtype
    reduce: torch.dtype
    grad: torch.dtype
    adam: AdamFormat = PLAIN

    @classmethod
    def from_config(cls, cfg: ZeroConfig, state_dtype: str | None = None) -> Precision:
        """`state_dtype`: the moments' format a client optimizer object asks for (None: the config's)."""
        fmt = adam_format(cfg, state_dtype)
        accumulate = cfg.gradient_accumulation_steps > 1 or cfg.dtype == torch.float32
        if fmt.master == "bf16":  # bf16 master weights *and gradients* (DeepSpeed's key): accumulated in bf16 too
            accumulate = False
        return cls(cfg.dtype, cfg.communication_dtype, torch.float32 if accumulate else cfg.communication_dtype, fmt)

    @property
    def master_is_model(self) -> bool:
        """The master weights have the model's own dtype, so without offload the parameters are
        their own master (fp32 training; bf16 training with a bf16 master)."""
        return self.adam.master_dtype == self.param


def adam_format(cfg: ZeroConfig, state_dtype: str | None = None) -> AdamFormat:
    """How the optimizer stores master weights and moments: `bf16.bf16_master_weights_and_grads`,
    `bf16.bf16_optimizer_states` / `optimizer.params.state_dtype` (or `state_dtype`, from a client
    optimizer object) and `bf16.stochastic_rounding`. The config has checked the combinations
    (zero/config/rules.py)."""
    b = cfg.bf16
    master = "bf16" if b.enabled and b.bf16_master_weights_and_grads else "fp32"
    opt = cfg.optimizer
    configured = opt.params.state_dtype if opt is not None and opt.type in ("Adam", "AdamW") else None
    state = state_dtype or configured or ("bf16" if b.enabled and b.bf16_optimizer_states else "fp32")
    stochastic = True if b.stochastic_rounding is None else b.stochastic_rounding
    return AdamFormat(master, state, stochastic)


@dataclass(frozen=True)
class StepOptions:
    """How gradients become an update (all stages).

    Args:
        clipping: clip the global gradient norm to this; 0 = off.
        predivide: gradients are divided by this before the reduction.
        accumulation: what the step divides the gradients summed over micro-batches by, besides the
            loss scale: the accumulation steps, except under fp16, whose loss scale already
            divides each loss by them (see [Note: one divisor] in zero/optim/step.py).
        offload: where the optimizer state lives and its update runs (see [Note: offload
            policies] in zero/offload/policy.py).
    """

    clipping: float = 0.0
    predivide: float = 1.0
    accumulation: int = 1
    offload: OffloadPolicy = OnDevice()


@dataclass(frozen=True)
class ReduceOptions:
    """How gradients are reduced across ranks.

    Args:
        overlap_comm: reduce while backward goes on (asynchronous collectives).
        reduce_scatter: stages 1/2 reduce-scatter (False: all-reduce whole buckets, as
            DeepSpeed's `reduce_scatter: false`; twice the traffic, same numbers).
        bucket_elements: stages 0-2: elements per bucket.
        ignore_unused_parameters: False makes a trainable parameter without a gradient an error.
    """

    overlap_comm: bool = False
    reduce_scatter: bool = True
    bucket_elements: int = 500_000_000
    ignore_unused_parameters: bool = True


@dataclass(frozen=True)
class Stage3Options:
    """How stage 3 groups, keeps and fetches parameters.

    Args:
        unit_elements: a module whose unclaimed parameters reach this many elements becomes a
            unit (see zero.stages.planning.plan_units).
        persistence_threshold: parameters of at most this many elements stay whole everywhere.
        persistence_budget: at most this many elements stay whole in total (None: no cap).
        prefetch_elements: elements gathered ahead of use beyond the next unit (0: no prefetch).
        max_live_elements: gathered elements kept at once before idle units are released.
        max_reuse_distance: a unit used again within this many gathered elements is kept.
        offload_param: keep parameter shards off the device (in host memory, or on NVMe).
        pin_memory: page-lock those host shards.
        param_nvme: put the shards beyond `max_in_cpu` in files (zero/offload/param_swap.py), or None.
        hpz: ranks of a node that keep secondary shards from forward for backward (ZeRO++ hpZ,
            `zero_hpz_partition_size`; 1: none).
        quantize_weights: all-gather int8 weight blocks (ZeRO++ qwZ, `zero_quantized_weights`).
        quantize_frozen_weights: the same for units of frozen parameters only
            (`zero_quantized_nontrainable_weights`).
        quantize_gradients: reduce-scatter gradients as two int8 all-to-alls, inside the node then
            across (ZeRO++ qgZ, `zero_quantized_gradients`).
        hierarchical_gather: all-gather in two hops, across nodes then inside them (MiCS's
            `mics_hierarchical_params_gather`).
        log_trace_changes: warn when a recorded order of units changes
            (`log_trace_cache_warnings`).
        gather_on_apply: `module.apply(fn)` sees gathered parameters (`override_module_apply`).
    """

    unit_elements: int = DEFAULT_UNIT_ELEMENTS
    persistence_threshold: int = 100_000
    persistence_budget: int | None = None
    prefetch_elements: int = 50_000_000
    max_live_elements: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    offload_param: bool = False
    pin_memory: bool = False
    param_nvme: ParamNVMe | None = None
    hpz: int = 1
    quantize_weights: bool = False
    quantize_frozen_weights: bool = False
    quantize_gradients: bool = False
    hierarchical_gather: bool = False
    log_trace_changes: bool = False
    gather_on_apply: bool = True


def strict_tag_checks(cfg: ZeroConfig) -> bool:
    """Check every collective's rank-agreement tag before issuing it, also on NCCL (one host
    synchronisation per collective): `enable_sanity_checks` or TORCH_DISTRIBUTED_DEBUG=DETAIL.
    See [Note: rank-agreement tags] in zero/parallel/tags.py."""
    return cfg.zero_optimization.enable_sanity_checks or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def options_from_config(cfg: ZeroConfig, world_size: int, num_threads: int, state_dtype: str | None = None
                        ) -> tuple[Precision, StepOptions, ReduceOptions, Stage3Options]:
    """Every policy of the core, from a validated config.

    Args:
        cfg: the config.
        world_size: ranks in the data-parallel group (`prescale_gradients` divides by it).
        num_threads: CPU Adam threads when the optimizer is offloaded.
        state_dtype: the moments' format a client optimizer object asks for (None: the config's).
    """
    zc = cfg.zero_optimization
    offload = offload_policy(cfg, num_threads)
    predivide = float(world_size) if cfg.prescale_gradients else cfg.gradient_predivide_factor
    step = StepOptions(clipping=cfg.gradient_clipping, predivide=predivide,
                       accumulation=1 if cfg.fp16.enabled else cfg.gradient_accumulation_steps, offload=offload)
    reduce = ReduceOptions(overlap_comm=bool(zc.overlap_comm), reduce_scatter=zc.reduce_scatter,
                           bucket_elements=max(1, min(zc.reduce_bucket_size, zc.allgather_bucket_size)),
                           ignore_unused_parameters=zc.ignore_unused_parameters)
    offload_param = zc.offload_param is not None and zc.offload_param.device in ("cpu", "nvme")
    stage3 = Stage3Options(
        unit_elements=zc.module_granularity_threshold or DEFAULT_UNIT_ELEMENTS,
        persistence_threshold=zc.param_persistence_threshold,
        persistence_budget=zc.model_persistence_threshold if zc.model_persistence_threshold < sys.maxsize else None,
        prefetch_elements=zc.prefetch_bucket_size, max_live_elements=zc.max_live_parameters,
        max_reuse_distance=zc.max_reuse_distance, offload_param=offload_param,
        pin_memory=offload_param and zc.offload_param.pin_memory, param_nvme=param_nvme_policy(cfg),
        hpz=zc.zero_hpz_partition_size, quantize_weights=zc.zero_quantized_weights,
        quantize_frozen_weights=zc.zero_quantized_nontrainable_weights, quantize_gradients=zc.zero_quantized_gradients,
        hierarchical_gather=zc.mics_hierarchical_params_gather,
        log_trace_changes=zc.log_trace_cache_warnings, gather_on_apply=zc.override_module_apply)
    return Precision.from_config(cfg, state_dtype), step, reduce, stage3


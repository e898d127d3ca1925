"""ZeRO stages: gradient and optimizer-state partitioning (0-2); parameter partitioning (3).

    optimizer = build_optimizer(module, param_groups, config, comm, device)

Rooms: `policies.py` (what the config asks, decided once), `adam.py` (the step every stage
shares), `readiness.py` (when gradients are final, stages 2 and 3), `buckets.py` (stages 0-2),
`unit.py`, `planning.py` and `stage3.py` (stage 3).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from zero.comm import Comm
from zero.config import ZeroConfig
from zero.offload import cpu_adam_threads
from zero.precision import LossScaler
from zero.stages.adam import ShardedAdam
from zero.stages.buckets import ZeroOptimizer
from zero.stages.policies import options_from_config
from zero.stages.stage3 import RankDivergenceError, Stage3Optimizer

__all__ = ["build_optimizer", "ShardedAdam", "ZeroOptimizer", "Stage3Optimizer", "RankDivergenceError"]


def build_optimizer(module: nn.Module, param_groups: list[dict[str, Any]], config: ZeroConfig, comm: Comm,
                    device: torch.device) -> ShardedAdam:
    """The partitioned optimizer the config's ZeRO stage asks for, owning `module`'s parameters.

    Trainable parameters (all parameters under stage 3) move into the optimizer's storage one at
    a time, taking rank 0's values; the module is not moved or cast as a whole.

    Args:
        module: the model.
        param_groups: torch-style groups of trainable parameters with complete Adam hyperparameters.
        config: the validated config.
        comm: the data-parallel group.
        device: where the model computes.
    """
    precision, step, reduce, stage3 = options_from_config(config, comm.world_size, cpu_adam_threads())
    f = config.fp16
    scaler = LossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
                        f.consecutive_hysteresis, f.min_loss_scale) if f.enabled else LossScaler.disabled()
    stage = config.zero_optimization.stage
    zeroone = config.optimizer.zeroone if config.optimizer is not None else None
    if zeroone is not None:
        if stage != 0:
            raise ValueError(f"optimizer type ZeroOneAdam needs ZeRO stage 0, not {stage}: its local steps update "
                             f"every parameter on every rank, while stages 1-3 give each rank its shard of the "
                             f"optimizer state alone (use OneBitAdam at stages 1 and 2; see docs/onebit.md)")
        if step.offload is not None:
            raise ValueError("optimizer type ZeroOneAdam with offload_optimizer is not supported; its local steps "
                             "run on the device (remove zero_optimization.offload_optimizer)")
        from zero.onebit.zero_one import ZeroOneAdam

        return ZeroOneAdam(module, param_groups, stage=stage, comm=comm, precision=precision, step=step,
                           reduce=reduce, device=device, loss_scaler=scaler, var_freeze_step=zeroone.var_freeze_step,
                           var_update_scaler=zeroone.var_update_scaler, local_step_scaler=zeroone.local_step_scaler,
                           local_step_clipper=zeroone.local_step_clipper)
    onebit = config.optimizer.onebit if config.optimizer is not None else None
    if onebit is not None:
        if stage == 3:
            raise ValueError("optimizer type OneBitAdam needs ZeRO stage 0, 1 or 2: under stage 3 the gradient "
                             "reduction is per unit of gathered parameters and its compressed exchange is not "
                             "implemented (see docs/onebit.md)")
        if onebit.compress_param_gather and stage == 0:
            raise ValueError("optimizer.params.compress_param_gather applies to ZeRO stages 1 and 2: stage 0 has no "
                             "parameter all-gather (every rank updates every parameter, and its gradient exchange is "
                             "already compressed both ways); remove the key or set zero_optimization.stage to 1 or 2")
        from zero.onebit.optimizer import OneBitAdam

        return OneBitAdam(module, param_groups, stage=stage, comm=comm, precision=precision, step=step, reduce=reduce,
                          device=device, loss_scaler=scaler, freeze_step=onebit.freeze_step,
                          compress_param_gather=onebit.compress_param_gather)
    if stage == 3:
        return Stage3Optimizer(module, param_groups, comm=comm, precision=precision, step=step, reduce=reduce,
                               options=stage3, device=device, loss_scaler=scaler)
    return ZeroOptimizer(module, param_groups, stage=stage, comm=comm, precision=precision, step=step, reduce=reduce,
                         device=device, loss_scaler=scaler)

"""Building the engine's optimizer: the storage the config's ZeRO stage asks for, under the step.

    optimizer = build_optimizer(module, param_groups, config, comm, device)
"""
from __future__ import annotations

import errno
import functools
from typing import Any

import torch
import torch.nn as nn

from zero.config import ZeroConfig
from zero.offload.host import cpu_adam_threads
from zero.optim.choice import ClientRule
from zero.optim.loss_scale import LossScaler
from zero.optim.muon import matrix_shape
from zero.optim.rules import AdamRule, MuonRule
from zero.optim.step import ShardedOptimizer
from zero.parallel.comm import Comm
from zero.stages.buckets import FlatParams
from zero.stages.memory import Gauges
from zero.stages.placement import Owned, Sharded
from zero.stages.policies import options_from_config
from zero.stages.unit_params import UnitParams


def build_optimizer(module: nn.Module, param_groups: list[dict[str, Any]], config: ZeroConfig, comm: Comm,
                    device: torch.device, *, replicate: Comm | None = None, client: ClientRule | None = None,
                    model_parallel=None, state_dtype: str | None = None, muon: bool = False) -> ShardedOptimizer:
    """The partitioned optimizer the config's ZeRO stage asks for, owning `module`'s parameters.

    Trainable parameters (all parameters under stage 3) move into the stage's storage one at a
    time, taking rank 0's values; the module is not moved or cast as a whole. Which optimizer
    types and offload options go with which stage is checked by the config (`load_config`).

    Args:
        module: the model.
        param_groups: torch-style groups of trainable parameters with complete Adam hyperparameters.
        config: the validated config.
        comm: the ranks ZeRO partitions over (the "zero" group; see [Note: parallel dimensions]).
        device: where the model computes.
        replicate: the ranks holding copies of this rank's partition (hybrid sharding), or None.
        client: another element-wise optimizer's rule, to run on the shards instead of Adam (see
            [Note: other optimizers on shards] in zero/optim/choice.py).
        model_parallel: the global-norm reduction of a model split over pipeline stages or tensor
            slices (zero/parallel/mesh.py's ModelParallelNorm).
        state_dtype: the moments' format a client optimizer object asks for (None: the config's).
        muon: the groups marked `use_muon` are Muon's (zero/optim/muon.py; the engine made them).
    """
    summed = comm.world_size * (replicate.world_size if replicate is not None else 1)  # gradients summed over
    precision, step, reduce, stage3 = options_from_config(config, summed, cpu_adam_threads(), state_dtype)
    f = config.fp16
    scaler = LossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
                        f.consecutive_hysteresis, f.min_loss_scale,
                        accumulation=config.gradient_accumulation_steps) if f.enabled else LossScaler.disabled()
    stage = config.zero_optimization.stage
    params = [p for g in param_groups for p in g["params"]]
    groups = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
    gauges = Gauges()
    muon_groups = [muon and bool(g.get("use_muon")) for g in param_groups]  # zero/optim/muon.py
    muon_at = [i for i in range(len(params)) if muon_groups[groups[i]]]
    # each group's placement (see [Note: placements] in zero/stages/placement.py)
    partitions = 1 if stage == 0 else comm.world_size
    sharded = Sharded(comm, partitions, replicate)
    owned = Owned(comm, partitions, {i: matrix_shape(params[i]) for i in muon_at}, replicate) if muon_at else None
    placements = [owned if m else sharded for m in muon_groups]
    common = dict(comm=comm, precision=precision, step=step, loss_scaler=scaler, model_parallel=model_parallel)
    flat = dict(stage=stage, comm=comm, precision=precision, offload=step.offload, gauges=gauges, reduce=reduce,
                predivide=step.predivide, device=device, placements=placements)
    fp32_in_place = precision.master_is_model and not step.offload.on_host  # the parameters are the master
    kind = config.optimizer.type if config.optimizer is not None else None
    if kind == "ZeroOneAdam":
        from zero.onebit.zero_one import ZeroOneAdam, ZeroOneParams, ZeroOneRule

        z = config.optimizer.zeroone
        storage = functools.partial(ZeroOneParams, module, params, groups, master_is_params=fp32_in_place, **flat)
        rules = [ZeroOneRule(precision.adam)] * len(param_groups)
        return ZeroOneAdam(param_groups, storage, rules=rules, var_freeze_step=z.var_freeze_step,
                           var_update_scaler=z.var_update_scaler, local_step_scaler=z.local_step_scaler,
                           local_step_clipper=z.local_step_clipper, **common)
    if kind == "OneBitAdam":
        from zero.onebit.optimizer import FrozenVarianceAdam, OneBitAdam, OneBitParams

        o = config.optimizer.onebit
        gathered = o.compress_param_gather and comm.world_size > 1  # the parameters' changes need the master apart
        storage = functools.partial(OneBitParams, module, params, groups, master_is_params=fp32_in_place and not gathered,
                                    freeze_step=o.freeze_step, loss_scaler=scaler, **flat)
        rules = [FrozenVarianceAdam(precision.adam, o.freeze_step)] * len(param_groups)
        return OneBitAdam(param_groups, storage, rules=rules, freeze_step=o.freeze_step,
                          compress_param_gather=o.compress_param_gather, **common)
    adam, muon_rule = AdamRule(precision.adam), MuonRule()
    rules = [muon_rule if m else client or adam for m in muon_groups]
    needs = []  # the swap files must fit their drives: refused now, before any state is made
    if step.offload.on_disk:
        from zero.offload.nvme import state_bytes

        shards = comm.world_size if stage > 0 else 1
        elements: dict[int, int] = {}
        for p, g in zip(params, groups):
            elements[g] = elements.get(g, 0) + -(-getattr(p, "ds_numel", p.numel()) // shards)
        nbytes = state_bytes(elements, lambda g: rules[g].state(param_groups[g]), precision.adam.master_dtype)
        needs.append((step.offload.path, nbytes, "optimizer state",
                      "zero_optimization.offload_optimizer.nvme_path"))
    if stage == 3 and stage3.param_nvme is not None:
        from zero.stages.planning import plan_disk

        plan = plan_disk(module, stage3, comm.world_size, precision.param)
        if plan.too_big is not None:
            from zero.config import ConfigError

            (unit, numel), key = plan.too_big, "zero_optimization.offload_param.buffer_size"
            raise ConfigError(
                f"{key} = {stage3.param_nvme.buffer_size} elements is smaller than the shard of unit {unit!r} on each "
                f"rank ({numel} elements): raise buffer_size to at least {numel}, or give that module's parameters "
                f"to smaller units (zero_optimization.stage3_module_granularity_threshold)",
                [(key, f"smaller than unit {unit!r}'s shard of {numel} elements")])
        nbytes = plan.disk_bytes
        needs.append((stage3.param_nvme.path, nbytes, "parameter shards",
                      "zero_optimization.offload_param.nvme_path"))
    if needs:  # every rank checks before any reserves, and all refuse if one must (none waits in a collective)
        from zero.offload.nvme import check_room

        error = None
        try:
            check_room(needs)
        except OSError as exc:
            error = exc
        failed = comm.any_rank(error is not None, "the NVMe room check")
        if replicate is not None:  # the replicas too (else the others would wait in their first sum)
            failed = replicate.any_rank(failed, "the NVMe room check")
        if failed:
            raise error or OSError(errno.ENOSPC, "zero: NVMe offload's swap files do not fit the drive of another rank "
                                                 "(see its error)")
    if stage == 3:
        whole = Owned(comm, comm.world_size, {params[i]: matrix_shape(params[i]) for i in muon_at},
                      replicate) if muon_at else None
        storage = functools.partial(UnitParams, module, params, groups, comm=comm, precision=precision,
                                    offload=step.offload, gauges=gauges, reduce=reduce, options=stage3,
                                    predivide=step.predivide, device=device, placement=sharded, owned=whole)
    else:
        storage = functools.partial(FlatParams, module, params, groups, master_is_params=fp32_in_place, **flat)
    return ShardedOptimizer(param_groups, storage, rules=rules, **common)

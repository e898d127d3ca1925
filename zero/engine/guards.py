"""Checks made when an engine is built, before anything is moved: the ranks agree on the model and
config, no parameter is trained by two engines, and the parameters to train belong to the model."""
from __future__ import annotations

import itertools
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.config import ZeroConfig
from zero.owners import OWNERS
from zero.parallel.comm import Comm
from zero.parallel.tags import RankDivergenceError, Tag

_ENGINE_NUMBERS = itertools.count(1)  # engines of this process, in the order built (see [Note: rank-agreement tags])


def next_engine_number() -> int:
    return next(_ENGINE_NUMBERS)


def _what_ranks_must_share(module: nn.Module, config: ZeroConfig, world_size: int) -> list[str]:
    """What every rank must agree on before the first collective: the world size, the config
    (which fixes the stage, dtypes, bucket sizes and batch sizes) and every parameter's name,
    shape, dtype and trainability (which fix the bucket and unit layouts)."""
    def flat(prefix: str, value) -> list[str]:
        if isinstance(value, dict):
            return [line for k, v in value.items() for line in flat(f"{prefix}{k}.", v)]
        return [f"config {prefix[:-1]} = {value!r}"]

    shared = {k: v for k, v in config.model_dump().items() if k not in _PER_RANK_KEYS}
    if config.checkpoint.use_node_local_storage:  # each node's own disk, which may be mounted elsewhere
        shared["checkpoint"] = {k: v for k, v in shared["checkpoint"].items() if k != "dir"}
    lines = [f"world size {world_size}", *flat("", shared)]
    lines += [f"parameter {n!r}: shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
              for n, p in module.named_parameters()]
    return lines


# config keys that only report or log, which a rank may set differently (rank 0 alone timing, a
# per-rank log directory) without changing any collective
_PER_RANK_KEYS = {"steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard", "wandb",
                  "csv_monitor", "comet", "flops_profiler", "comms_logger", "timers", "autotuning"}


def check_ranks_agree(module: nn.Module, config: ZeroConfig, comm: Comm) -> None:
    """Raise RankDivergenceError, on every rank, if the ranks built different models or configs.

    One tag exchange carries a digest of `_what_ranks_must_share`; only when digests differ do
    the ranks exchange the full descriptions, to name the first difference."""
    if comm.world_size == 1:
        return
    import hashlib

    lines = _what_ranks_must_share(module, config, comm.world_size)
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    words = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]
    work, tags = comm.start_tag(Tag.INITIALIZE, *words)
    rows = comm.check_tags(work, tags, "zero.initialize", key=lambda row: row[0])
    # the engine number of these collectives: the same on every rank from here on, even if a rank
    # built an engine the others did not (one that failed, say)
    global _ENGINE_NUMBERS
    comm.engine = max(row[3] for row in rows)
    _ENGINE_NUMBERS = itertools.count(comm.engine + 1)
    if all(row[:3] == rows[0][:3] for row in rows):
        return
    # every rank knows the digests differ and raises below, with nothing left in flight: no abort
    everyone: list = [None] * comm.world_size
    dist.all_gather_object(everyone, lines, group=comm.control().group)
    first = next(i for i in range(max(map(len, everyone)) + 1)
                 if len({tuple(d[i : i + 1]) for d in everyone}) > 1)
    seen = "; ".join(f"rank {r}: {d[i] if (i := first) < len(d) else 'nothing (fewer parameters)'}"
                     for r, d in enumerate(everyone))
    raise RankDivergenceError(
        f"zero.initialize: the ranks built different models or configs. First difference: {seen}. Every rank must "
        f"build the same model (same parameters in the same order) from the same config.")


_OWNERS = OWNERS  # see zero/owners.py


def _refuse_claimed(module: nn.Module, trained: set, stage: int) -> None:
    """Refuse parameters another live zero engine trains (its hooks would take their gradients)
    or shards (stage 3)."""
    for name, p in module.named_parameters():
        owner, sharded = _OWNERS.get(p, (None, False))
        if owner is not None and owner() is not None and (sharded or stage == 3 or p in trained):
            raise ValueError(
                f"parameter {name!r} is already {'sharded' if sharded else 'trained'} by another zero engine: "
                f"zero.initialize was called twice on this model, or two models share this parameter. The first "
                f"engine {'keeps only a shard of it' if sharded else 'takes its gradients with its hooks'}, so the "
                f"second would never train it. Build one engine per model (re-create the model to start over), and "
                f"put modules that share weights in one model.")


def _claim(module: nn.Module, optimizer, stage: int) -> None:
    owner = (weakref.ref(optimizer), stage == 3)
    for p in (module.parameters() if stage == 3 else optimizer.params):
        _OWNERS[p] = owner


def _refuse_foreign_parameters(module: nn.Module, groups: list[dict], config: ZeroConfig) -> None:
    """Parameters to train must belong to the model; zero.Init models need stage 3."""
    names = {p: n for n, p in module.named_parameters()}
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if p not in names:
                raise ValueError(
                    f"param group {gi} holds a parameter of shape {tuple(p.shape)} that is not in the model: "
                    f"model_parameters (or the optimizer's param groups) must be parameters of the model passed "
                    f"to zero.initialize (was the optimizer built over another model?)")
    trained = {p for g in groups for p in g["params"]}
    odd = [(n, p.dtype) for p, n in names.items() if p in trained and p.dtype not in (torch.float32, config.dtype)]
    if odd:
        warnings.warn(f"zero: {len(odd)} trainable parameter(s) are {odd[0][1]} (first: {odd[0][0]!r}) but the config "
                      f"trains in {config.dtype}: they are trained in {config.dtype} (enable fp16/bf16 in the config to "
                      f"train in 16 bits)", stacklevel=4)
    stage = config.zero_optimization.stage
    sharded = next((n for p, n in names.items() if getattr(p, "_zero", None) is not None), None)
    if sharded is not None and stage < 3:
        raise ValueError(f"the model was built under zero.Init (parameter {sharded!r} is partitioned), which only "
                         f"ZeRO stage 3 can train; set zero_optimization.stage to 3, or build the model without "
                         f"zero.Init for stage {stage}")
    lost = [n for p, n in names.items() if getattr(p, "_zero", None) is not None and p._zero.local is not None
            and p._version != getattr(p, "_zero_version", p._version)]
    if lost:  # see zero.Init: an in-place change of a sharded parameter's empty .data changes nothing
        raise ValueError(f"{len(lost)} parameter(s) were changed in place after zero.Init had sharded them (first: "
                         f"{lost[0]!r}), for example by an initialisation loop in the model's __init__ that runs after "
                         f"its submodules were built; the changes were lost. Make them inside "
                         f"`with zero.GatheredParameters(params, modifier_rank=0):`, or build the model without "
                         f"zero.Init")

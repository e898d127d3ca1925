"""Elastic batch sizes: the config's `elasticity` section (DeepSpeed's keys, versions 0.1 and 0.2).

    "elasticity": {"enabled": true, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4],
                   "min_gpus": 1, "max_gpus": 16, "version": 0.1}

[Note: elastic batch sizes]
A job that may restart on another number of ranks (a node lost, `torchrun --nnodes 1:2`) keeps
training the same problem only if each optimizer step still sees the same global batch. The section
names the largest global batch the user accepts and the micro-batch sizes a rank can run; from them
one global batch is chosen once, independently of the world size, so that it splits into
micro-batch x accumulation x data-parallel ranks for as many rank counts in [min_gpus, max_gpus]
as possible. Each start then takes that batch and, for its own data-parallel size, the largest
listed micro-batch that divides its share (the fewest accumulation steps). Checkpoints load at any
world size, and the loader resumes at the same global sample, so a restart on another rank count
continues the run it interrupted: each step sums the same samples, in another grouping.

How the batch is chosen (version 0.1): every listed micro-batch size, and their least common
multiple, is a base; a base's candidate is the base times the largest highly composite number (a
number with more divisors than any smaller one) that keeps it within max_train_batch_size, so the
candidate has many divisors and so many rank counts. The candidate valid for the most rank counts
wins; of equals, the larger one (prefer_larger_batch) or the smaller. A rank count g is valid for a
batch B when some listed micro-batch m gives B = m x accumulation x g. A world size outside the
valid list is an error that lists the valid ones.

Version 0.2 counts nodes of num_gpus_per_node ranks with model_parallel_size ranks per model
replica: the search above runs in nodes, for the batch per node's data-parallel ranks, and a
data-parallel size outside the valid list does not fail: it gets the largest (or smallest) batch
within max_train_batch_size that its ranks divide, which changes the global batch (logged).

The two numbers that say which data-parallel size is which: zero's data-parallel size is the world
over pipeline stages x tensor slices x sequence ranks; version 0.1 needs that product to be 1 (as in
DeepSpeed), version 0.2 needs model_parallel_size to equal it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

LATEST_VERSION = 0.2


class ElasticityError(ValueError):
    """The elasticity section cannot give a batch for this world size; the message says which sizes can.
    `keys`: the config keys at fault."""

    def __init__(self, message: str, keys: tuple[str, ...] = ("elasticity",)):
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True)
class ElasticPlan:
    """What an elastic start trains with.

    Attributes:
        train_batch_size: the global batch of one optimizer step.
        micro_batch_size: per rank and micro-batch.
        accumulation: micro-batches per optimizer step.
        data_parallel_size: the data-parallel ranks it was chosen for.
        valid_sizes: the data-parallel sizes that keep `train_batch_size`.
        kept: False where version 0.2 gave this size a batch of its own (not in `valid_sizes`).
    """

    train_batch_size: int
    micro_batch_size: int
    accumulation: int
    data_parallel_size: int
    valid_sizes: tuple[int, ...]
    kept: bool = True

    def describe(self) -> str:
        how = (f"train_batch_size {self.train_batch_size} = micro-batch {self.micro_batch_size} x accumulation "
               f"{self.accumulation} x {self.data_parallel_size} data-parallel rank(s)")
        if self.kept:
            return f"{how}; the data-parallel sizes that keep this batch: {list(self.valid_sizes)}"
        return (f"{how}: this size is not among those that keep the elastic batch, so version 0.2 gave it a "
                f"batch of its own (the global batch changed)")


def highly_composite_numbers(limit: int) -> list[int]:
    """The highly composite numbers <= `limit`, ascending (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, ...).

    Every one is 2^a 3^b 5^c ... with exponents that do not grow along the primes, so those products
    are the only candidates; each is kept if it has more divisors than every smaller candidate."""
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]  # their product exceeds 2**63
    found: list[tuple[int, int]] = []  # (number, divisor count)

    def walk(i: int, value: int, max_exp: int, divisors: int) -> None:
        found.append((value, divisors))
        if i == len(primes):
            return
        power = value
        for e in range(1, max_exp + 1):
            power *= primes[i]
            if power > limit:
                return
            walk(i + 1, power, e, divisors * (e + 1))

    walk(0, 1, max(1, limit.bit_length()), 1)
    out, best = [], 0
    for value, divisors in sorted(found):
        if divisors > best:
            out.append(value)
            best = divisors
    return out


def valid_sizes(batch: int, micro_batch_sizes: list[int], lo: int, hi: int) -> list[int]:
    """Rank counts g in [lo, hi] for which batch = m x accumulation x g for a listed micro-batch m."""
    out = set()
    for m in micro_batch_sizes:
        if batch % m:
            continue
        per = batch // m
        out |= {g for g in _divisors(per) if lo <= g <= hi}
    return sorted(out)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def best_batch(micro_batch_sizes: list[int], max_batch: int, lo: int, hi: int,
               prefer_larger: bool) -> tuple[int, list[int]]:
    """Version 0.1's global batch and its valid rank counts (see [Note: elastic batch sizes])."""
    bases = sorted({*micro_batch_sizes, math.lcm(*micro_batch_sizes)})
    hcn = highly_composite_numbers(max(1, max_batch))
    candidates = set()
    for base in bases:
        fit = [h for h in hcn if h * base <= max_batch]
        candidates.add(base * fit[-1] if fit else base)
    scored = [(len(valid_sizes(b, micro_batch_sizes, lo, hi)), b if prefer_larger else -b, b) for b in candidates]
    _, _, batch = max(scored)
    return batch, valid_sizes(batch, micro_batch_sizes, lo, hi)


def _micro_for(batch: int, dp: int, micro_batch_sizes: list[int]) -> int | None:
    """The largest listed micro-batch that divides a rank's share of `batch` (fewest accumulation steps)."""
    if batch % dp:
        return None
    fits = [m for m in micro_batch_sizes if (batch // dp) % m == 0]
    return max(fits) if fits else None


def elastic_batch(config: Any) -> tuple[int, list[int]]:
    """The global batch of a config's `elasticity` section and the data-parallel sizes that keep it
    (see [Note: elastic batch sizes]); version 0.2 searches in nodes."""
    section = config.elasticity
    micro = sorted(set(section.micro_batch_sizes))
    if float(section.version) < 0.2:
        return best_batch(micro, section.max_train_batch_size, section.min_gpus, section.max_gpus,
                          section.prefer_larger_batch)
    mp, per_node = section.model_parallel_size, section.num_gpus_per_node
    if per_node % mp:
        raise ElasticityError(f"elasticity.num_gpus_per_node ({per_node}) must be a multiple of "
                              f"model_parallel_size ({mp})")
    dp_per_node = per_node // mp
    node_batch, nodes = best_batch(micro, max(1, section.max_train_batch_size // dp_per_node),
                                   max(1, section.min_gpus // per_node), max(1, section.max_gpus // per_node),
                                   section.prefer_larger_batch)
    return node_batch * dp_per_node, [n * dp_per_node for n in nodes]


def plan(config: Any, world_size: int, model_parallel: int = 1) -> ElasticPlan:
    """The elastic plan for `world_size` ranks of which `model_parallel` hold one model replica.

    Args:
        config: a ZeroConfig (or anything with its `elasticity` section).
        world_size: the ranks of this start.
        model_parallel: pipeline stages x tensor slices x sequence ranks of this run.

    Raises:
        ElasticityError: the world size cannot keep the batch (version 0.1), or the section and the
            run's model parallelism disagree; the message lists the sizes that work.
    """
    section = config.elasticity
    micro = sorted(set(section.micro_batch_sizes))
    v01 = float(section.version) < 0.2
    if v01 and model_parallel != 1:
        raise ElasticityError(f"elasticity version 0.1 counts data-parallel ranks only, but this run has "
                              f"{model_parallel} ranks per model replica (pipeline stages x tensor slices x "
                              f"sequence ranks): use version 0.2 with model_parallel_size {model_parallel}")
    if not v01 and section.model_parallel_size != model_parallel:
        raise ElasticityError(f"elasticity.model_parallel_size is {section.model_parallel_size}, but this run has "
                              f"{model_parallel} ranks per model replica (pipeline stages x tensor slices x "
                              f"sequence ranks): give the same number")
    batch, valid = elastic_batch(config)
    dp = world_size // model_parallel
    m = _micro_for(batch, dp, micro) if dp in valid else None
    if m is not None:
        return ElasticPlan(batch, m, batch // (m * dp), dp, tuple(valid))
    if not valid:
        raise ElasticityError(f"no world size from min_gpus {section.min_gpus} to max_gpus {section.max_gpus} can keep "
                              f"any batch the section allows (micro_batch_sizes {micro}, max_train_batch_size "
                              f"{section.max_train_batch_size}): widen the range or allow larger batches")
    if v01:
        raise ElasticityError(f"{world_size} ranks cannot keep the elastic train_batch_size {batch} "
                              f"(micro_batch_sizes {micro}, max_train_batch_size {section.max_train_batch_size}); "
                              f"the world sizes that can: {valid}")
    max_batch = section.max_train_batch_size
    fitting = [max_batch // (m * dp) * m * dp for m in micro if m * dp <= max_batch]
    if not fitting:
        raise ElasticityError(f"{dp} data-parallel ranks with the smallest micro-batch "
                              f"{micro[0]} exceed max_train_batch_size {max_batch}")
    own = max(fitting) if section.prefer_larger_batch else min(fitting)
    m = _micro_for(own, dp, micro)
    return ElasticPlan(own, m, own // (m * dp), dp, tuple(valid), kept=False)


def batch_keys(config: Any, world_size: int, model_parallel: int = 1) -> dict[str, int]:
    """The three batch keys an elastic config gives this world size (see `plan`). The batch keys
    set outside the section are an error unless `ignore_non_elastic_batch_info`."""
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
             if getattr(config, k) is not None]
    given += ["pipeline.micro_batches"] if config.pipeline.micro_batches is not None else []
    if given and not config.elasticity.ignore_non_elastic_batch_info:
        raise ElasticityError("is set while elasticity.enabled is true, which chooses the batch: remove it, or set "
                              "elasticity.ignore_non_elastic_batch_info to let the section override it", tuple(given))
    p = plan(config, world_size, model_parallel)
    return {"train_batch_size": p.train_batch_size, "train_micro_batch_size_per_gpu": p.micro_batch_size,
            "gradient_accumulation_steps": p.accumulation}


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str | None = None, world_size: int = 0,
                           return_microbatch: bool = False):
    """DeepSpeed's helper for schedulers: the elastic batch and the valid world sizes of a config.

    Args:
        ds_config: a config dict with an `elasticity` section.
        target_deepspeed_version: accepted for DeepSpeed's signature; not used.
        world_size: if > 0, also the micro-batch for this many ranks (an error if version 0.1 cannot
            keep the batch there).
        return_microbatch: return the micro-batch as a third value (implied by `world_size`).

    Returns:
        (train_batch_size, valid data-parallel sizes) or, with `world_size` or `return_microbatch`,
        (train_batch_size, valid sizes, micro-batch size; for the smallest valid size without `world_size`).
    """
    from zero.config.sections import ElasticityConfig

    section = ElasticityConfig.model_validate(ds_config.get("elasticity", {}))
    config = SimpleNamespace(elasticity=section)
    if not section.enabled:
        raise ElasticityError("compute_elastic_config: the config's elasticity.enabled is not true")
    mp = section.model_parallel_size if float(section.version) >= 0.2 else 1
    if world_size > 0:
        p = plan(config, world_size, mp)  # version 0.2 off the list: a batch of its own, valid for this size only
        return p.train_batch_size, list(p.valid_sizes) if p.kept else [p.data_parallel_size], p.micro_batch_size
    batch, valid = elastic_batch(config)
    if return_microbatch:
        return batch, valid, _micro_for(batch, valid[0], sorted(set(section.micro_batch_sizes))) if valid else None
    return batch, valid

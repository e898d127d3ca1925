"""How much memory each ZeRO stage and offload option needs per rank, before a run starts.

    zero.estimate_memory(model_or_param_count, world_size=8)          # every stage and offload option
    python -m zero.estimate --params 7e9 --gpus 8 --nodes 2            # the same, as a table
    python -m zero.estimate --model path/to/hf/config.json --gpus 8

[Note: the estimator's numbers]
The estimator reads the same policies the engine builds from a config (zero/stages/policies.py:
dtypes, bucket sizes, stage-3 thresholds, offload tiles), so a setting means the same thing in both.
With Psi trainable elements on N ranks, p bytes per training-dtype element, g per gradient-shard
element (fp32 when micro-batches are accumulated or training is fp32, else the communication
dtype) and an fp32 master wherever it is not the parameter itself (16-bit training, or offload):

    stage  params           grads      fp32 master  Adam m, v
    0      p Psi            g Psi      4 Psi        8 Psi          (plain data parallelism)
    1      p Psi            g Psi      4 Psi/N      8 Psi/N
    2      p Psi            g Psi/N    4 Psi/N      8 Psi/N
    3      p Psi/N + p P    g Psi/N    4 Psi/N      8 Psi/N        (P: persistent elements, kept whole)

Optimizer offload moves the master and Adam's states to the host and adds the host staging of the
gradient shard and two copy-back tiles; stage 3's `offload_param` moves the parameter shards there
too. These are the kinds `Engine.memory_report()` measures, and on a real run the two agree up to
padding (each bucket or unit is padded to split evenly over N SIMD-aligned slices).

With a OneBitAdam or ZeroOneAdam config, `compression_errors` (included in `buffers`) is the error
buffers: an fp32 copy of the trainable parameters per rank, plus 1/N of it at stage 0. ZeroOneAdam
adds two more fp32 copies to `buffers` (its momentum accumulator and anchor).

`buffers` is the communication and gathering memory of a step beyond the model states: stages 0-1
one bucket cast to the communication dtype (when it differs); stage 2 the staging buffers of the
buckets being filled or reduced, three when backward produces gradients in about the reverse of the
order the parameters were registered (the usual case; a model that runs its layers in another order
can hold a staging buffer for every bucket at once, up to a full gradient); stage 3 the gathered
parameters (`stage3_max_live_parameters`, at least one unit), one all-gather output and two units'
gradient sends (plus, with `offload_param`, a shard staged onto the device), sized by the largest
unit: planned for a model, `largest_layer` (DeepSpeed's `largest_layer_params`) for a count.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OFFLOADS = ("none", "optimizer", "param", "optimizer+param")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one stage and offload option (see [Note: the estimator's numbers])."""

    stage: int
    offload: str  # "none", "optimizer", "param" or "optimizer+param"
    world_size: int
    params: int
    grads: int
    fp32_master: int
    optimizer_states: int
    host_staging: int  # offload's host gradient copy and copy-back tiles
    buffers: int  # device communication and gathered-parameter buffers, at most
    compression_errors: int  # OneBitAdam's error buffers (device), see zero/onebit/optimizer.py
    device_bytes: int  # model states on the device plus `buffers`
    host_bytes: int  # model states and staging in host memory

    @property
    def model_states_total(self) -> int:
        return self.params + self.grads + self.fp32_master + self.optimizer_states

    @property
    def label(self) -> str:
        name = "stage 0 (= DDP)" if self.stage == 0 else f"stage {self.stage}"
        return name if self.offload == "none" else f"{name} + offload {self.offload}"


class MemoryTable(list):
    """A list of MemoryEstimate rows that prints as a table."""

    def __init__(self, rows, psi: int, persistent: int, dtype: str, gpus_per_node: int, largest_unit: int = 0):
        super().__init__(rows)
        self.psi, self.persistent, self.dtype, self.gpus_per_node = psi, persistent, dtype, gpus_per_node
        self.largest_unit = largest_unit

    def row(self, stage: int, offload: str = "none") -> MemoryEstimate:
        for r in self:
            if r.stage == stage and r.offload == offload:
                return r
        raise KeyError(f"no row for stage {stage} with offload {offload!r} in this table")

    def __str__(self) -> str:
        n = self[0].world_size if self else 1
        head = (f"{self.psi:,} trainable parameters ({_human(self.psi)}), {self.dtype}, {n} rank(s)"
                + (f", {self.persistent:,} kept whole under stage 3" if self.persistent else ""))
        cols = ["option", "model states/rank", "device/rank", "host/rank", f"host/node ({self.gpus_per_node} ranks)"]
        lines = [[r.label, format_bytes(r.model_states_total), format_bytes(r.device_bytes), format_bytes(r.host_bytes),
                  format_bytes(r.host_bytes * self.gpus_per_node)] for r in self]
        widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
        out = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
        out += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
                for line in lines]
        out.append("device/rank includes the communication and gathering buffers of a step"
                   + (f" (stage 3: largest unit {self.largest_unit:,} elements)" if self.largest_unit else ""))
        return "\n".join(out)


def estimate_memory(model_or_param_count: nn.Module | int | float, world_size: int = 1, *,
                    stage: int | None = None, offload: str | None = None, dtype: str | torch.dtype = "bf16",
                    config: dict | str | None = None, gpus_per_node: int | None = None,
                    persistent_params: int | None = None, largest_layer: int | None = None) -> MemoryTable:
    """Per-rank memory of every stage and offload option (or the ones asked for).

    Args:
        model_or_param_count: a model (its trainable parameters are counted, and under stage 3
            its units and persistent parameters are planned as the engine would) or a number of
            trainable parameters.
        world_size: data-parallel ranks.
        stage: only this stage (0-3); None: all.
        offload: only this option ("none", "optimizer", or for stage 3 "param" and "optimizer+param");
            None: all.
        dtype: training dtype, "bf16", "fp16" or "fp32" (or the torch dtype).
        config: a DeepSpeed-style config (dict, JSON path, or an engine's ZeroConfig) for bucket sizes, thresholds,
            gradient accumulation and the communication dtype; its stage, offload and precision
            are replaced by each row's.
        gpus_per_node: ranks sharing one host, for the host-per-node column (default world_size).
        persistent_params: with a parameter count, the elements stage 3 keeps whole (default 0;
            a model's are planned).
        largest_layer: with a parameter count, the elements of the largest stage-3 unit (the
            largest layer, DeepSpeed's `largest_layer_params`; default the unit size of the
            config, `stage3_module_granularity_threshold`); it sizes stage 3's buffers.

    Returns:
        A MemoryTable (a list of MemoryEstimate) that prints as a table.
    """
    psi, model = _count(model_or_param_count)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (ranks, i.e. GPUs), got {world_size!r}")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload is not None and offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if offload in ("param", "optimizer+param") and stage not in (None, 3):
        raise ValueError(f"offload {offload!r} (offload_param) needs stage 3, not stage {stage}")
    dtype_name = _dtype_name(dtype)
    if gpus_per_node is None:
        gpus_per_node = world_size
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    if persistent_params is not None and (model is not None or persistent_params < 0):
        raise ValueError("persistent_params is for a parameter count (a model's are planned), and must be >= 0")
    if largest_layer is not None and (model is not None or not isinstance(largest_layer, int) or largest_layer < 1):
        raise ValueError("largest_layer is for a parameter count (a model's units are planned), and must be a "
                         f"positive integer, got {largest_layer!r}")
    rows, persistent_seen, largest_seen = [], 0, 0
    for s in (0, 1, 2, 3) if stage is None else (stage,):
        for o in OFFLOADS if offload is None else (offload,):
            if o in ("param", "optimizer+param") and s != 3:
                continue
            row, persistent, unit = _estimate(psi, model, world_size, s, o, dtype_name, config, persistent_params,
                                              largest_layer)
            rows.append(row)
            persistent_seen = max(persistent_seen, persistent)
            largest_seen = max(largest_seen, unit if s == 3 else 0)
    return MemoryTable(rows, psi, persistent_seen, dtype_name, gpus_per_node, largest_seen)


def _count(model_or_param_count) -> tuple[int, nn.Module | None]:
    if isinstance(model_or_param_count, nn.Module):
        return sum(_numel(p) for p in model_or_param_count.parameters() if p.requires_grad), model_or_param_count
    if isinstance(model_or_param_count, bool) or not isinstance(model_or_param_count, (int, float)):
        raise TypeError(f"estimate_memory takes a model or a parameter count, got {type(model_or_param_count).__name__}")
    if not math.isfinite(model_or_param_count) or model_or_param_count < 1 or model_or_param_count != int(model_or_param_count):
        raise ValueError(f"the parameter count must be a positive whole number, got {model_or_param_count!r}")
    return int(model_or_param_count), None


def _numel(p: nn.Parameter) -> int:
    """Elements of `p`, also when stage 3 (or zero.Init) holds only its shard."""
    z = getattr(p, "_zero", None)
    return z.numel if z is not None else p.numel()


def _dtype_name(dtype) -> str:
    for name, d in DTYPES.items():
        if dtype == name or dtype == d:
            return name
    raise ValueError(f"dtype must be one of {list(DTYPES)} (or the torch dtype), got {dtype!r}")


def _policies(config, stage: int, offload: str, dtype: str, world_size: int):
    from zero.config import ConfigWarning, ZeroConfig, load_config
    from zero.config.loading import _read
    from zero.stages.policies import options_from_config

    if isinstance(config, ZeroConfig):  # an engine's config: what was set, in DeepSpeed's spelling
        data = config.model_dump(by_alias=True, exclude_unset=True)
    else:
        data = dict(_read(config)[0]) if config is not None else {}
    zo = dict(data.get("zero_optimization", {}))
    zo["stage"] = stage
    zo["offload_optimizer"] = {"device": "cpu" if offload in ("optimizer", "optimizer+param") else "none"}
    zo["offload_param"] = {"device": "cpu" if offload in ("param", "optimizer+param") else "none"}
    data["zero_optimization"] = zo
    data.pop("fp16", None), data.pop("bf16", None)
    if dtype != "fp32":
        data[dtype] = {"enabled": True}
    # batch sizes matter only through the accumulation count (fp32 gradient shards when > 1): keep it,
    # and drop the batch sizes the estimate's world size could contradict
    total, micro = data.pop("train_batch_size", None), data.get("train_micro_batch_size_per_gpu")
    if "gradient_accumulation_steps" not in data and isinstance(total, int) and isinstance(micro, int) and micro > 0:
        data["gradient_accumulation_steps"] = max(1, total // (micro * world_size))
    data.setdefault("train_micro_batch_size_per_gpu", 1)
    with warnings.catch_warnings():  # a key that has no effect at some row's stage is not news here
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config(data, world_size)
    kind = cfg.optimizer.type if cfg.optimizer is not None and cfg.optimizer.type in ("OneBitAdam", "ZeroOneAdam") \
        else None
    gather = kind == "OneBitAdam" and cfg.optimizer.onebit.compress_param_gather and stage in (1, 2) and world_size > 1
    return (*options_from_config(cfg, world_size, num_threads=1), kind, gather)


def _estimate(psi: int, model, n: int, stage: int, offload: str, dtype: str, config, persistent_given,
              largest_layer: int | None):
    precision, step, reduce, s3, onebit, compressed_gather = _policies(config, stage, offload, dtype, n)
    p, g = precision.param.itemsize, precision.grad.itemsize
    r = precision.reduce.itemsize
    offload_opt, offload_param = step.offload is not None, s3.offload_param
    # else the params are their own master (OneBitAdam's compressed gather needs them apart)
    master = 4 if (precision.param != torch.float32 or offload_opt or offload_param or compressed_gather) else 0
    shard = psi / n if stage >= 1 else psi  # the optimizer's part
    persistent, largest_unit = 0, min(psi, largest_layer or s3.unit_elements)
    if stage == 3:
        if model is not None:
            from zero.stages.planning import plan_units

            units, kept = plan_units(model, s3.persistence_threshold, s3.unit_elements, s3.persistence_budget)
            persistent = sum(_numel(q) for q in kept if q.requires_grad)
            sizes = [sum(_numel(q) for q in ps if q.requires_grad) for _, ps in units] + [persistent]
            largest_unit = max(sizes[:-1], default=0)
            slots = [math.ceil(u / n) for u in sizes if u]  # the optimizer's slots: each unit's shard, in order
        else:
            persistent = persistent_given or 0
    params = p * (psi / n + (persistent if n > 1 else 0)) if stage == 3 else p * psi  # one rank: no second copy
    grads = g * (psi / n if stage >= 2 else psi)
    fp32_master, states = master * shard, 8 * shard
    parts = n if stage >= 1 else 1
    if stage < 3 and model is not None:
        from zero.partition.layout import ShardLayout

        numels = [_numel(q) for q in model.parameters() if q.requires_grad]
        layout = ShardLayout(numels, [0] * len(numels), parts, reduce.bucket_elements)
    if model is None:  # slots of about the largest unit or bucket
        slot = largest_unit / n if stage == 3 else min(psi, reduce.bucket_elements) / parts
        slots = [slot, slot]
    elif stage < 3:  # one slot per bucket slice, laid out as the engine does
        slots = [b.slice_numel for b in layout.buckets]
    staged = offload_opt and p < 4 and not offload_param  # offload_param: written in place on the host
    tiles = _copy_back_tiles(slots, step.offload.tile_elements) * p if staged else 0
    host_staging = g * shard + tiles if offload_opt else 0
    if stage < 2:
        buffers = min(psi, reduce.bucket_elements) * r if precision.reduce != precision.grad else 0
    elif stage == 2:  # staging buffers of whole buckets: one filling, two in flight (see the note)
        sizes = sorted((b.numel for b in layout.buckets), reverse=True) if model is not None else (
            [min(psi, reduce.bucket_elements)] * min(3, math.ceil(psi / reduce.bucket_elements)))
        buffers = sum(sizes[:3]) * r
    else:  # gathered units, one all-gather output, (offload_param) one staged shard, two gradient sends
        gathered = min(psi - persistent, max(s3.max_live_elements, largest_unit))
        buffers = p * gathered + p * largest_unit + (p * largest_unit / n if offload_param else 0) + 2 * r * largest_unit
    # OneBitAdam (stages 0-2) and ZeroOneAdam (stage 0), several ranks: a worker error per element, a
    # server error per owned element at stage 0; ZeroOneAdam also keeps u and the anchor (8 bytes each)
    errors = 4 * (psi + (psi / n if stage == 0 else 0)) if onebit and n > 1 and stage < 3 else 0
    local_state = 8 * psi if onebit == "ZeroOneAdam" and stage == 0 else 0
    buffers += errors + local_state + (p * shard if compressed_gather else 0)  # the owned slices before the step
    on_host = (fp32_master + states if offload_opt else 0) + (p * psi / n if offload_param else 0)
    host = on_host + host_staging
    device = params + grads + fp32_master + states + buffers - on_host
    values = dict(params=params, grads=grads, fp32_master=fp32_master, optimizer_states=states,
                  host_staging=host_staging, buffers=buffers, device_bytes=device, host_bytes=host,
                  compression_errors=errors)
    row = MemoryEstimate(stage=stage, offload=offload, world_size=n, **{k: int(round(v)) for k, v in values.items()})
    return row, persistent, largest_unit


def _copy_back_tiles(slots: list[float], tile: int) -> float:
    """Elements of offload's two alternating copy-back tiles (zero/offload.py: each slot is updated
    tile by tile, the tiles taking turns, each grown to the largest piece it ever holds)."""
    ring, k = [0.0, 0.0], 0
    for n in slots:
        lo = 0
        while lo < n:
            ring[k % 2] = max(ring[k % 2], min(tile, n - lo))
            lo += tile
            k += 1
    return sum(ring)


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 0.25."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size / 4:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{int(nbytes)} B"


def _human(count: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


__all__ = ["MemoryEstimate", "MemoryTable", "estimate_memory", "format_bytes"]

"""`deepspeed.runtime.utils`: the generic helpers scripts and Megatron-style code call, with
DeepSpeed's meaning.

Here: gradient and weight norms and clipping (with an optional Megatron `mpu` whose model-parallel
group the norm is summed over), splitting layers or elements into parts (`partition_uniform`,
`partition_balanced`, on zero/pipe/module.py's partitioner), `PartitionedTensor`, device moves of
nested containers, seeding, memory reports, `call_to_str` and the `bwc_*` queries of an `mpu`.
Left to the fallback (an explanatory stand-in): the pieces of DeepSpeed's own engine and ZeRO
optimizers (`CheckOverflow`, `all_gather_dp_groups`, the MoE norms, the output backward hooks,
`offload_adam_states`, `TLinear`, ...), which zero's engine does its own way.
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Sequence
from math import inf, isfinite, prod, sqrt
from typing import Any

import torch
import torch.distributed as dist

from zero.deepspeed._missing import missing
from zero.deepspeed.accelerator import get_accelerator
from zero.deepspeed.utils import see_memory_usage  # noqa: F401
from zero.pipe.module import partition as _partition_min_max
from zero.pipe.module import partition_uniform as _partition_uniform

PIPE_REPLICATED = "ds_pipe_replicated"  # a parameter copied on several pipeline stages, counted once in norms


class DummyOptim:
    """A stand-in optimizer holding the model's parameters as one param group (DeepSpeed uses it to
    run ZeRO stage 3 without an optimizer)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]


def filter_empty_parameters(params: Any) -> Any:
    """`params` without zero-element parameters: a list of parameters, or a list of param-group
    dicts (a group left empty is dropped). Anything else is returned as is."""
    if not isinstance(params, (list, tuple)) or not params:
        return params
    if not isinstance(params[0], dict):
        return [p for p in params if p.numel() > 0]
    kept = []
    for group in params:
        nonempty = [p for p in group["params"] if p.numel() > 0]
        if nonempty:
            kept.append({**{k: v for k, v in group.items() if k != "params"}, "params": nonempty})
    return kept


def noop_decorator(func: Callable) -> Callable:
    """A decorator that returns the function unchanged."""
    return func


class noop_context:  # noqa: N801 (DeepSpeed's name)
    """A context manager that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        return None


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold `filename` (and its parents) if missing."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy (if installed; seed mod 2**32) and torch (seed mod 2**63)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def is_model_parallel_parameter(p: Any) -> bool:
    """Whether `p` is split across tensor-parallel ranks: Megatron's marks (`model_parallel`,
    `tensor_model_parallel`), or, for zero's tensor slicing (zero.tp, torch DTensor), a DTensor
    sharded on some mesh dimension."""
    if getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False):
        return True
    placements = getattr(p, "placements", None)
    return placements is not None and any(pl.is_shard() for pl in placements)


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """A copy of `item` (lists, tuples and dicts searched recursively) in which every element that
    `criterion_func` accepts is moved with `.to(device)`; other leaves are kept as they are."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """Move the tensors of `item` (lists, tuples and dicts searched recursively) to `device`.

    With `criterion_func`, a leaf it accepts keeps its identity: its storage is replaced
    (`t.data = t.to(device).data`), so other references see the move; every other leaf is returned
    as `leaf.to(device)` (so leaves must have `.to`). Without it every leaf is `leaf.to(device)`.
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def get_tensor_bytes(item: Any) -> int:
    """Bytes held by the tensors in `item` (lists, tuples and dicts searched recursively)."""
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, (list, tuple)):
        return sum(get_tensor_bytes(v) for v in item)
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    return 0


# ---------------------------------------------------------------------------------------------
# Norms and clipping
# ---------------------------------------------------------------------------------------------

def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether `x` holds an inf or a NaN, as a bool scalar tensor on x's device (no host sync)."""
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return ~(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


def is_invalid_grad_norm(norm: Any) -> bool:
    """Whether a norm (number or tensor) is inf, NaN or negative (-1 is DeepSpeed's "invalid")."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list: Iterable[Any]) -> float:
    """The 2-norm of several 2-norms (sqrt of the sum of squares); inf if any is invalid."""
    norms = list(norm_list)
    if any(is_invalid_grad_norm(n) for n in norms):
        return float("inf")
    return sqrt(sum(float(n) ** 2.0 for n in norms))


def _mp_group(mpu: Any) -> Any:
    return mpu.get_model_parallel_group()


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)


def _as_list(parameters: Any) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so that their total norm is at most `max_norm`.

    Megatron's rule: with an `mpu`, the norm is combined over its model-parallel group, and a
    parameter that is not model-parallel is counted only on model-parallel rank 0. As DeepSpeed
    does, the norm is then averaged over the data-parallel group (the mpu's, else the world) when
    torch.distributed is initialized. Gradients are multiplied by min(1, max_norm / (norm + 1e-6)).

    Args:
        parameters: a tensor or an iterable of them; those without `.grad` are skipped.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm; `inf` for the largest absolute value.
        mpu: a Megatron model-parallel unit, or None.

    Returns:
        The total norm before clipping, a tensor.
    """
    params = [p for p in _as_list(parameters) if p.grad is not None]
    norm_type = float(norm_type)
    device = params[0].grad.device if params else torch.device(get_accelerator().current_device_name())
    if norm_type == inf:
        norms = [p.grad.detach().abs().max().float() for p in params]
        total = torch.stack(norms).max() if norms else torch.zeros((), device=device)
        if mpu is not None:
            _all_reduce(total, dist.ReduceOp.MAX, _mp_group(mpu))
    else:
        counted = [p for p in params if mpu is None or mpu.get_model_parallel_rank() == 0
                   or is_model_parallel_parameter(p)]
        norms = [p.grad.detach().float().norm(norm_type) for p in counted]
        total = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)
        if mpu is not None:
            _all_reduce(total, dist.ReduceOp.SUM, _mp_group(mpu))
        total = total.pow(1.0 / norm_type)
    if dist.is_available() and dist.is_initialized():
        dp_group = mpu.get_data_parallel_group() if mpu is not None and hasattr(mpu, "get_data_parallel_group") \
            else None
        total = total / dist.get_world_size(group=dp_group)
        dist.all_reduce(total, group=dp_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device))
    return total


def _norm_or_invalid(total: float) -> float:
    return -1 if total in (inf, -inf) or total != total else total


def get_flattened_grad_norm(parameters: Any, norm_type: float = 2, mpu: Any = None,
                            grad_norm_mask: Any = None) -> float:
    """The total p-norm of the gradients of `parameters` (summed over the mpu's model-parallel group),
    as a float; -1 if it is inf or NaN.

    Args:
        parameters: a tensor or an iterable of them; those without `.grad` are skipped.
        norm_type: the p of the p-norm; `inf` for the largest absolute value.
        mpu: a Megatron model-parallel unit, or None.
        grad_norm_mask: per parameter, a 2-D tensor of [start, end) element ranges left out of the norm
            (DeepSpeed uses it for duplicated elements of flattened buffers), or None.
    """
    params = [p for p in _as_list(parameters) if p.grad is not None]
    norm_type = float(norm_type)
    device = params[0].grad.device if params else torch.device(get_accelerator().current_device_name())
    if norm_type == inf:
        total = torch.tensor([max((float(p.grad.detach().abs().max()) for p in params), default=0.0)], device=device)
        if mpu is not None:
            _all_reduce(total, dist.ReduceOp.MAX, _mp_group(mpu))
        return _norm_or_invalid(total.item())
    acc = 0.0
    for i, p in enumerate(params):
        grad = p.grad.detach()
        if grad_norm_mask is not None and len(grad_norm_mask[i]) > 0:
            keep = torch.ones(grad.shape[0], dtype=torch.bool, device=grad.device)
            for start, end in grad_norm_mask[i].tolist():
                keep[start:end] = False
            grad = grad[keep]
        acc += grad.float().norm(norm_type).item() ** norm_type
    total = torch.tensor([acc], device=device)
    if mpu is not None:
        _all_reduce(total, dist.ReduceOp.SUM, _mp_group(mpu))
    return _norm_or_invalid(total.item() ** (1.0 / norm_type))


get_grad_norm = get_flattened_grad_norm  # DeepSpeed's older name for it


def _counted_once(params: list, mpu: Any) -> list:
    """Parameters a model-parallel sum counts here: pipeline-replicated copies and, off tensor rank 0,
    unsplit parameters are counted by another rank."""
    tp_rank = bwc_tensor_model_parallel_rank(mpu)
    return [p for p in params if not getattr(p, PIPE_REPLICATED, False)
            and (tp_rank == 0 or is_model_parallel_parameter(p))]


def get_grad_zeros(parameters: Any, mpu: Any = None) -> float:
    """How many gradient elements are exactly zero (summed over the mpu's model-parallel group)."""
    params = _counted_once([p for p in _as_list(parameters) if p.grad is not None], mpu)
    zeros = float(sum(p.grad.numel() - int(torch.count_nonzero(p.grad)) for p in params))
    device = params[0].grad.device if params else torch.device(get_accelerator().current_device_name())
    total = torch.tensor([zeros], device=device)
    if mpu is not None:
        _all_reduce(total, dist.ReduceOp.SUM, _mp_group(mpu))
    return total.item()


def get_weight_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """The total p-norm of the parameters themselves (summed over the mpu's model-parallel group,
    each parameter counted once), as a float; -1 if it is inf or NaN."""
    params = _as_list(parameters)
    norm_type = float(norm_type)
    device = params[0].device if params else torch.device(get_accelerator().current_device_name())
    if norm_type == inf:
        total = torch.tensor([max((float(p.detach().abs().max()) for p in params), default=0.0)], device=device)
        if mpu is not None:
            _all_reduce(total, dist.ReduceOp.MAX, _mp_group(mpu))
        return _norm_or_invalid(total.item())
    acc = sum(float(p.detach().float().norm(norm_type)) ** norm_type for p in _counted_once(params, mpu))
    total = torch.tensor([float(acc)], device=device)
    if mpu is not None:
        _all_reduce(total, dist.ReduceOp.SUM, _mp_group(mpu))
    return _norm_or_invalid(total.item() ** (1.0 / norm_type))


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:  # noqa: A002
    """Overwrite the inf and NaN elements of `input` with -1 (DeepSpeed's "invalid norm"; its `val`
    argument is not used, as in DeepSpeed)."""
    input.masked_fill_(~torch.isfinite(input), -1.0)


def combine_grad_norm_groups(norm_groups: Iterable[Any], norm_type: float = 2) -> torch.Tensor:
    """The p-norm of per-group norms; inf if any of them is invalid (inf, NaN or the -1 mark)."""
    norms = list(norm_groups)
    device = next((n.device for n in norms if torch.is_tensor(n)), None)
    stacked = torch.stack([n.float() if torch.is_tensor(n) else torch.tensor(float(n), device=device) for n in norms])
    combined = torch.linalg.vector_norm(stacked, ord=norm_type)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    return torch.where(invalid, torch.full_like(combined, inf), combined)


def get_global_norm_of_tensors(input_tensors: Sequence[torch.Tensor], norm_type: float = 2, mpu: Any = None,
                               moe_ep_group: Any = None) -> torch.Tensor:
    """The total p-norm of `input_tensors` (combined over the mpu's model-parallel group), as a float32
    scalar tensor; -1 where it is inf or NaN.

    Raises:
        NotImplementedError: a `moe_ep_group` is given (zero has no expert parallelism).
    """
    if moe_ep_group is not None:
        raise NotImplementedError("get_global_norm_of_tensors: moe_ep_group is not supported; zero has no expert "
                                  "parallelism")
    tensors = list(input_tensors)
    if not all(torch.is_tensor(t) for t in tensors):
        raise TypeError("get_global_norm_of_tensors expects a sequence of tensors")
    norm_type = float(norm_type)
    if norm_type == inf:
        total = torch.stack([t.detach().abs().max().float() for t in tensors]).max()
        if mpu is not None:
            _all_reduce(total, dist.ReduceOp.MAX, _mp_group(mpu))
    else:
        total = torch.stack([t.detach().float().norm(norm_type) for t in tensors]).pow(norm_type).sum()
        if mpu is not None:
            _all_reduce(total, dist.ReduceOp.SUM, _mp_group(mpu))
        total = total.pow(1.0 / norm_type)
    mask_nan_or_inf_with_val_inplace(total)
    return total


def clip_tensors_by_global_norm(input_tensors: Sequence[torch.Tensor], max_norm: float = 1.0,
                                global_norm: Any = None, mpu: Any = None, eps: float = 1e-6) -> Any:
    """Scale `input_tensors` in place by max_norm / (global_norm + eps) when that is below 1.

    Returns:
        The global norm (computed with `get_global_norm_of_tensors` unless given).
    """
    if global_norm is None:
        global_norm = get_global_norm_of_tensors(input_tensors, mpu=mpu)
    coef = max_norm / (global_norm + eps)
    if coef < 1:
        for t in input_tensors:
            t.detach().mul_(coef)
    return global_norm


def align_dense_tensors(tensor_list: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    """`tensor_list` plus, if their total size is not a multiple of `alignment`, a zero tensor that
    makes it one."""
    short = -sum(t.numel() for t in tensor_list) % alignment
    if not short:
        return tensor_list
    return tensor_list + [torch.zeros(short, device=tensor_list[0].device, dtype=tensor_list[0].dtype)]


# ---------------------------------------------------------------------------------------------
# Partitioning
# ---------------------------------------------------------------------------------------------

def prefix_sum_inc(weights: Iterable[Any]) -> list:
    """The inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    out: list = []
    for w in weights:
        out.append(w if not out else out[-1] + w)
    return out


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries [0, ..., num_items] of `num_parts` consecutive parts of num_items // num_parts
    items, the first num_items % num_parts parts one more; with no more items than parts, one item
    per part and the last parts empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return _partition_uniform(num_items, num_parts)


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries [0, ..., len(weights)] of `num_parts` consecutive, non-empty parts of about equal
    weight (with no more weights than parts: `partition_uniform`).

    zero's partitioner (zero/pipe/module.py, the one PipelineModule uses) makes the heaviest part
    as light as possible, which is what bounds a pipeline's step time; DeepSpeed's minimises the
    spread between the heaviest and the lightest part. Both are balanced and they agree on most
    inputs; where they differ, this split's heaviest part is never heavier than DeepSpeed's.
    """
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return _partition_min_max(weights, num_parts)


class PartitionedTensor:
    """A tensor split evenly over the ranks of `group`, each rank keeping its slice of the flattened
    tensor (slices by `partition_uniform`, so the first ranks hold one element more when it does
    not divide).

    Args:
        tensor: the whole tensor (every rank passes the same one).
        group: the process group (None: the world).
        partition_meta: not used (DeepSpeed's argument).

    `full()` gathers the whole tensor back; `to_meta()` encodes the shape and split as a LongTensor
    that, with `data()`, lets another process rebuild the object by `from_meta`.
    """

    def __init__(self, tensor: torch.Tensor, group: Any, partition_meta: Any = None) -> None:
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, end = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:end].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Any = None) -> PartitionedTensor:
        """Rebuild from `to_meta()`'s tensor and this rank's slice (`data()`)."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a LongTensor, got {meta.dtype}")
        obj = cls.__new__(cls)
        values = meta.tolist()
        ndim = values[0]
        obj.orig_size = values[1:1 + ndim]
        obj.num_parts, obj.rank = values[1 + ndim], values[2 + ndim]
        obj.partition = values[3 + ndim:]
        if obj.num_parts != dist.get_world_size(group=group) or obj.rank != dist.get_rank(group=group):
            raise ValueError(f"PartitionedTensor.from_meta: the meta was made by rank {obj.rank} of {obj.num_parts}, "
                             f"this is rank {dist.get_rank(group=group)} of {dist.get_world_size(group=group)}")
        obj.group = group
        obj.orig_device = device if device is not None else get_accelerator().device_name()
        obj.local_data = local_part.detach()
        obj.even_split = prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's slice (on `device`, default the original)."""
        device = self.orig_device if device is None else device
        flat = torch.zeros(prod(self.orig_size), dtype=self.local_data.dtype, device=device)
        if self.even_split:
            dist.all_gather_into_tensor(flat, self.local_data.to(device), group=self.group)
        else:
            for part in range(self.num_parts):
                piece = flat[self.partition[part]:self.partition[part + 1]]
                if part == self.rank:
                    piece.copy_(self.local_data)
                dist.broadcast(piece, dist.get_global_rank(self.group, part) if self.group is not None else part,
                               group=self.group)
        return flat.view(self.orig_size).clone()

    def to_meta(self) -> torch.Tensor:
        """[ndim, *shape, num_parts, rank, *boundaries] as a LongTensor on the original device."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

_last_memory = {"allocated": 0, "reserved": 0}


def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
    """Print this rank's allocated and reserved device memory, the change since the last call and the
    peaks, in GB (only on `print_rank` unless it is -1)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if print_rank != -1 and rank != print_rank:
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        if reset_max:
            torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated() if cuda else 0
    reserved = torch.cuda.memory_reserved() if cuda else 0
    peak_allocated = torch.cuda.max_memory_allocated() if cuda else 0
    peak_reserved = torch.cuda.max_memory_reserved() if cuda else 0
    d_alloc, d_res = allocated - _last_memory["allocated"], reserved - _last_memory["reserved"]
    _last_memory.update(allocated=allocated, reserved=reserved)
    gb = 1024**3
    print(f"RANK={rank} MEMSTATS", msg, f"device={get_accelerator().current_device_name()} "
          f"current alloc={allocated / gb:0.4f}GB (delta={d_alloc / gb:0.4f}GB max={peak_allocated / gb:0.4f}GB) "
          f"current cache={reserved / gb:0.4f}GB (delta={d_res / gb:0.4f}GB max={peak_reserved / gb:0.4f}GB)")


def get_ma_status() -> int:
    """Device memory allocated now, in bytes, on rank 0 (0 on the other ranks)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return 0
    return get_accelerator().memory_allocated()


def empty_cache() -> None:
    """Return the cached device memory to the driver and reset the peak statistics."""
    get_accelerator().empty_cache()
    get_accelerator().reset_peak_memory_stats()


def get_checkpoint_folder_size(save_dir: str, tag: str, local_rank: int | None = None) -> int:
    """Bytes of the files under save_dir/tag, counted by the rank whose `local_rank` is 0 and summed
    onto global rank 0 (a collective when torch.distributed is initialized)."""
    size = 0
    if local_rank == 0:
        for path, _, files in os.walk(os.path.join(save_dir, tag)):
            size += sum(os.path.getsize(os.path.join(path, f)) for f in files)
    total = torch.tensor(size, device=get_accelerator().device_name())
    if dist.is_available() and dist.is_initialized():
        dist.reduce(total, dst=0)
    return int(total)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """How the call `base(*args, **kwargs)` is written: `call_to_str("f", 1, x=2) == "f(1, x=2)"`."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def get_only_unique_item(items: Iterable[Any]) -> Any:
    """The one distinct value of `items`; RuntimeError if there are several or none."""
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def is_optimized_parameter(param: torch.Tensor) -> bool:
    """Whether an optimizer should own `param`: it requires grad and has at least one element
    (counting a stage-3 parameter's whole size)."""
    return param.requires_grad and getattr(param, "ds_numel", param.numel()) > 0


def bwc_tensor_model_parallel_rank(mpu: Any = None) -> int:
    """The tensor-parallel rank an `mpu` reports under any of its API's generations (0 without one)."""
    if mpu is None:
        return 0
    for query in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(mpu, query):
            return getattr(mpu, query)()
    return mpu.get_model_parallel_rank()


def bwc_tensor_model_parallel_world_size(mpu: Any = None) -> int:
    """The tensor-parallel size an `mpu` reports under any of its API's generations (1 without one)."""
    if mpu is None:
        return 1
    for query in ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size"):
        if hasattr(mpu, query):
            return getattr(mpu, query)()
    return mpu.get_model_parallel_world_size()


def bwc_tensor_model_parallel_group(mpu: Any = None) -> Any:
    """The tensor-parallel group an `mpu` reports under any of its API's generations (None without one)."""
    if mpu is None:
        return None
    for query in ("get_tensor_model_parallel_group", "get_slice_parallel_group"):
        if hasattr(mpu, query):
            return getattr(mpu, query)()
    return mpu.get_model_parallel_group()


def bwc_pipeline_parallel_world_size(mpu: Any = None) -> int:
    """The pipeline size an `mpu` (Megatron's or a PipelineParallelGrid) reports; 1 without one."""
    for query in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):
        if mpu is not None and hasattr(mpu, query):
            return getattr(mpu, query)()
    return 1


def bwc_pipeline_parallel_group(mpu: Any = None) -> Any:
    """The pipeline group an `mpu` (Megatron's or a PipelineParallelGrid) reports; None without one.

    Raises:
        ValueError: the mpu has neither query.
    """
    if mpu is None:
        return None
    for query in ("get_pipeline_model_parallel_group", "get_pipe_parallel_group"):
        if hasattr(mpu, query):
            return getattr(mpu, query)()
    raise ValueError(f"{type(mpu).__name__} has no pipeline-parallel group (neither "
                     f"get_pipeline_model_parallel_group nor get_pipe_parallel_group)")


def __getattr__(name: str):
    return missing(__name__, name)

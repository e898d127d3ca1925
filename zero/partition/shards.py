"""Per-parameter shards (stage 3 and `zero.Init`): which elements of a parameter a rank keeps.

[Note: parameter shards]
A parameter of n elements is padded to N*s elements, s = ceil(n / N), and rank r keeps elements
[r*s, (r+1)*s) of its flattened value: its shard. The `nn.Parameter` object stays in the module,
but between uses its `.data` is an empty tensor; the shape lives in `param._zero.shape`. Sharding
per parameter (as FSDP2 and DeepSpeed do) lets `zero.Init`, `GatheredParameters`, external
parameters and consolidated saving all work on one parameter at a time. Padding elements are
zero and stay zero.
"""
from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass

import torch

from zero.parallel.comm import Comm
from zero.parallel.sliced import local_tensor


def shard_numel(numel: int, world_size: int) -> int:
    """s = ceil(numel / world_size): the elements each rank keeps of a parameter."""
    return -(-numel // world_size)


@dataclass
class ShardedParam:
    """Bookkeeping attached to a sharded parameter as `param._zero`.

    Args:
        shape: the parameter's full shape.
        numel: its element count.
        shard_numel: s, the elements each rank keeps.
        local: this rank's shard while no unit owns it (under `zero.Init`, before `initialize`).
        unit: the unit that owns it once an engine exists.
        offset: where its shard starts in the unit's flat shard.
    """

    shape: torch.Size
    numel: int
    shard_numel: int
    local: torch.Tensor | None = None
    unit: object | None = None  # a stage-3 unit (zero/stages/unit.py): its shard, comm, freshen()
    offset: int = 0

    def shard(self) -> torch.Tensor:
        """This rank's shard (s elements), wherever it lives."""
        if self.unit is not None:
            return self.unit.shard[self.offset : self.offset + self.shard_numel]
        return self.local

    def comm(self) -> Comm:
        """The ranks the parameter is sharded over: its unit's data-parallel group, else (under
        `zero.Init`, before `initialize`) the world."""
        return self.unit.comm if self.unit is not None else Comm()


def take_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's padded slice of a full tensor, as a new contiguous 1-D tensor."""
    s = shard_numel(full.numel(), world_size)
    flat = full.detach().reshape(-1)
    out = torch.zeros(s, dtype=full.dtype, device=full.device)
    lo, hi = min(rank * s, flat.numel()), min((rank + 1) * s, flat.numel())
    out[: hi - lo].copy_(flat[lo:hi])
    return out


def gather_param(shard: torch.Tensor, numel: int, comm: Comm) -> torch.Tensor:
    """The full flattened value of one parameter from every rank's shard (all ranks call it)."""
    if comm.world_size == 1:
        return shard[:numel].clone()
    out = torch.empty(comm.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard.contiguous())
    return out[:numel]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `ds_status` of a stage-3 parameter."""

    AVAILABLE = 1  # gathered: `.data` holds the full value
    NOT_AVAILABLE = 2  # released: `.data` is empty, `ds_tensor` holds this rank's shard
    INFLIGHT = 3  # being gathered


_IDS = itertools.count()


def mark_ds(p, info: ShardedParam, shard: torch.Tensor, persistent: bool = False) -> None:
    """[Note: ds attributes]
    DeepSpeed's stage-3 parameter attributes, which transformers, PEFT and TRL read: `ds_numel` and
    `ds_shape` (the full size: parameter counts use them when `.numel()` is 0), `ds_id`, `ds_tensor`
    (this rank's shard), `ds_persist`, `ds_status` (kept current by the unit as it gathers and
    releases), `all_gather()` / `all_gather_coalesced()` / `partition()`, `ds_summary()`,
    `partition_numel()`, `padding_size()`, `aligned_size()`, `ds_active_sub_modules` (kept empty:
    zero tracks what is in use by unit, not by module) and `is_external_param`."""
    p.ds_numel, p.ds_shape, p.ds_tensor, p.ds_persist = info.numel, info.shape, shard, persistent
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_IDS)
    p.ds_status = ZeroParamStatus.AVAILABLE if local_tensor(p).numel() == info.numel and info.numel else \
        ZeroParamStatus.NOT_AVAILABLE
    p.all_gather = functools.partial(_all_gather, p)
    p.all_gather_coalesced = functools.partial(_all_gather_coalesced, p)
    p.partition = functools.partial(_partition, p)
    p.ds_summary = functools.partial(_summary, p)
    p.partition_numel = functools.partial(_partition_numel, p)
    p.padding_size = functools.partial(_padding_size, p)
    p.aligned_size = functools.partial(_aligned_size, p)
    if not hasattr(p, "ds_active_sub_modules"):
        p.ds_active_sub_modules = set()
    if not hasattr(p, "is_external_param"):
        p.is_external_param = False


def _summary(p, use_debug_name: bool = False) -> dict:
    """DeepSpeed's `param.ds_summary()`: the parameter's stage-3 bookkeeping as a dict."""
    return {"id": p.ds_id, "status": p.ds_status.name, "numel": p.numel(), "ds_numel": p.ds_numel,
            "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape), "requires_grad": p.requires_grad,
            "grad_shape": tuple(p.grad.shape) if p.grad is not None else None, "persist": p.ds_persist,
            "active_sub_modules": p.ds_active_sub_modules, "ds_tensor.shape": p._zero.shard().shape}


def _partition_numel(p) -> int:
    return p._zero.shard_numel


def _aligned_size(p) -> int:
    return p._zero.shard_numel * p._zero.comm().world_size


def _padding_size(p) -> int:
    return _aligned_size(p) - p._zero.numel


class _Done:
    """The handle DeepSpeed's asynchronous gathers return; ours have finished."""

    def wait(self) -> None:
        return None


def _all_gather_coalesced(p, params=None, safe_mode: bool = False, quantize: bool = False) -> _Done:
    _all_gather(p, params)
    return _Done()


def _all_gather(p, param_list=None, async_op: bool = False, hierarchy: int = 0):
    """DeepSpeed's `param.all_gather()`: the full value in `p.data` until `partition()`."""
    for q in param_list or [p]:
        if q.ds_status is not ZeroParamStatus.AVAILABLE:
            if q._zero.unit is not None:
                q._zero.unit.freshen()  # Muon's matrices updated since their last gather
            local_tensor(q).data = gather_param(q._zero.shard(), q._zero.numel, q._zero.comm()).view(q._zero.shape)
            q.ds_status = ZeroParamStatus.AVAILABLE
            q._zero_gathered_by_user = True
    return _Done() if async_op else None


def _partition(p, param_list=None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True):
    """DeepSpeed's `param.partition()`: release what `all_gather()` gathered (read-only: use
    GatheredParameters(modifier_rank=...) to change values)."""
    for q in param_list or [p]:
        if getattr(q, "_zero_gathered_by_user", False):
            local_tensor(q).data = q._zero.shard()[:0]
            q.ds_status = ZeroParamStatus.NOT_AVAILABLE
            q._zero_gathered_by_user = False

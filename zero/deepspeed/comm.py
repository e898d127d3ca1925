"""`deepspeed.comm`: torch.distributed under DeepSpeed's names (zero's collectives are torch's)."""
from __future__ import annotations

import os

import torch.distributed as _dist

from zero.deepspeed._missing import missing, module_names
from zero.parallel.process_group import init_distributed as _init_distributed

ReduceOp = _dist.ReduceOp


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True, timeout=None,
                     init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1) -> None:
    """`deepspeed.init_distributed`: join the group torchrun describes, or the one `init_method`,
    `rank` and `world_size` describe (see zero.init_distributed).

    `timeout` (a timedelta) is the collective timeout. MPI discovery, `distributed_port`, `verbose`
    and `config` have nothing to do.
    """
    _init_distributed(dist_backend, None if timeout is None else timeout.total_seconds(), init_method, rank,
                      world_size)


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group=None, async_op=False, device_ids=None):
    if is_initialized():
        return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return None


def __getattr__(name: str):
    if name.startswith("__"):  # `__path__`: DeepSpeed's comm is a package (see [Note: absent names])
        return missing("deepspeed.comm", name)
    listed = module_names("deepspeed.comm").get(name)
    if listed is not None and listed.kind in ("module", "constant"):  # DeepSpeed's submodules and constants
        return missing("deepspeed.comm", name)
    value = getattr(_dist, name, None)  # all_reduce, broadcast, all_gather, new_group, ... as torch has them
    if value is not None:
        return value
    return missing("deepspeed.comm", name)

"""`deepspeed.comm`: torch.distributed under DeepSpeed's names (zero's collectives are torch's)."""
from __future__ import annotations

import os

import torch.distributed as _dist

from zero.deepspeed._missing import missing
from zero.engine import init_distributed  # noqa: F401

ReduceOp = _dist.ReduceOp


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
    value = getattr(_dist, name, None)  # all_reduce, broadcast, all_gather, new_group, ... as torch has them
    if value is not None:
        return value
    return missing("deepspeed.comm", name)

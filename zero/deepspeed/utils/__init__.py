"""`deepspeed.utils`: logging, the safe_get_*/safe_set_* accessors of a trained parameter's values
(zero/accessors.py) and the stage-3 leaf-module marks (zero/init.py)."""
from __future__ import annotations

import logging

import torch

from zero.accessors import (  # noqa: F401
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_grad,
)
from zero.data import RepeatingLoader  # noqa: F401
from zero.deepspeed._missing import missing
from zero.deepspeed.utils import zero_to_fp32  # noqa: F401
from zero.init import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module  # noqa: F401

logger = logging.getLogger("zero")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (None or [-1]: every rank)."""
    from zero.deepspeed.comm import get_rank

    if ranks is None or -1 in ranks or get_rank() in ranks:
        logger.log(level, f"[Rank {get_rank()}] {message}")


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the peak GPU memory allocated so far, on rank 0, when `force` (as DeepSpeed's, which
    logs nothing otherwise)."""
    if force:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        log_dist(f"{message} | max allocated {peak:.2f} GB", ranks=[0])


def __getattr__(name: str):
    return missing("deepspeed.utils", name)

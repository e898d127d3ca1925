"""The schedules' shared helpers: argument checks that name the scheduler and the parameter (see
[Note: where we differ from DeepSpeed] in zero/lr_schedules/schedules.py), writing learning rates
into param groups, and the warmup curve."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim import Optimizer

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


def torch_optimizer(optimizer: Any, scheduler: str) -> Any:
    """The object whose ``param_groups`` the scheduler writes.

    A torch Optimizer is used as is; a wrapper exposing ``.optimizer`` (as DeepSpeed's and our
    ZeRO optimizers do) is unwrapped; anything else with a ``param_groups`` list is accepted.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    raise TypeError(
        f"{scheduler}: optimizer must be a torch.optim.Optimizer (or wrap one as .optimizer), "
        f"got {type(optimizer).__name__}"
    )


def write_lrs(param_groups: list[dict], lrs: list[float]) -> list[float]:
    """Store one lr per group; tensor lrs are filled in place. Returns the values written."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(scheduler: str, name: str, value: Any, minimum: int | None = None) -> None:
    if not is_int(value):
        raise ValueError(f"{scheduler}: {name} must be an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{scheduler}: {name} must be {bound}, got {value}")


def check_number(scheduler: str, name: str, value: Any) -> None:
    if not is_number(value):
        raise ValueError(f"{scheduler}: {name} must be a number, got {type(value).__name__} {value!r}")


_FP32_MAX = torch.finfo(torch.float32).max


def check_lr(scheduler: str, name: str, value: Any) -> None:
    """A learning rate: a finite number in [0, largest float32] (the optimizer computes with it in fp32)."""
    check_number(scheduler, name, value)
    if not (math.isfinite(value) and 0 <= value <= _FP32_MAX):
        raise ValueError(f"{scheduler}: {name} must be a finite learning rate in [0, {_FP32_MAX:.6g}] "
                         f"(the largest float32), got {value!r}")


def per_group(scheduler: str, name: str, value: Any, num_groups: int) -> list[float]:
    """A learning rate broadcast to every param group, or a list/tuple with one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{scheduler}: {name} has {len(value)} values but the optimizer has {num_groups} "
                f"param groups; give one value per group or a single number"
            )
        for i, item in enumerate(value):
            check_lr(scheduler, f"{name}[{i}]", item)
        return list(value)
    check_lr(scheduler, name, value)
    return [value] * num_groups


def check_warmup_type(scheduler: str, warmup_type: Any) -> None:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"{scheduler}: warmup_type must be 'log' or 'linear', got {warmup_type!r}")


def warmup_fraction(batch: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup has progressed at batch index ``batch`` (< warmup_num_steps), in [0, 1).

    "log" rises as log(batch + 1) / log(warmup_num_steps), so it reaches 1 at the last warmup
    batch; "linear" rises as batch / warmup_num_steps and stops one step short of 1.
    """
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(batch + 1) / math.log(warmup_num_steps)
    return batch / warmup_num_steps



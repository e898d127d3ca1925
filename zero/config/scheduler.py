"""The `scheduler` section: DeepSpeed's schedules and torch's, each with its own parameters."""
from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, Field, field_validator, model_validator

from zero.config.errors import _fmt, _NestedIssues, _suggest, _validate_nested
from zero.config.sections import AUTO, FP32_MAX, _lr, _Section
from zero.lr_schedules.build import mistyped_params

# ---------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------

class WarmupLRParams(_Section):
    """WarmupLR: lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stays."""

    warmup_min_lr: float = Field(0.0, ge=0, description="Starting learning rate.")
    warmup_max_lr: Optional[float] = Field(None, ge=0, description="Peak lr; None uses the optimizer's lr.")
    warmup_num_steps: int = Field(1000, gt=0, description="Steps of warmup.")
    warmup_type: Literal["log", "linear"] = Field("log", description="Shape of the warmup curve.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")

    _check_lr = field_validator("warmup_min_lr", "warmup_max_lr")(_lr)


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: int = Field(..., gt=0, description="Step at which the lr reaches 0.")
    warmup_max_lr: float = Field(0.001, ge=0, description="Peak learning rate.")


class WarmupCosineLRParams(_Section):
    """WarmupCosineLR: ratio of the optimizer lr warms up, then follows a cosine to cos_min_ratio."""

    total_num_steps: int = Field(..., gt=0, description="Total steps of the schedule.")
    warmup_min_ratio: float = Field(0.0, ge=0, le=1, description="Starting ratio of the optimizer lr.")
    warmup_num_steps: int = Field(1000, gt=0, description="Steps of warmup.")
    cos_min_ratio: float = Field(0.0001, ge=0, le=1, description="Final ratio of the optimizer lr.")
    warmup_type: Literal["log", "linear"] = Field("log", description="Shape of the warmup curve.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")


class OneCycleParams(_Section):
    """OneCycle: lr (and momentum) cycle between bounds, then decay."""

    cycle_min_lr: float = Field(..., ge=0, description="Lower lr bound.")
    cycle_max_lr: float = Field(..., ge=0, description="Upper lr bound.")
    decay_lr_rate: float = Field(0.0, ge=0, description="Post-cycle lr decay rate.")
    cycle_first_step_size: int = Field(2000, gt=0, description="Steps in the rising half.")
    cycle_second_step_size: Optional[int] = Field(None, gt=0, description="Falling half; None = first.")
    cycle_first_stair_count: int = Field(0, ge=0, description="Stairs in the rising half; 0 = smooth.")
    cycle_second_stair_count: Optional[int] = Field(None, ge=0, description="None = first stair count.")
    decay_step_size: int = Field(0, ge=0, description="Interval of post-cycle decay; 0 = no decay.")
    cycle_momentum: bool = Field(True, description="Cycle beta1 inversely to the lr.")
    cycle_min_mom: float = Field(0.8, ge=0, lt=1, description="Lower momentum bound.")
    cycle_max_mom: float = Field(0.9, ge=0, lt=1, description="Upper momentum bound.")
    decay_mom_rate: float = Field(0.0, ge=0, description="Post-cycle momentum decay rate.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")

    _check_lr = field_validator("cycle_min_lr", "cycle_max_lr")(_lr)


class LRRangeTestParams(_Section):
    """LRRangeTest: lr grows from lr_range_test_min_lr to find a usable maximum."""

    lr_range_test_min_lr: float = Field(1e-3, ge=0, description="Starting learning rate.")
    lr_range_test_step_size: int = Field(2000, gt=0, description="Steps per increase.")
    lr_range_test_step_rate: float = Field(1.0, ge=0, description="Growth rate.")
    lr_range_test_staircase: bool = Field(False, description="Grow in stairs instead of smoothly.")
    last_batch_iteration: int = Field(-1, ge=-1, description="Resume point; -1 starts fresh.")

    _check_lr = field_validator("lr_range_test_min_lr")(_lr)


DEEPSPEED_SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams,
}


def _torch_scheduler(name: str) -> Optional[type]:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or torch.optim.lr_scheduler._LRScheduler
    ok = isinstance(cls, type) and (issubclass(cls, base) or name == "ReduceLROnPlateau")
    return cls if ok else None


# Learning rates among the arguments of torch's schedulers (CyclicLR, OneCycleLR, CosineAnnealing*,
# ReduceLROnPlateau); they must fit a float32 like every other lr in the config.
_TORCH_LR_PARAMS = frozenset({"base_lr", "max_lr", "eta_min", "min_lr"})


def _check_torch_scheduler_params(cls: type, params: dict) -> dict:
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in list(sig.parameters.values())[2:]
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # skip self, optimizer
    names = {p.name for p in accepted}
    issues = []
    for key in params:
        if key not in names:
            issues.append(((key,), f"unknown key '{key}' for torch.optim.lr_scheduler.{cls.__name__}"
                                   f"{_suggest(key, names)}"))
    for p in accepted:
        if p.default is inspect.Parameter.empty and p.name not in params:
            issues.append(((p.name,), f"required by torch.optim.lr_scheduler.{cls.__name__}"))
    for key, ann in mistyped_params(cls, {k: v for k, v in params.items() if k in names}).items():
        issues.append(((key,), f"expected {ann} for torch.optim.lr_scheduler.{cls.__name__}, got {_fmt(params[key])}"))
    for key, value in params.items():
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if not isinstance(item, (int, float)) or isinstance(item, bool):
                continue
            where = (key, i) if isinstance(value, list) else (key,)
            if not math.isfinite(item):
                issues.append((where, f"expected a finite number, got {item}"))
            elif key in _TORCH_LR_PARAMS and not 0 <= item <= FP32_MAX:
                issues.append((where, f"expected a learning rate in [0, {FP32_MAX:.6g}] (the largest float32), "
                                      f"got {item!r}"))
    if issues:
        raise _NestedIssues(issues)
    return dict(params)


class SchedulerConfig(_Section):
    """`scheduler`: a DeepSpeed schedule (params validated) or a torch.optim.lr_scheduler class."""

    type: str = Field(..., description="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, "
                      "or the name of a torch.optim.lr_scheduler class (e.g. CosineAnnealingLR).")
    params: Any = Field(default_factory=dict, description="Arguments of the schedule (per type).")

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v in DEEPSPEED_SCHEDULERS or _torch_scheduler(v) is not None:
            return v
        names = list(DEEPSPEED_SCHEDULERS) + [n for n in dir(torch.optim.lr_scheduler)
                                               if _torch_scheduler(n) is not None]
        close = difflib.get_close_matches(v, names, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"unknown scheduler type {v!r}{hint} (DeepSpeed schedules: "
                         f"{', '.join(DEEPSPEED_SCHEDULERS)}; or any torch.optim.lr_scheduler class)")

    @model_validator(mode="after")
    def _params(self) -> SchedulerConfig:
        params = self.params
        if isinstance(params, BaseModel):
            return self
        if not isinstance(params, dict):
            raise _NestedIssues([(("params",), f"expected a dictionary, got {_fmt(params)}")])
        try:
            if self.type in DEEPSPEED_SCHEDULERS:
                value = _validate_nested(DEEPSPEED_SCHEDULERS[self.type], params)
            else:
                value = _check_torch_scheduler_params(
                    _torch_scheduler(self.type), {k: v for k, v in params.items() if v != AUTO})
        except _NestedIssues as err:
            raise _NestedIssues([(("params",) + loc, msg) for loc, msg in err.issues]) from None
        self.__dict__["params"] = value
        return self



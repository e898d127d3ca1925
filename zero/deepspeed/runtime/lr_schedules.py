"""`deepspeed.runtime.lr_schedules`: zero's schedules (zero/lr_schedules/), which give DeepSpeed's
numbers step for step, with DeepSpeed's constants and command-line helpers.

The helpers turn command-line flags into a config's `"scheduler"` block: `add_tuning_arguments`
adds DeepSpeed's flags (`--lr_schedule`, `--warmup_num_steps`, ...) to an argparse parser,
`get_config_from_args` makes `{"type": ..., "params": {...}}` from the parsed flags, and
`get_lr_from_config` reads the peak lr such a block sets. Like DeepSpeed's, the last two return a
`(value, error message)` pair instead of raising.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.optim import Optimizer

from zero.deepspeed._missing import missing
from zero.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401
from zero.lr_schedules.checks import WARMUP_LINEAR_RATE, WARMUP_LOG_RATE  # noqa: F401

LR_SCHEDULE = "lr_schedule"  # the command-line flag naming the schedule
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# parameter names (the keys of a scheduler block's "params", and the command-line flags)
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"

# which command-line values each schedule's params take (note: `cycle_momentum` is a flag that
# DeepSpeed's helpers never copy into the params, so OneCycle keeps its default, True)
_LR_RANGE_TEST_KEYS = (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE)
_ONE_CYCLE_KEYS = (CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
                   DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM,
                   DECAY_MOM_RATE)
_WARMUP_LR_KEYS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)
_WARMUP_COSINE_KEYS = (WARMUP_NUM_STEPS, WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO)  # ratios, no lr


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's learning-rate flags (group "Convergence Tuning") to `parser` and return it.

    The flags and defaults are DeepSpeed's: `--lr_schedule` (None), LRRangeTest's
    `--lr_range_test_{min_lr,step_rate,step_size,staircase}`, OneCycle's `--cycle_*`, `--decay_*`
    and `--cycle_momentum`, WarmupLR's `--warmup_{min_lr,max_lr,num_steps,type}` and
    WarmupCosineLR's `--warmup_min_ratio` / `--cos_min_ratio`.
    """
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")

    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="LRRangeTest: starting lr.")
    group.add_argument("--lr_range_test_step_rate", type=float, default=1.0, help="LRRangeTest: growth per interval.")
    group.add_argument("--lr_range_test_step_size", type=int, default=1000, help="LRRangeTest: steps per interval.")
    group.add_argument("--lr_range_test_staircase", default=False, action="store_true",
                       help="LRRangeTest: grow in whole intervals.")

    group.add_argument("--cycle_first_step_size", type=int, default=1000, help="OneCycle: steps of the rising half.")
    group.add_argument("--cycle_first_stair_count", type=int, default=-1, help="OneCycle: stairs of the rising half.")
    group.add_argument("--cycle_second_step_size", type=int, default=-1,
                       help="OneCycle: steps of the falling half (default: the first's).")
    group.add_argument("--cycle_second_stair_count", type=int, default=-1, help="OneCycle: stairs of the falling half.")
    group.add_argument("--decay_step_size", type=int, default=1000, help="OneCycle: steps per post-cycle decay unit.")
    group.add_argument("--cycle_min_lr", type=float, default=0.01, help="OneCycle: lowest lr.")
    group.add_argument("--cycle_max_lr", type=float, default=0.1, help="OneCycle: highest lr.")
    group.add_argument("--decay_lr_rate", type=float, default=0.0, help="OneCycle: post-cycle lr decay rate.")
    group.add_argument("--cycle_momentum", default=False, action="store_true", help="OneCycle: cycle momentum too.")
    group.add_argument("--cycle_min_mom", type=float, default=0.8, help="OneCycle: lowest momentum.")
    group.add_argument("--cycle_max_mom", type=float, default=0.9, help="OneCycle: highest momentum.")
    group.add_argument("--decay_mom_rate", type=float, default=0.0, help="OneCycle: post-cycle momentum decay rate.")

    group.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR: lr at the start of warmup.")
    group.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR: lr at the end of warmup.")
    group.add_argument("--warmup_num_steps", type=int, default=1000, help="WarmupLR: steps of warmup.")
    group.add_argument("--warmup_type", type=str, default=WARMUP_LOG_RATE, help="WarmupLR: 'log' or 'linear' warmup.")

    group.add_argument("--warmup_min_ratio", type=float, default=0.01,
                       help="WarmupCosineLR: lr ratio at the start of warmup.")
    group.add_argument("--cos_min_ratio", type=float, default=0.01, help="WarmupCosineLR: lr ratio at the end.")
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """Parse sys.argv for the flags of `add_tuning_arguments`; returns (those, the other arguments)."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _override(args: Any, params: dict, keys: tuple[str, ...]) -> None:
    """Copy each of `keys` that `args` has, and is not None, into `params`."""
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_lr_range_test_params(args: Any, params: dict) -> None:
    """Set LRRangeTest's params from the command-line values in `args` (those present, not None)."""
    _override(args, params, _LR_RANGE_TEST_KEYS)


def override_1cycle_params(args: Any, params: dict) -> None:
    """Set OneCycle's params from the command-line values in `args` (those present, not None)."""
    _override(args, params, _ONE_CYCLE_KEYS)


def override_warmupLR_params(args: Any, params: dict) -> None:  # noqa: N802 (DeepSpeed's name)
    """Set WarmupLR's (and WarmupDecayLR's) params from the command-line values in `args`."""
    _override(args, params, _WARMUP_LR_KEYS)


def override_warmupCosineLR_params(args: Any, params: dict) -> None:  # noqa: N802 (DeepSpeed's name)
    """Set WarmupCosineLR's params (warmup steps and type, the two ratios) from `args`."""
    _override(args, params, _WARMUP_COSINE_KEYS)


def override_params(args: Any, params: dict) -> None:
    """All four overrides in turn: every schedule's command-line values go into `params`."""
    for keys in (_LR_RANGE_TEST_KEYS, _ONE_CYCLE_KEYS, _WARMUP_LR_KEYS, _WARMUP_COSINE_KEYS):
        _override(args, params, keys)


def get_config_from_args(args: Any) -> tuple[dict | None, str | None]:
    """The scheduler block `{"type": args.lr_schedule, "params": {...}}` the command line describes.

    Returns:
        (config, None), or (None, why) when `--lr_schedule` is absent or not one of
        VALID_LR_SCHEDULES. WarmupDecayLR takes WarmupLR's values (add `total_num_steps` yourself).
    """
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    keys = {LR_RANGE_TEST: _LR_RANGE_TEST_KEYS, ONE_CYCLE: _ONE_CYCLE_KEYS,
            WARMUP_COSINE_LR: _WARMUP_COSINE_KEYS}.get(schedule, _WARMUP_LR_KEYS)
    params: dict[str, Any] = {}
    _override(args, params, keys)
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict) -> tuple[float | None, str]:
    """The learning rate a scheduler block sets: LRRangeTest's min lr, OneCycle's max lr, WarmupLR's
    and WarmupDecayLR's max lr.

    Returns:
        (lr, ""), or (None, why) when the block has no type or params, an unknown type, or is
        WarmupCosineLR (which scales the optimizer's own lr and names none).

    Raises:
        KeyError: the params lack the key the schedule's lr is read from.
    """
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == WARMUP_COSINE_LR:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params define no lr"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(schedule, WARMUP_MAX_LR)
    return params[key], ""


def update_lr(param_groups: list[dict], lrs: list[Any]) -> list[Any]:
    """Write one lr per param group (a tensor lr is filled in place); returns the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def get_torch_optimizer(optimizer: Any) -> Optimizer:
    """`optimizer` itself if it is a torch Optimizer, else the torch Optimizer it wraps as `.optimizer`.

    Raises:
        TypeError: neither is a torch.optim.Optimizer.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer (nor wraps one "
                    f"as .optimizer)")


def __getattr__(name: str):
    return missing(__name__, name)

"""Learning-rate schedules with DeepSpeed's names, parameters and numbers.

`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` and `LRRangeTest` produce the same
learning rates, step for step, as `deepspeed.runtime.lr_schedules`, so a config's
``"scheduler": {"type": ..., "params": {...}}`` block means the same thing here.
`build_scheduler` turns such a block into a scheduler; it also accepts any class of
`torch.optim.lr_scheduler` that can be built from JSON, as DeepSpeed does.

The package: `schedules.py` holds the five schedules and what they share (see its notes on
DeepSpeed's step counting and on where we differ); `build.py` holds `build_scheduler`, which
checks a config block's type and params and builds the scheduler.
"""

from zero.lr_schedules.build import DEEPSPEED_SCHEDULERS, build_scheduler, valid_scheduler_names
from zero.lr_schedules.schedules import (
                                         LRRangeTest,
                                         OneCycle,
                                         WarmupCosineLR,
                                         WarmupDecayLR,
                                         WarmupLR,
)

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "DEEPSPEED_SCHEDULERS",
    "build_scheduler",
    "valid_scheduler_names",
]

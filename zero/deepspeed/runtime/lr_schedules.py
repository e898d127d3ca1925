"""`deepspeed.runtime.lr_schedules`: zero's schedules, which give DeepSpeed's numbers step for step."""
from zero.deepspeed._missing import missing
from zero.lr_schedules import DEEPSPEED_SCHEDULERS, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401

VALID_LR_SCHEDULES = list(DEEPSPEED_SCHEDULERS)  # DeepSpeed's names, which the config's "scheduler" takes


def __getattr__(name: str):
    return missing(__name__, name)

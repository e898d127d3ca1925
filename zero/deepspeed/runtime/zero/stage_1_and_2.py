"""`deepspeed.runtime.zero.stage_1_and_2`."""
from zero.deepspeed._missing import missing
from zero.stages.buckets import ZeroOptimizer as DeepSpeedZeroOptimizer  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.zero.stage_1_and_2`."""
from zero.stages.buckets import ZeroOptimizer as DeepSpeedZeroOptimizer  # noqa: F401

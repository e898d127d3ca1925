"""`deepspeed.runtime.zero.stage3`."""
from zero.stages.stage3 import Stage3Optimizer as DeepSpeedZeroOptimizer_Stage3  # noqa: F401

"""`deepspeed.runtime.zero.stage3`."""
from zero.deepspeed._missing import missing
from zero.stages.stage3 import Stage3Optimizer as DeepSpeedZeroOptimizer_Stage3  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

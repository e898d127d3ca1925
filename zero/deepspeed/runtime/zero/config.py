"""`deepspeed.runtime.zero.config`: the `zero_optimization` section's model, built from a dict."""
import enum

from zero.config.sections import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig  # noqa: F401
from zero.config.sections import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig  # noqa: F401
from zero.config.sections import ZeroOptimizationConfig as DeepSpeedZeroConfig  # noqa: F401
from zero.deepspeed._missing import missing


class ZeroStageEnum(enum.IntEnum):
    """The values of `zero_optimization.stage`."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.zero.config`: the `zero_optimization` section's model, built from a dict."""
from zero.config.sections import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig  # noqa: F401
from zero.config.sections import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig  # noqa: F401
from zero.config.sections import ZeroOptimizationConfig as DeepSpeedZeroConfig  # noqa: F401
from zero.deepspeed._missing import missing


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.engine`."""
from zero.engine import Engine as DeepSpeedEngine  # noqa: F401 - for isinstance checks

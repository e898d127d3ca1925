"""`deepspeed.runtime.engine`."""
from zero.deepspeed._missing import missing
from zero.deepspeed.engine import DeepSpeedEngine  # noqa: F401 - for isinstance checks


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.accelerator.real_accelerator`."""
from zero.deepspeed._missing import missing
from zero.deepspeed.accelerator import get_accelerator  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

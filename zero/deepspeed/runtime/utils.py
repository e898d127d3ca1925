"""`deepspeed.runtime.utils`: the helpers scripts import from it."""
from zero.deepspeed._missing import missing
from zero.deepspeed.utils import see_memory_usage  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

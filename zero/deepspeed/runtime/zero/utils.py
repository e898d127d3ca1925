"""`deepspeed.runtime.zero.utils`."""
from zero.deepspeed._missing import missing
from zero.errors import ZeroRuntimeError as ZeRORuntimeException  # noqa: F401 - zero's runtime errors derive from it


def __getattr__(name: str):
    return missing(__name__, name)

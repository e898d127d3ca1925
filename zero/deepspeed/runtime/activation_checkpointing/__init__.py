"""`deepspeed.runtime.activation_checkpointing`: its `checkpointing` module is `deepspeed.checkpointing`."""
from zero.deepspeed import checkpointing  # noqa: F401
from zero.deepspeed._missing import missing


def __getattr__(name: str):
    return missing(__name__, name)

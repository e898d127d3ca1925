"""`deepspeed.ops`: the optimizers scripts import by name."""
from zero.deepspeed._missing import missing
from zero.deepspeed.ops import adam, op_builder  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.sequence_parallel`: ulysses_sp.py's tiled compute, on zero.sequence."""
from zero.deepspeed._missing import missing


def __getattr__(name: str):
    return missing(__name__, name)

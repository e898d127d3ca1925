"""`deepspeed.sequence`: Ulysses sequence parallelism's attention (layer.py, on zero.sequence)."""
from zero.deepspeed._missing import missing


def __getattr__(name: str):
    return missing(__name__, name)

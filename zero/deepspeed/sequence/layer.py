"""`deepspeed.sequence.layer`: `DistributedAttention` is zero.sequence's (DeepSpeed-Ulysses)."""
from zero.deepspeed._missing import missing
from zero.sequence.ulysses import DistributedAttention  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.checkpoint`: the helpers libraries use around `torch.save` (zero's checkpoints are in
zero.checkpoint; see docs/checkpoint.md)."""
from zero.deepspeed._missing import missing
from zero.deepspeed.checkpoint import utils  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

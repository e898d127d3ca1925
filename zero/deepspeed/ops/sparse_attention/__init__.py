"""`deepspeed.ops.sparse_attention`: zero's block-sparse attention (see docs/sparse_attention.md)."""
from zero.deepspeed._missing import missing
from zero.sparse_attention import *  # noqa: F401,F403
from zero.sparse_attention import __all__  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

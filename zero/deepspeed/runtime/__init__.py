"""`deepspeed.runtime`: the module paths scripts and libraries import from (see
docs/migrating-from-deepspeed.md)."""
from zero.deepspeed._missing import missing


def __getattr__(name: str):
    return missing(__name__, name)

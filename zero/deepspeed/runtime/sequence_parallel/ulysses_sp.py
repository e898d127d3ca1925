"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: `TiledMLP` and `TiledFusedLogitsLoss` are
zero.sequence's (zero/sequence/tiled.py); the HF integration (UlyssesSPAttentionHF,
UlyssesSPDataLoaderAdapter) and sequence_tiled_compute are not here yet."""
from zero.deepspeed._missing import missing
from zero.sequence.tiled import TiledFusedLogitsLoss, TiledMLP  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: `TiledMLP` and `TiledFusedLogitsLoss` are
zero.sequence's (zero/sequence/tiled.py), `UlyssesSPDataLoaderAdapter` too (zero/sequence/data.py);
UlyssesSPAttentionHF and sequence_tiled_compute are not here yet."""
from zero.deepspeed._missing import missing
from zero.sequence.data import UlyssesSPDataLoaderAdapter  # noqa: F401
from zero.sequence.tiled import TiledFusedLogitsLoss, TiledMLP  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

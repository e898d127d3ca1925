"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: `TiledMLP` and `TiledFusedLogitsLoss` are
zero.sequence's (zero/sequence/tiled.py), `UlyssesSPDataLoaderAdapter` (zero/sequence/data.py) and
`UlyssesSPAttentionHF` (zero/sequence/hf.py) too; sequence_tiled_compute is not here yet."""
from zero.deepspeed._missing import missing
from zero.sequence.data import UlyssesSPDataLoaderAdapter  # noqa: F401
from zero.sequence.hf import UlyssesSPAttentionHF  # noqa: F401
from zero.sequence.tiled import TiledFusedLogitsLoss, TiledMLP  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: `TiledMLP`, `TiledFusedLogitsLoss`,
`sequence_tiled_compute` and `SequenceTiledCompute` are zero.sequence's (zero/sequence/tiled.py),
`UlyssesSPDataLoaderAdapter` (zero/sequence/data.py) and `UlyssesSPAttentionHF` (zero/sequence/hf.py)
too."""
from zero.deepspeed._missing import missing
from zero.sequence.data import UlyssesSPDataLoaderAdapter  # noqa: F401
from zero.sequence.hf import UlyssesSPAttentionHF  # noqa: F401
from zero.sequence.tiled import (  # noqa: F401
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)


def __getattr__(name: str):
    return missing(__name__, name)

"""Sequence parallelism: each rank of a sequence-parallel group holds a slice of every sequence.

`DistributedAttention` (DeepSpeed-Ulysses) turns (sequence slice, all heads) into (whole sequence,
head slice) with one all-to-all before attention and back after it, so any attention function runs
unchanged on whole sequences for its share of the heads. See zero/sequence/ulysses.py. `TiledMLP`
and `TiledFusedLogitsLoss` compute an MLP and the logits + loss one sequence tile at a time, and
`sequence_tiled_compute` any function of sequence-shaped tensors (zero/sequence/tiled.py). For HF
models (zero/sequence/hf.py): `UlyssesSPAttentionHF`, `tile_mlps` and `tiled_causal_lm_loss`.
`sequence_parallel_group` is the one group registry's (zero/parallel/groups.py).
"""
from zero.parallel.groups import sequence_parallel_group
from zero.sequence.data import UlyssesSPDataLoaderAdapter, sequence_loss, shard_batch
from zero.sequence.hf import UlyssesSPAttentionHF, tile_mlps, tiled_causal_lm_loss
from zero.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from zero.sequence.ulysses import DistributedAttention, exchanged, sequence_all_to_all, ulysses_attention

__all__ = ["DistributedAttention", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "exchanged", "sequence_all_to_all", "sequence_loss", "sequence_parallel_group",
           "sequence_tiled_compute", "shard_batch", "tile_mlps", "tiled_causal_lm_loss", "ulysses_attention"]

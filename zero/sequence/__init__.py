"""Sequence parallelism: each rank of a sequence-parallel group holds a slice of every sequence.

`DistributedAttention` (DeepSpeed-Ulysses) turns (sequence slice, all heads) into (whole sequence,
head slice) with one all-to-all before attention and back after it, so any attention function runs
unchanged on whole sequences for its share of the heads. See zero/sequence/ulysses.py.
"""
from zero.sequence.ulysses import DistributedAttention, sequence_all_to_all

__all__ = ["DistributedAttention", "sequence_all_to_all"]

"""Shard arithmetic: which rank owns which slice of which bucket (stages 0-2, `layout.py`) and of
which parameter (stage 3 and zero.Init, `shards.py`)."""
from zero.partition.layout import Bucket, ShardLayout
from zero.partition.shards import ShardedParam, gather_param, shard_numel, take_shard

__all__ = ["Bucket", "ShardLayout", "ShardedParam", "gather_param", "shard_numel", "take_shard"]

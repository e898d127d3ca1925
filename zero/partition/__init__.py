"""Flat buffers and shard arithmetic: which rank owns which slice of which bucket."""
from zero.partition.layout import Bucket, ShardLayout

__all__ = ["Bucket", "ShardLayout"]

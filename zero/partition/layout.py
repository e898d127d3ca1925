"""Where every parameter lives in the flat buffers, and which slice of each bucket a rank owns.

[Note: bucket layout]
Trainable parameters are laid out back to back in one flat buffer, split into buckets. Buckets
never mix parameter groups (a group's hyperparameters apply to whole buckets), and within a group
parameters are laid out in reverse registration order, because backward produces gradients
roughly in that order and a bucket is reduced as soon as all its gradients are ready.

Each bucket is padded at its end to a multiple of `partitions * ALIGN` elements, so it splits
into `partitions` equal slices whose starts are SIMD-aligned; rank r owns slice r of every
bucket. Padding is never inside a tensor: parameters are whole and contiguous, and a parameter
may straddle two ranks' slices (the optimizer is elementwise, so that is harmless). Padding
elements are zero in every buffer and stay zero through Adam.

A rank's shard is the list of its slices, one per bucket; the fp32 master weights, gradient
shard and optimizer states are kept per bucket in the same shapes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALIGN = 16  # elements: slice starts land on 64-byte boundaries for fp32


@dataclass(frozen=True)
class Bucket:
    """One bucket of the flat buffer.

    Args:
        index: position among all buckets (also the order of their collectives).
        group: parameter group index.
        start: first element of the bucket in the flat buffer.
        numel: elements including end padding; divisible by `partitions`.
        params: indices (into the layout's parameter list) of the parameters it holds.
        partitions: number of equal slices (ranks sharing the bucket).
    """

    index: int
    group: int
    start: int
    numel: int
    params: tuple[int, ...]
    partitions: int

    @property
    def slice_numel(self) -> int:
        return self.numel // self.partitions

    def slice_range(self, rank: int) -> tuple[int, int]:
        """[begin, end) of rank's slice, in flat-buffer elements."""
        begin = self.start + rank * self.slice_numel
        return begin, begin + self.slice_numel


class ShardLayout:
    """Lay parameters out in buckets that split evenly over `partitions` ranks.

    Args:
        numels: element count of each parameter, in registration order.
        groups: parameter group index of each parameter.
        partitions: how many ranks share each bucket (1 = no sharding, as in stage 0).
        bucket_size: target elements per bucket; a larger parameter gets a bucket of its own.
    """

    def __init__(self, numels: Sequence[int], groups: Sequence[int], partitions: int, bucket_size: int):
        if len(numels) != len(groups):
            raise ValueError(f"{len(numels)} parameter sizes but {len(groups)} group indices")
        if partitions < 1 or bucket_size < 1:
            raise ValueError(f"partitions ({partitions}) and bucket_size ({bucket_size}) must be >= 1")
        self.partitions = partitions
        self.numels = list(numels)
        self.groups = list(groups)  # each parameter's group
        self.offsets = [0] * len(numels)  # flat-buffer offset of each parameter
        self.bucket_of = [0] * len(numels)
        self.buckets: list[Bucket] = []
        quantum = partitions * ALIGN
        start = 0
        for g in sorted(set(groups)):
            members = [i for i in reversed(range(len(numels))) if groups[i] == g]
            pending: list[int] = []
            fill = 0
            for i in members + [None]:  # None flushes the group's last bucket
                if i is not None and (not pending or fill + numels[i] <= bucket_size):
                    pending.append(i)
                    fill += numels[i]
                    continue
                if pending:
                    padded = -(-max(fill, 1) // quantum) * quantum
                    bucket = Bucket(len(self.buckets), g, start, padded, tuple(pending), partitions)
                    at = start
                    for j in pending:
                        self.offsets[j], self.bucket_of[j] = at, bucket.index
                        at += numels[j]
                    self.buckets.append(bucket)
                    start += padded
                pending, fill = ([i], numels[i]) if i is not None else ([], 0)
        self.numel = start

    @property
    def param_numel(self) -> int:
        """Elements of real parameters (Psi), without padding."""
        return sum(self.numels)

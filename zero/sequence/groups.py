"""The sequence-parallel groups: `sequence_parallel_size` consecutive ranks hold slices of the same
samples' sequences (ranks r with the same r // size form a group); r // size is the data-parallel
rank the data loader sees. ZeRO partitions over every rank (data x sequence), as in DeepSpeed."""
from __future__ import annotations

import torch.distributed as dist

_groups: dict[int, object] = {}  # size -> this rank's group (every rank builds every group, in order)


def sequence_parallel_group(size: int):
    """This rank's sequence-parallel group of `size` consecutive ranks (built once per size;
    collective the first time: every rank must call it). None when size is 1."""
    if size <= 1:
        return None
    if size not in _groups:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"sequence_parallel_size {size} does not divide the world of {world} ranks")
        for start in range(0, world, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                _groups[size] = group
    return _groups[size]


def data_parallel_rank_and_size(size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel world) of this rank when `size` ranks share each sample."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank // size, world // size

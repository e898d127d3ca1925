"""One set of parallel dimensions: how the world's ranks divide a run's work.

[Note: parallel dimensions]
Every rank has a coordinate in five dimensions, slowest to fastest:

    pp            pipeline stages (`pipeline.stages`)
    dp_replicate  data-parallel replicas that keep whole copies of the partitioned state (hybrid
                  sharding; 1 unless a run asks for it)
    dp_shard      data-parallel ranks ZeRO partitions over
    sp            sequence-parallel ranks: slices of the same samples (`sequence_parallel_size`)
    spatial       spatial-parallel ranks: slabs of the same samples' volumes
                  (`spatial_parallel_size`, zero/spatial/)
    tp            tensor slices (`tensor_parallel.size`)

so rank = (((((pp * R + r) * S + s) * Q + q) * V + v) * T + t) for sizes (P, R, S, Q, V, T): the
groups whose collectives run inside every layer (tensor slices, then a volume's slabs and their
halos) are the closest sets of ranks, then a sequence group, then the shard group (FSDP's "shard
within a node, replicate across nodes"), and a pipeline stage's ranks are contiguous. Expert
parallelism (`ep`) has its place in the record and is refused above 1 until it exists.

Named groups flatten several dimensions; each is the set of ranks that differ from this one only
in those dimensions:
    batch    dp_replicate x dp_shard: ranks that load different samples (the data loader's
             replicas; a sequence- or spatial-parallel group shares its samples)
    zero     dp_shard x sp x spatial: the ranks ZeRO partitions parameters, gradients and
             optimizer state over (ZeRO shards over data and sequence ranks alike, as DeepSpeed
             does, and over a volume's slabs the same way)
    replicate  dp_replicate: the ranks holding the same shard (hybrid sharding)
    dp       dp_replicate x dp_shard x sp x spatial: every rank whose gradient enters the sum (the
             divisor's world, and the loss's)
and each dimension on its own ("pp", "sp", "tp", ...).

The data-parallel size a loader or an accessor needs is read from here (`size("batch")`), never
recomputed from the world size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DIMS = ("pp", "dp_replicate", "dp_shard", "sp", "spatial", "tp")  # slowest to fastest
FLATTENED = {
    "batch": ("dp_replicate", "dp_shard"),
    "zero": ("dp_shard", "sp", "spatial"),
    "replicate": ("dp_replicate",),
    "dp": ("dp_replicate", "dp_shard", "sp", "spatial"),
    "loss": ("dp_replicate", "dp_shard", "sp", "spatial"),
}
_CONFIG_KEYS = {"pp": "pipeline.stages", "dp_replicate": "dp_replicate (hybrid sharding's replicas)", "dp_shard": "the data-parallel size",
                "sp": "sequence_parallel_size", "tp": "tensor_parallel.size", "ep": "expert parallelism",
                "spatial": "spatial_parallel_size"}


class ParallelDimsError(ValueError):
    """The dimensions do not fit the world (or ask for what zero does not do yet); names the keys."""


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the parallel dimensions of a world of `world_size` ranks; see [Note: parallel
    dimensions]. `dp_shard` may be left at -1: the ranks the others leave.

    Args:
        world_size: ranks in the run.
        pp, dp_replicate, dp_shard, sp, tp: the dimensions' sizes.
        ep: expert-parallel ranks (not implemented yet: 1).
        spatial: ranks a volume is split over (zero/spatial/).

    Raises:
        ParallelDimsError: a size below 1, a product that is not the world, or a dimension zero
            does not have yet; the message names the config key.
    """

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    spatial: int = 1

    def __post_init__(self):
        for name in ("world_size", "pp", "dp_replicate", "sp", "tp", "ep", "spatial"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelDimsError(f"{_CONFIG_KEYS.get(name, name)}: expected a whole number >= 1, got {value!r}")
        if self.ep != 1:
            raise ParallelDimsError(f"{_CONFIG_KEYS['ep']} (ep={self.ep}) is not implemented yet")
        rest = self.pp * self.dp_replicate * self.sp * self.spatial * self.tp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise ParallelDimsError(
                    f"the world of {self.world_size} ranks does not split into {self._describe(dp_shard=None)}: "
                    f"{self.world_size} is not a multiple of {rest}")
            object.__setattr__(self, "dp_shard", self.world_size // rest)
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ParallelDimsError(f"the data-parallel size must be a whole number >= 1, got {self.dp_shard!r}")
        if rest * self.dp_shard != self.world_size:
            raise ParallelDimsError(f"{self._describe()} = {rest * self.dp_shard} ranks, but the world has "
                                    f"{self.world_size}")

    def _describe(self, **override) -> str:
        sizes = {d: override.get(d, getattr(self, d)) for d in DIMS}
        return " x ".join(f"{_CONFIG_KEYS[d]} ({sizes[d] if sizes[d] is not None else '?'})" for d in DIMS
                          if sizes[d] != 1 or d == "dp_shard")

    @classmethod
    def from_config(cls, config, world_size: int) -> ParallelDims:
        """The dimensions a validated config asks for over `world_size` ranks."""
        pp, sp, spatial, tp = (config.pipeline.stages or 1, config.sequence_parallel_size,
                               config.spatial_parallel_size, config.tensor_parallel.size)
        shard = config.zero_optimization.mics_shard_size  # hybrid sharding: shard groups of this many ranks
        replicate = world_size // (pp * sp * spatial * tp) // shard if shard > 0 else 1
        return cls(world_size, pp=pp, dp_replicate=max(1, replicate), sp=sp, spatial=spatial, tp=tp)

    # -- sizes and coordinates

    def size(self, name: str) -> int:
        """The size of a dimension or a named group (see [Note: parallel dimensions])."""
        return math.prod(getattr(self, d) for d in FLATTENED.get(name, (name,)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    def coordinate(self, rank: int) -> dict[str, int]:
        """`rank`'s place in each dimension."""
        out = {}
        for d in reversed(DIMS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return {d: out[d] for d in DIMS}

    def rank_of(self, **coordinate: int) -> int:
        """The rank at a coordinate (dimensions not given: 0)."""
        rank = 0
        for d in DIMS:
            rank = rank * getattr(self, d) + coordinate.get(d, 0)
        return rank

    def ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group `name`: those whose coordinates differ from `rank`'s only in
        the group's dimensions, in rank order (a group's rank is its place in this list)."""
        dims = FLATTENED.get(name, (name,))
        if any(d not in DIMS for d in dims):
            raise KeyError(f"no parallel dimension or group {name!r}; expected one of {list(DIMS) + list(FLATTENED)}")
        fixed = self.coordinate(rank)
        out = [self.rank_of(**{**fixed, **dict(zip(dims, free))})
               for free in _product([range(getattr(self, d)) for d in dims])]
        return sorted(out)

    def index_in(self, name: str, rank: int) -> int:
        """`rank`'s place in its group `name`."""
        return self.ranks(name, rank).index(rank)


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [t + (i,) for t in out for i in r]
    return out

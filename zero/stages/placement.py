"""Placements: how one param group's elements lie over the data-parallel ranks, and the one reducer
and gatherer that follow from it.

[Note: placements]
Each param group has a placement, derived from the run's parallel dimensions (see [Note: parallel
dimensions] in zero/parallel/dims.py):
- `Sharded(shard, partitions, replicate)`: the elements are divided into `partitions` equal
  slices over the `shard` group (1: every rank holds all of them, as stage 0 does); with a
  `replicate` group (hybrid sharding), each slice is held by every rank of that group. A
  gradient is reduce-scattered over the shard group, then its slice all-reduced over the
  replicate group; updated slices are all-gathered over the shard group.
- `Owned(shard, partitions, shapes, replicate)`: each parameter whole on one owner rank (Muon's
  matrices, zero/optim/muon.py): owners chosen by balancing their Newton-Schulz work; a gradient
  is reduced to its owner, an updated value broadcast from it. The same bytes as the slices'.
  Owners depend only on the shapes, so with a `replicate` group the rank at the same place of
  every replica owns the same parameters, and the owners sum their gradients over it.
Both storages take their ranges from the placement: stages 0-2 cut each bucket into the ranges
`ranges` gives (zero/stages/buckets.py), stage 3 lays a unit's parameters out in `partitions`
rows and keeps Owned parameters apart (zero/stages/owned.py). Both reduce with `reduce_scatter`
/ `reduce_to` and gather with `all_gather` / `broadcast_from`: the one reducer and gatherer of
every layout. The step's divisor and the gradient norm read the placement's sizes: gradients
are summed over `summed` ranks, and each element's reduced gradient is held by `partitions`
ranks' shares once per replica.

Sums are SUM collectives; callers divide (see [Note: one divisor] in zero/optim/step.py).

[Note: the replicas' sum, once]
With replicas, a reduced gradient shard holds its replica's sum until the replicas sum it, once
per optimizer step (`defers_replicas`). That sum runs at the step, or earlier when a gradient
accessor (zero/accessors.py) needs the final values; either way once, and only when a backward
reduced something since the gradients were zeroed (an accessor after the step finds nothing owed):
the storage remembers that this step's shards were summed until the gradients are zeroed, and a
backward that adds to them after that is refused (its gradients would be summed over the replicas
twice or not at all).
"""
from __future__ import annotations

import abc

import torch

from zero.parallel.comm import Comm, Done, Then
from zero.partition.layout import Bucket, ShardLayout


class ReplicasSummedError(RuntimeError):
    """A backward added gradients after this step's were summed over the replicas (see [Note: the
    replicas' sum, once])."""

    def __init__(self, param: str):
        super().__init__(
            f"a backward reduced gradients (the bucket or unit of parameter {param!r}) after a gradient accessor "
            f"(safe_get_full_grad and its kin) had summed this step's gradients over the replicas (hybrid sharding, "
            f"zero_optimization.mics_shard_size): the sum would miss them. Call the gradient accessors after the last "
            f"backward of the accumulation, before step().")


class Placement(abc.ABC):
    """Where a param group's elements are, over the data-parallel ranks; see [Note: placements].

    Args:
        shard: the group the elements are divided over.
        partitions: how many parts they are divided into: the shard group's size, or 1 (every
            rank holds every element, as at stage 0).
        replicate: the group holding copies of this rank's part (hybrid sharding), or None.
    """

    def __init__(self, shard: Comm, partitions: int, replicate: Comm | None = None):
        if partitions not in (1, shard.world_size):
            raise ValueError(f"a placement divides elements over its shard group of {shard.world_size} ranks or not "
                             f"at all, not into {partitions} parts")
        self.comm, self.partitions, self.replicate = shard, partitions, replicate
        self.rank = shard.rank if partitions > 1 else 0  # this rank's part
        self.two_hop = None  # ZeRO++ qgZ: reduce-scatters as two quantized all-to-alls (zero/zeropp/reduce.py)
        self.hierarchical = None  # MiCS: all-gathers in two hops, across nodes then inside them (the same file)
        self.temporaries = None  # a BufferGauge of the quantized gathers' messages (stage 3 sets it)

    @property
    def summed(self) -> int:
        """Ranks whose gradients a reduced gradient sums (the divisor's world)."""
        return self.comm.world_size * (self.replicate.world_size if self.replicate is not None else 1)

    @property
    def writes(self) -> bool:
        """This rank writes the checkpoint pieces it holds (one rank per piece: with one part, rank
        0; with replicas, the first replica)."""
        first = self.replicate is None or self.replicate.rank == 0
        return first and (self.partitions > 1 or self.comm.rank == 0)

    # -- the reducer and the gatherer (buckets' and units')

    @property
    def defers_replicas(self) -> bool:
        """With replicas, gradients are summed over them once per optimizer step, not per
        micro-step (`reduce_replicas`, at the accumulation boundary): the bytes between replicas,
        usually between nodes, no longer grow with gradient accumulation."""
        return self.replicate is not None

    def reduce_scatter(self, mine: torch.Tensor, buf: torch.Tensor, async_op: bool = False, replicas: bool = True):
        """SUM `buf` (this rank's gradients, `partitions` equal parts in rank order) over the shard
        group into this rank's part `mine` (a view of `buf` or apart), then (`replicas`) over the
        replicate group."""
        chained = replicas and self.replicate is not None
        if self.two_hop is not None:  # quantized, inside the node then across (see [Note: qgZ])
            self.two_hop.reduce_scatter(mine, buf)
            work = Done()
        else:
            work = self.comm.reduce_scatter(mine, buf, async_op=async_op or chained)
        return self._then_replicas(work, mine, async_op) if chained else work

    def all_reduce(self, buf: torch.Tensor, async_op: bool = False, replicas: bool = True):
        """SUM `buf` whole over the shard group and (`replicas`) the replicate group."""
        chained = replicas and self.replicate is not None
        work = self.comm.all_reduce(buf, "sum", async_op=async_op or chained)
        return self._then_replicas(work, buf, async_op) if chained else work

    def reduce_replicas(self, grads: list[torch.Tensor], bucket_elements: int = 1 << 26) -> None:
        """SUM this rank's gradient shards over the replicate group (once per optimizer step; see
        `defers_replicas`): few large all-reduces over the slow link, not one per shard (shards of
        one dtype and device packed into buckets of up to `bucket_elements`; a larger shard alone)."""
        if self.replicate is None:
            return
        bucket: list[torch.Tensor] = []

        def flush() -> None:
            if len(bucket) == 1:
                self.replicate.all_reduce(bucket[0], "sum", label="all_reduce (replicas)")
            elif bucket:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                self.replicate.all_reduce(flat, "sum", label="all_reduce (replicas)")
                torch._foreach_copy_(bucket, [p.view_as(g) for p, g in zip(flat.split([g.numel() for g in bucket]),
                                                                             bucket)])
            bucket.clear()

        for g in grads:
            if g.numel() == 0:
                continue
            if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                           or sum(b.numel() for b in bucket) + g.numel() > bucket_elements):
                flush()
            bucket.append(g)
        flush()

    def _then_replicas(self, work, part: torch.Tensor, async_op: bool):
        if self.replicate is None:
            return work
        chained = Then(work, lambda: self.replicate.all_reduce(part, "sum", label="all_reduce (replicas)"))
        return chained if async_op else chained.wait()

    def broadcast_initial(self, t: torch.Tensor) -> None:
        """Every rank of the shard and replicate groups takes the first rank's `t` (initial values)."""
        self.comm.broadcast(t, src=0)
        if self.replicate is not None:
            self.replicate.broadcast(t, src=0)

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor, async_op: bool = False, label: str = "all_gather",
                   quantized: bool = False):
        """Every rank's part `mine` into `full` (rank order) over the shard group; `quantized`: as
        int8 weight blocks (ZeRO++ qwZ; see [Note: int8 weight blocks] in zero/zeropp/blocks.py)."""
        if quantized and self.comm.world_size > 1:
            from zero.zeropp.gather import all_gather_quantized

            return all_gather_quantized(self.comm, full, mine, async_op=async_op, gauge=self.temporaries)
        if self.hierarchical is not None:  # across nodes, then inside them (see [Note: the two-hop gather])
            return self.hierarchical.all_gather(full, mine, async_op=async_op)
        return self.comm.all_gather(full, mine, async_op=async_op, label=label)

    # -- buckets (stages 0-2)

    @abc.abstractmethod
    def ranges(self, bucket: Bucket, layout: ShardLayout) -> list[tuple[int, int, int | None]]:
        """This rank's ranges of `bucket` whose reduced gradient, master and state it keeps:
        (begin, end) in flat-buffer elements, and the parameter a range is whole of (or None)."""

    @abc.abstractmethod
    def reduce_bucket(self, bucket: Bucket, buf: torch.Tensor, layout: ShardLayout, async_op: bool,
                      reduce_scatter: bool = True, replicas: bool = True):
        """Sum `buf` (the whole bucket's gradients) so that this rank's ranges hold their sums
        (over the replicas too unless `replicas` is False); `reduce_scatter=False` all-reduces the
        whole bucket instead (DeepSpeed's flag). Returns the collective's handle (None when done)."""

    @abc.abstractmethod
    def gather_bucket(self, flat: torch.Tensor, bucket: Bucket, layout: ShardLayout) -> list:
        """Start bringing every rank's updated ranges of `bucket` into `flat` (the model's flat
        buffer); the handles to wait for."""

    def matrix(self, i: int) -> tuple[int, int] | None:
        """The matrix shape parameter i is updated as (Owned), or None."""
        return None


class Sharded(Placement):
    """Equal slices of each bucket (see [Note: placements])."""

    def ranges(self, bucket: Bucket, layout: ShardLayout) -> list[tuple[int, int, int | None]]:
        lo, hi = bucket.slice_range(self.rank) if self.partitions > 1 else (bucket.start, bucket.start + bucket.numel)
        return [(lo, hi, None)]

    def reduce_bucket(self, bucket: Bucket, buf: torch.Tensor, layout: ShardLayout, async_op: bool,
                      reduce_scatter: bool = True, replicas: bool = True):
        if self.partitions == 1 or not reduce_scatter:
            return self.all_reduce(buf, async_op, replicas)
        lo, hi = bucket.slice_range(self.rank)
        return self.reduce_scatter(buf[lo - bucket.start : hi - bucket.start], buf, async_op, replicas)

    def gather_bucket(self, flat: torch.Tensor, bucket: Bucket, layout: ShardLayout) -> list:
        if self.partitions == 1:
            return []
        lo, hi = bucket.slice_range(self.rank)
        return [self.all_gather(flat[bucket.start : bucket.start + bucket.numel], flat[lo:hi], async_op=True)]


class Owned(Placement):
    """Each parameter whole on one owner (see [Note: placements]); with one partition every rank
    owns every one of them.

    Args:
        shard, partitions: as Placement.
        shapes: each owned parameter's index (its place among the storage's parameters) and
            matrix shape.
    """

    def __init__(self, shard: Comm, partitions: int, shapes: dict, replicate: Comm | None = None):
        super().__init__(shard, partitions, replicate)
        self.shapes = dict(shapes)
        whole = sorted(self.shapes, key=_order)
        owners = assign_owners([self.shapes[i] for i in whole], partitions) if partitions > 1 else [0] * len(whole)
        self.owners = dict(zip(whole, owners))

    def owner(self, i) -> int:
        return self.owners[i]

    def owns(self, i) -> bool:
        return i in self.owners and self.owners[i] == self.rank

    def matrix(self, i) -> tuple[int, int] | None:
        return self.shapes.get(i)

    def reduce_to(self, buf: torch.Tensor, i, async_op: bool = False):
        """SUM `buf` (parameter i's gradient) into its owner."""
        return self.comm.reduce(buf, self.owners[i], async_op=async_op)

    def broadcast_from(self, buf: torch.Tensor, i, async_op: bool = False):
        """Parameter i's value from its owner into `buf` on every rank."""
        return self.comm.broadcast(buf, self.owners[i], async_op=async_op, label="broadcast_params")

    def ranges(self, bucket: Bucket, layout: ShardLayout) -> list[tuple[int, int, int | None]]:
        return [(layout.offsets[i], layout.offsets[i] + layout.numels[i], i) for i in bucket.params if self.owns(i)]

    def reduce_bucket(self, bucket: Bucket, buf: torch.Tensor, layout: ShardLayout, async_op: bool,
                      reduce_scatter: bool = True, replicas: bool = True):
        if self.partitions == 1 or not reduce_scatter:
            return self.all_reduce(buf, async_op, replicas)
        pieces = {i: buf[layout.offsets[i] - bucket.start : layout.offsets[i] - bucket.start + layout.numels[i]]
                  for i in bucket.params}
        work = Each([self.reduce_to(piece, i, async_op=True) for i, piece in pieces.items()])
        if replicas and self.replicate is not None:  # the owners of each replica sum what they own
            mine = [piece for i, piece in pieces.items() if self.owns(i)]
            work = Then(work, lambda: self.reduce_replicas(mine))
        return work if async_op else work.wait()

    def gather_bucket(self, flat: torch.Tensor, bucket: Bucket, layout: ShardLayout) -> list:
        if self.partitions == 1:
            return []
        return [self.broadcast_from(flat[layout.offsets[i] : layout.offsets[i] + layout.numels[i]], i, async_op=True)
                for i in bucket.params]


def _order(key):
    """Owners are assigned in the order of the parameters' keys (indices, or objects by position)."""
    return key if isinstance(key, int) else 0


def ns_cost(shape: tuple[int, ...]) -> int:
    """The Newton-Schulz work of one matrix, up to a constant: each iteration multiplies the
    (short x long) matrix by its Gram matrix, short^2 x long."""
    short, long_ = sorted(shape[:2]) if len(shape) >= 2 else (1, shape[0] if shape else 1)
    return short * short * long_


def assign_owners(shapes: list[tuple[int, ...]], world_size: int) -> list[int]:
    """The rank that updates each Muon matrix, whole: largest first, each to the rank with the least
    work so far (ties to the lowest rank), so no rank does more than the others by more than one
    matrix's work. The same on every rank (it depends only on the shapes)."""
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += ns_cost(shapes[i])
    return owners


class Each:
    """The handles of several collectives as one: `wait` waits for them all."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def done(self, async_op: bool):
        """This handle when asynchronous; otherwise wait now and return None."""
        if async_op:
            return self
        self.wait()
        return None

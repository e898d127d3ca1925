"""Slabs of a volume and the one exchange every split layer is built on.

[Note: slabs and halos]
A group of P ranks shares each sample; rank r holds the slab [start_r, stop_r) of one spatial
dimension of every activation, the canonical split of that dimension's global length L
(`Split`: the first L % P ranks one plane more, as torch.tensor_split). A layer whose output at
plane o reads the input planes of a window around o (a convolution, a pool, an interpolation)
computes the output slab of the canonical split of *its output's* length, so every tensor is
always split the same way whatever its length, and a skip connection meets its partner slab for
slab. For that output slab it needs an input range [lo, hi) that reaches past its own slab: the
halo. `fetch` returns exactly that range on every rank, in one all-to-all over the group (each
rank sends the planes of its slab that others need; most blocks are empty), with zeros where the
range leaves the volume (a convolution's zero padding). Its backward is the exact adjoint: the
gradient of every fetched plane goes back to the rank that owns it and is added there.

Every rank knows every rank's slab (the local lengths are all-gathered with the exchange's
plan, `Split.of`, together with the layer each rank is in, so that ranks running different
layers raise there instead of exchanging mismatched planes), and each layer computes every rank's range from its own hyperparameters, so
the plan is the same everywhere and the exchange needs no negotiation. The exchange goes through
zero's `Comm` (counted as "spatial_halo", bounded by the collective timeout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero.parallel.comm import Comm


@dataclass(frozen=True)
class Split:
    """The canonical split of a dimension of `length` planes over `parts` ranks."""

    length: int
    parts: int

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rank `rank`'s planes [start, stop)."""
        base, extra = divmod(self.length, self.parts)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def sizes(self) -> list[int]:
        return [b - a for a, b in map(self.bounds, range(self.parts))]

    @staticmethod
    def of(local: int, comm: Comm, site: int = -1, sites: tuple[str, ...] = ()) -> Split:
        """The split a slab of `local` planes on this rank belongs to (all ranks call it).

        `site` numbers the layer calling (its place among the converted modules, `sites` their
        names; -1: a zero.spatial function): it is gathered with the lengths, so ranks that run
        different layers (rank-divergent control flow) raise here, naming them, before any
        exchange whose sizes would not match."""
        gathered = torch.zeros(2 * comm.world_size, dtype=torch.int64)
        comm.all_gather(gathered, torch.tensor([local, site], dtype=torch.int64), label="spatial_sizes")
        sizes, at = gathered[0::2], gathered[1::2].tolist()
        if len(set(at)) > 1:
            def name(i: int) -> str:
                return sites[i] if 0 <= i < len(sites) else "a zero.spatial function (volume_mean, gather_volume, ...)"
            where = "; ".join(f"rank {r} in {name(i)}" for r, i in enumerate(at))
            raise SpatialDivergence(f"spatial parallelism: the ranks of the group run different layers ({where}): every "
                                    f"rank of a spatial group must run the same layers in the same order on its slab "
                                    f"(control flow that depends on a rank's own data diverges)")
        split = Split(int(sizes.sum()), comm.world_size)
        if sizes.tolist() != split.sizes():
            raise RuntimeError(f"spatial parallelism: the ranks' slabs {sizes.tolist()} are not the canonical split "
                               f"{split.sizes()} of {split.length} planes (shard inputs with zero.spatial.shard_volume)")
        return split


class SpatialDivergence(RuntimeError):
    """The ranks of a spatial group reached different layers; the message names them."""


def _blocks(split: Split, ranges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """blocks[q][r]: the global planes rank q sends to rank r (empty where none, and q == r)."""
    out = []
    for q in range(split.parts):
        qa, qb = split.bounds(q)
        row = []
        for r, (lo, hi) in enumerate(ranges):
            a, b = max(qa, lo), min(qb, hi)
            row.append((a, b) if q != r and a < b else (0, 0))
        out.append(row)
    return out


def _exchange(x: torch.Tensor, dim: int, split: Split, ranges: list[tuple[int, int]], comm: Comm,
              blocks: list[list[tuple[int, int]]]) -> torch.Tensor:
    """This rank's range [lo, hi) of `x` (its slab along `dim`), zeros outside the volume."""
    rank, (lo, hi) = comm.rank, ranges[comm.rank]
    start, stop = split.bounds(rank)
    planes = x.movedim(dim, 0)
    plane = planes.shape[1:].numel()
    send = [planes[a - start:b - start] for a, b in blocks[rank]]
    sent = torch.cat([s.reshape(-1) for s in send]) if send else planes.new_empty(0)
    counts_in = [(b - a) * plane for a, b in (blocks[q][rank] for q in range(split.parts))]
    got = planes.new_empty(sum(counts_in))
    comm.all_to_all(got, sent.contiguous(), label="spatial_halo", output_splits=counts_in,
                    input_splits=[(b - a) * plane for a, b in blocks[rank]])
    out = planes.new_zeros((hi - lo, *planes.shape[1:]))
    a, b = max(lo, start), min(hi, stop)
    if a < b:
        out[a - lo:b - lo] = planes[a - start:b - start]
    offset = 0
    for q in range(split.parts):
        a, b = blocks[q][rank]
        n = (b - a) * plane
        if n:
            out[a - lo:b - lo] = got[offset:offset + n].view(b - a, *planes.shape[1:])
        offset += n
    return out.movedim(0, dim)


def _return(g: torch.Tensor, dim: int, split: Split, ranges: list[tuple[int, int]], comm: Comm,
            blocks: list[list[tuple[int, int]]]) -> torch.Tensor:
    """The adjoint of `_exchange`: the gradient of this rank's slab, each fetched plane's gradient
    sent back to its owner and added there."""
    rank, (lo, hi) = comm.rank, ranges[comm.rank]
    start, stop = split.bounds(rank)
    grads = g.movedim(dim, 0)
    plane = grads.shape[1:].numel()
    back = [grads[a - lo:b - lo] for a, b in (blocks[q][rank] for q in range(split.parts))]
    sent = torch.cat([s.reshape(-1) for s in back]) if back else grads.new_empty(0)
    counts_in = [(b - a) * plane for a, b in blocks[rank]]
    got = grads.new_empty(sum(counts_in))
    comm.all_to_all(got, sent.contiguous(), label="spatial_halo", output_splits=counts_in,
                    input_splits=[(b - a) * plane for a, b in (blocks[q][rank] for q in range(split.parts))])
    out = grads.new_zeros((stop - start, *grads.shape[1:]))
    a, b = max(lo, start), min(hi, stop)
    if a < b:
        out[a - start:b - start] += grads[a - lo:b - lo]
    offset = 0
    for r in range(split.parts):
        a, b = blocks[rank][r]
        n = (b - a) * plane
        if n:
            out[a - start:b - start] += got[offset:offset + n].view(b - a, *grads.shape[1:])
        offset += n
    return out.movedim(0, dim)


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, split, ranges, comm, blocks):
        ctx.args = dim, split, ranges, comm, blocks
        return _exchange(x, dim, split, ranges, comm, blocks)

    @staticmethod
    def backward(ctx, g):
        return _return(g.contiguous(), *ctx.args), None, None, None, None, None


def fetch(x: torch.Tensor, dim: int, split: Split, ranges: list[tuple[int, int]], comm: Comm) -> torch.Tensor:
    """Rank r's global planes `ranges[r]` of the volume whose slabs the ranks hold in `x` (split
    `split` along `dim`); zeros outside [0, split.length). Differentiable: see [Note: slabs and halos].

    Args:
        x: this rank's slab.
        dim: the split dimension of `x`.
        split: the canonical split of the volume's `dim`.
        ranges: every rank's [lo, hi), the same list on every rank.
        comm: the spatial group.
    """
    blocks = _blocks(split, ranges)
    if not any(a < b for row in blocks for a, b in row):
        # nothing crosses a cut (a 1^3 convolution, a pool whose windows end at the slab
        # boundaries): every rank computes the same blocks, so all skip the exchange together
        lo, hi = ranges[comm.rank]
        start, stop = split.bounds(comm.rank)
        return torch.nn.functional.pad(x.movedim(dim, -1), (start - lo, hi - stop)).movedim(-1, dim)
    return _Fetch.apply(x, dim, split, ranges, comm, blocks)


class _Sum(torch.autograd.Function):
    """The sum over the group on every rank; its adjoint is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        y = x.clone()
        comm.all_reduce(y, label="spatial_stats")
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        ctx.comm.all_reduce(g, label="spatial_stats")
        return g, None


def group_sum(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """`x` summed over the group, on every rank; differentiable (the adjoint sums the gradients)."""
    return _Sum.apply(x, comm)

"""The compressed gradient exchange of 1-bit Adam, in place of a bucket's reduce-scatter/all-reduce.

[Note: compressed exchange]
A bucket of N * S elements (padded if needed) is cut into N chunks; rank r is the "server" of
chunk r, which at stages 1 and 2 is exactly the slice whose optimizer state it owns.
1. Every rank compresses each chunk of its local gradient with its worker error buffer (a full
   bucket of fp32 per rank; see [Note: 1-bit compression]) and sends chunk c to rank c: one
   all-to-all of N * S bits and one of N scales.
2. Rank r takes the mean of the N compressed copies of its chunk it received.
   - Stages 1 and 2: that mean (times N, the sum the optimizer expects, see [Note: one divisor])
     is its gradient shard; the updated parameters are all-gathered uncompressed afterwards, as
     without compression.
   - Stage 0: every rank needs every chunk, so the server compresses the mean again with its
     server error buffer (S fp32) and all ranks all-gather the N compressed chunks: another N * S
     bits.
Per element that is 1 bit sent at stages 1 and 2 and 2 bits at stage 0, plus 32 bits per block of
1024 (one fp32 scale; see [Note: 1-bit compression]), against 16 bits of an fp16 reduce-scatter
(stage 1/2) or 2 x 16 of a ring all-reduce (stage 0). The error buffers are what make this
converge: what a message did not carry is added to the next one, on both sides.
"""
from __future__ import annotations

import torch

from zero.onebit.compress import pack, packed_bytes, scale_count, unpack_mean
from zero.parallel.comm import Comm


class CompressedExchange:
    """Error buffers and the compressed reduction of each bucket (see [Note: compressed exchange]).

    Args:
        comm: the data-parallel group.
        bucket_numels: elements of each bucket.
        full_result: every rank needs the whole reduced bucket (stage 0), not only its chunk.
        device: where the gradients are.
    """

    def __init__(self, comm: Comm, bucket_numels: list[int], full_result: bool, device: torch.device):
        self.comm, self.full_result = comm, full_result
        n = comm.world_size
        self.chunk = [-(-numel // n) for numel in bucket_numels]  # S per bucket
        self.worker_error = [torch.zeros(n * s, dtype=torch.float32, device=device) for s in self.chunk]
        self.server_error = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.chunk] \
            if full_result else []

    def reset(self) -> None:
        """Forget the carried errors (after a skipped step they may hold inf or NaN)."""
        for t in (*self.worker_error, *self.server_error):
            t.zero_()

    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's error buffers by name (for checkpoints)."""
        out = {f"worker_error.{b}": t for b, t in enumerate(self.worker_error)}
        out.update({f"server_error.{b}": t for b, t in enumerate(self.server_error)})
        return out

    @torch.no_grad()
    def reduce(self, b: int, buf: torch.Tensor, own: tuple[int, int]) -> None:
        """Replace `buf` (bucket b's local gradient, 1-D) by the compressed sum over ranks: in
        `buf[own[0]:own[1]]` (this rank's chunk) or, with `full_result`, everywhere."""
        n, s = self.comm.world_size, self.chunk[b]
        nb, ns = packed_bytes(s), scale_count(s)
        x = buf
        if buf.numel() != n * s:  # stage 0's buckets are not padded to N chunks
            x = torch.zeros(n * s, dtype=buf.dtype, device=buf.device)
            x[: buf.numel()] = buf
        send = torch.empty(n, nb, dtype=torch.uint8, device=buf.device)
        scales = torch.empty(n, ns, dtype=torch.float32, device=buf.device)
        err = self.worker_error[b]
        for c in range(n):
            _, scales[c] = pack(x[c * s : (c + 1) * s], err[c * s : (c + 1) * s], out=send[c])
        recv, recv_scales = torch.empty_like(send), torch.empty_like(scales)
        self.comm.all_to_all(recv, send, "onebit_bits")
        self.comm.all_to_all(recv_scales, scales, "onebit_scales")
        mean = unpack_mean(recv, recv_scales, s)
        if not self.full_result:
            lo, hi = own
            buf[lo:hi].copy_(mean[: hi - lo] * n)
            return
        bits, scale = pack(mean, self.server_error[b])
        all_bits = torch.empty(n * nb, dtype=torch.uint8, device=buf.device)
        all_scales = torch.empty(n * ns, dtype=torch.float32, device=buf.device)
        self.comm.all_gather(all_bits, bits, label="onebit_bits_gather")
        self.comm.all_gather(all_scales, scale, label="onebit_scales_gather")
        all_bits, all_scales = all_bits.view(n, nb), all_scales.view(n, ns)
        full = torch.cat([unpack_mean(all_bits[r : r + 1], all_scales[r : r + 1], s) for r in range(n)])
        buf.copy_(full[: buf.numel()] * n)


@torch.no_grad()
def gather_changes(comm: Comm, bucket: torch.Tensor, before: torch.Tensor, rank: int) -> None:
    """[Note: compressed parameter gather]
    At stages 1 and 2 each rank updates only its own slice of every bucket, and the ranks then
    all-gather the updated 16-bit slices: 16 bits per element, which after the freeze is most of
    what 1-bit Adam sends. With `compress_param_gather` the owner of a slice sends instead the
    change from the values every rank holds for it (`before`, the same bits on every rank) to its
    new 16-bit values, compressed like a gradient ([Note: 1-bit compression]), and every rank,
    the owner too, adds the decompressed change to `before` in the same arithmetic, so all ranks
    keep the same bits.

    There is no error buffer: what a message did not carry stays in the difference between the
    owner's new values and what the ranks hold, and the next step's change includes it. The
    model's parameters therefore trail the optimizer's master by at most a few steps' worth of
    compression error, which the master never sees (its update is exact 1-bit Adam). Costs: at
    fp32 without offload the master can no longer be the parameters themselves, so each rank
    keeps an fp32 copy of its own slices (4 bytes per owned element); and during the step a copy
    of the owned slices as they were (one 16-bit or fp32 value per owned element).

    `bucket` is the whole bucket in the flat parameter buffer (N equal slices, this rank's
    already holding its new values); `before` is this rank's slice as it was before the step.
    """
    n = comm.world_size
    s = bucket.numel() // n
    mine = bucket[rank * s : (rank + 1) * s]
    change = mine.float() - before.float()
    bits, scales = pack(change, torch.zeros_like(change))
    nb, ns = bits.numel(), scales.numel()
    all_bits = torch.empty(n * nb, dtype=torch.uint8, device=bucket.device)
    all_scales = torch.empty(n * ns, dtype=torch.float32, device=bucket.device)
    comm.all_gather(all_bits, bits, label="onebit_param_bits")
    comm.all_gather(all_scales, scales, label="onebit_param_scales")
    all_bits, all_scales = all_bits.view(n, nb), all_scales.view(n, ns)
    for r in range(n):
        chunk = bucket[r * s : (r + 1) * s]
        base = before if r == rank else chunk
        chunk.copy_(base.float() + unpack_mean(all_bits[r : r + 1], all_scales[r : r + 1], s))

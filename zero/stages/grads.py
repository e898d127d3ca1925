"""From autograd to this rank's gradient shard: hooks, buckets and their reduction (stages 0-2).

[Note: gradient path]
A post-accumulate-grad hook on every trainable parameter takes its gradient as soon as autograd
has it, moves it into a bucket buffer and frees `param.grad`. What happens next depends on the stage:

- Stages 0 and 1 accumulate into one flat gradient buffer the size of the model and communicate
  only at the accumulation boundary (`reduce_at_boundary`, called by the optimizer's step): each
  bucket is all-reduced (stage 0, every rank keeps the whole sum) or reduce-scattered in place
  (stage 1, each rank receives the sum of its own slice, which is then its gradient shard).
- Stage 2 keeps no full gradient. Each bucket gets a staging buffer on its first gradient; when
  all of the bucket's gradients have arrived it is reduce-scattered at once (asynchronously with
  `overlap_comm`), the rank's slice of the sum is added to its gradient shard, and the staging
  buffer goes back to a small pool. So gradient memory is the shard plus the buckets in flight.
  Stage 2 communicates on every micro-step, accumulation or not (as DeepSpeed does).

Buckets are launched strictly in index order, so every rank issues the same collectives in the
same order even if gradients arrive in a different order on different ranks. A callback queued
on the autograd engine runs at the end of each backward and launches whatever is left: buckets
with parameters that got no gradient this step (unused parameters, treated as zero) and any
gradient that arrived after its bucket was sent (a parameter reached twice, as with reentrant
activation checkpointing: reduction is linear, so sending the late part separately is exact).

Sums are not divided by the world size here; the optimizer folds that divisor, the loss scale
and the clipping factor into the one `grad_scale` its Adam kernel applies (see [Note: one divisor]
in zero/stages/optimizer.py).

Accumulation dtype: fp32 whenever more than one micro-batch is accumulated or training is fp32;
with one micro-batch per step and 16-bit training the shard keeps the 16-bit reduced values (the
Adam kernels read 16-bit gradients directly), which is what keeps model-state memory at the ZeRO
paper's figures.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.profiler import record_function

from zero.comm import Comm
from zero.partition.layout import ShardLayout


class GradReducer:
    """Collects gradients of `params` into this rank's gradient shard, one tensor per bucket.

    Args:
        params: trainable parameters, in the order the layout was built from.
        layout: where each parameter lives and which slice of each bucket this rank owns.
        stage: 0, 1 or 2.
        comm: the data-parallel group's collectives.
        comm_dtype: dtype gradients are reduced in.
        accumulate_fp32: keep the gradient shard (stage 2) or buffer (stages 0/1) in fp32.
        overlap_comm: stage 2 only: reduce asynchronously while backward goes on.
        reduce_scatter: False makes stages 1 and 2 all-reduce whole buckets and keep their slice
            (DeepSpeed's `reduce_scatter: false`; twice the traffic, same numbers).
        predivide: divide gradients by this before the reduction (DeepSpeed's
            `gradient_predivide_factor`, or the world size with `prescale_gradients`).
        on_final: called with a bucket's gradient shard after each reduction into it (the
            optimizer starts an offload copy when that is the step's last).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: ShardLayout,
        stage: int,
        comm: Comm,
        comm_dtype: torch.dtype,
        accumulate_fp32: bool,
        overlap_comm: bool = False,
        reduce_scatter: bool = True,
        predivide: float = 1.0,
        on_final=None,
    ):
        self.params = list(params)
        self.layout = layout
        self.stage = stage
        self.comm = comm
        self.comm_dtype = comm_dtype
        self.overlap = overlap_comm and stage == 2
        self.use_reduce_scatter = reduce_scatter
        self.predivide = predivide
        self.on_final = on_final  # called with a gradient shard once it is final for the step
        self.rank = comm.rank if layout.partitions > 1 else 0
        device = params[0].device if params else torch.device("cpu")
        grad_dtype = torch.float32 if accumulate_fp32 else comm_dtype
        self.index = {p: i for i, p in enumerate(self.params)}

        if stage in (0, 1):
            self.flat_grad = torch.zeros(layout.numel, dtype=grad_dtype, device=device)
            self.shards = [self.flat_grad[slice(*self._own(b))] for b in layout.buckets]
        else:
            self.flat_grad = None
            self.shards = [torch.zeros(b.slice_numel, dtype=grad_dtype, device=device) for b in layout.buckets]
            self._staging: dict[int, torch.Tensor] = {}
            self._pool: list[torch.Tensor] = []
            self._inflight: list[tuple[int, torch.Tensor, object]] = []
            self._waiting = [len(b.params) for b in layout.buckets]
            self._seen: set[int] = set()
            self._next_launch = 0
            self._late: set[int] = set()
            self._callback_queued = False
            self.peak_staging_bytes = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.sync_enabled = True

    def _own(self, bucket) -> tuple[int, int]:
        return bucket.slice_range(self.rank) if self.layout.partitions > 1 else (bucket.start, bucket.start + bucket.numel)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks ------------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        i = self.index[param]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        off, n = self.layout.offsets[i], self.layout.numels[i]
        if self.stage in (0, 1):
            self.flat_grad[off : off + n].add_(grad.reshape(-1))
            return
        b = self.layout.bucket_of[i]
        bucket = self.layout.buckets[b]
        staging = self._staging.get(b)
        if staging is None:
            staging = self._staging[b] = self._take_staging(bucket.numel)
        staging[off - bucket.start : off - bucket.start + n].add_(grad.reshape(-1))
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if b < self._next_launch:  # its bucket was already sent during this backward
            self._late.add(b)
        elif i not in self._seen:
            self._seen.add(i)
            self._waiting[b] -= 1
            self._launch_ready()

    # -- stage 2: bucket by bucket during backward ---------------------------------------------

    def _take_staging(self, numel: int) -> torch.Tensor:
        for k, t in enumerate(self._pool):
            if t.numel() == numel:
                return self._pool.pop(k).zero_()
        t = torch.zeros(numel, dtype=self.comm_dtype, device=self.shards[0].device)
        live = sum(s.numel() for s in self._staging.values()) + numel + sum(s.numel() for s in self._pool)
        self.peak_staging_bytes = max(self.peak_staging_bytes, live * t.element_size())
        return t

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next_launch < len(buckets) and self._waiting[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        staging = self._staging.pop(b, None)
        if staging is None:  # no gradient at all for this bucket on this rank: contribute zeros
            staging = self._take_staging(bucket.numel)
        work = self._reduce(bucket, staging, async_op=self.overlap)
        self._inflight.append((b, staging, work))
        if not self.overlap:
            self._finish_inflight()

    def _finish_inflight(self) -> None:
        for b, staging, work in self._inflight:
            with record_function("zero::accumulate_grad_shard"):
                if work is not None:
                    work.wait()
                bucket = self.layout.buckets[b]
                lo, hi = self._own(bucket)
                self.shards[b].add_(staging[lo - bucket.start : hi - bucket.start])
            if self.on_final is not None:
                self.on_final(self.shards[b])
            self._pool.append(staging)
        self._inflight.clear()

    def _end_of_backward(self) -> None:
        """Runs once at the end of each backward: send what is left, wait for everything."""
        self._callback_queued = False
        with record_function("zero::end_of_backward"):
            for b in range(self._next_launch, len(self.layout.buckets)):
                self._launch(b)
            for b in sorted(self._late):
                self._launch(b)
            self._finish_inflight()
        self._late.clear()
        self._seen.clear()
        self._next_launch = 0
        self._waiting = [len(b.params) for b in self.layout.buckets]

    # -- shared -----------------------------------------------------------------------------

    def _reduce(self, bucket, buf: torch.Tensor, async_op: bool):
        """Sum `buf` (one whole bucket) over ranks; afterwards this rank's slice of it holds its
        share of the sum (or all of it, in stage 0)."""
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        if self.stage == 0 or not self.use_reduce_scatter:
            return self.comm.all_reduce(buf, "sum", async_op=async_op)
        lo, hi = bucket.slice_range(self.rank)
        return self.comm.reduce_scatter(buf[lo - bucket.start : hi - bucket.start], buf, async_op=async_op)

    def reduce_at_boundary(self) -> None:
        """Stages 0 and 1: reduce the accumulated flat gradient, bucket by bucket."""
        if self.stage == 2 or not self.sync_enabled:
            return
        for bucket in self.layout.buckets:
            full = self.flat_grad[bucket.start : bucket.start + bucket.numel]
            buf = full if full.dtype == self.comm_dtype else full.to(self.comm_dtype)
            self._reduce(bucket, buf, async_op=False)
            if buf is not full:
                lo, hi = self._own(bucket)
                full[lo - bucket.start : hi - bucket.start].copy_(buf[lo - bucket.start : hi - bucket.start])
            if self.on_final is not None:
                self.on_final(self.shards[bucket.index])

    def zero(self) -> None:
        """Forget all gradients (after a step, or a skipped step)."""
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:
            for s in self.shards:
                s.zero_()

    def grad_bytes(self) -> int:
        """Bytes held for gradients between steps (the flat buffer or the shards)."""
        if self.flat_grad is not None:
            return self.flat_grad.numel() * self.flat_grad.element_size()
        return sum(s.numel() * s.element_size() for s in self.shards)

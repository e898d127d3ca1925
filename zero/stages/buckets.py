"""Stages 0-2: one flat 16-bit parameter buffer in buckets; gradients reduced into this rank's shard.

[Note: flat parameters]
Every trainable parameter's storage moves into one flat buffer of the training dtype (see
[Note: bucket layout] in zero/partition/layout.py) and `param.data` becomes a view into it, so the
module, the user's references and autograd all keep working on the same objects. This happens one
parameter at a time: the parameter takes rank 0's values where it is, is copied and cast into its
place in the flat buffer on the device, and its exact fp32 values seed the fp32 master of the slices
this rank owns. The engine never holds a second full copy of the model. After each update the
owners' slices are all-gathered back into the flat buffer, bucket by bucket, in place.

Per bucket this rank keeps the fp32 master of its slice (a view into the flat buffer itself when
training in fp32 without offload, so fp32 training holds no second copy), Adam's exp_avg and
exp_avg_sq, and its gradient shard.

[Note: gradient path of stages 0-2]
A post-accumulate-grad hook on every trainable parameter takes its gradient as soon as autograd
has it, adds it into a bucket buffer and frees `param.grad`.
- Stages 0 and 1 accumulate into one flat gradient buffer the size of the model and communicate
  only at the accumulation boundary (`reduce_gradients`, called by the optimizer's step): each
  bucket is all-reduced (stage 0: every rank keeps the whole sum) or reduce-scattered in place
  (stage 1: each rank receives the sum of its own slice, which is then its gradient shard).
- Stage 2 keeps no full gradient. A bucket gets a staging buffer with its first gradient; when
  all of the bucket's gradients have arrived it is reduce-scattered (see [Note: gradient
  readiness] in zero/stages/readiness.py: strict bucket order, at most two in flight), the rank's
  slice of the sum is added to its gradient shard, and the staging buffer is freed. So gradient
  memory is the shard plus the buckets in flight. Stage 2 communicates on every micro-step,
  accumulation or not (as DeepSpeed does).
Sums are not divided by the world size here; see [Note: one divisor] in zero/stages/adam.py.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zero.comm import Comm
from zero.partition.layout import Bucket, ShardLayout, local_grad, local_tensor
from zero.precision import LossScaler
from zero.stages.adam import ShardedAdam
from zero.stages.policies import Precision, ReduceOptions, StepOptions
from zero.stages.readiness import GradReadiness, UnusedParameterError


class ZeroOptimizer(ShardedAdam):
    """The partitioned optimizer of stages 0, 1 and 2 over one flat parameter buffer.

    Args:
        module: the model (stage 2 hooks its forward to recover from a failed backward).
        param_groups, comm, precision, step, loss_scaler: see ShardedAdam.
        stage: 0, 1 or 2.
        reduce: gradient-reduction policies.
        device: where the model computes.
    """

    def __init__(self, module: nn.Module, param_groups: list[dict[str, Any]], *, stage: int, comm: Comm,
                 precision: Precision, step: StepOptions, reduce: ReduceOptions, device: torch.device,
                 loss_scaler: LossScaler | None = None):
        super().__init__(param_groups, comm=comm, precision=precision, step=step, loss_scaler=loss_scaler)
        self.stage = stage
        self.reduce = reduce
        groups = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self.partitions = 1 if stage == 0 else comm.world_size
        self.rank = comm.rank if self.partitions > 1 else 0
        self.layout = ShardLayout([local_tensor(p).numel() for p in self.params], groups, self.partitions,
                                  reduce.bucket_elements)
        self.names = {p: n for n, p in module.named_parameters()}
        self._index = {p: i for i, p in enumerate(self.params)}
        self._place_parameters(device)
        self.hook_state_dict_loads(module)
        if self.master and self.master[0].data_ptr() != self.flat[slice(*self._own(self.layout.buckets[0]))].data_ptr():
            self.watch_edits(self.params)  # 16-bit or offloaded: the master is a copy (fp32: the parameters)

        grad_dtype = precision.grad
        if stage < 2:
            self.flat_grad = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
            self.shards = [self.flat_grad[slice(*self._own(b))] for b in self.layout.buckets]
            self._seen: set[nn.Parameter] = set()
            self._handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]
            self.readiness = None
        else:
            self.flat_grad = None
            self.shards = [torch.zeros(b.slice_numel, dtype=grad_dtype, device=device) for b in self.layout.buckets]
            self._staging: dict[int, torch.Tensor] = {}
            self._work: dict[int, Any] = {}
            self.readiness = GradReadiness(
                [[self.params[i] for i in b.params] for b in self.layout.buckets], take=self._take, launch=self._launch,
                finish=self._finish, comm=comm, ordered=True, overlap=reduce.overlap_comm, names=self.names,
                ignore_unused=reduce.ignore_unused_parameters, on_end=self._check_deferred_tags)
            # a bucket's tag is checked before its reduction on gloo (where mismatched sizes abort
            # the process); on NCCL together at the end of the backward, so the CPU does not wait
            # for the other ranks at every bucket (as stage 3 does; see [Note: rank-agreement tags])
            self._check_at_once = not comm.uses_nccl or reduce.strict_checks
            self._unchecked: list = []
            module.register_forward_pre_hook(lambda m, a: self._recover())
            module.register_forward_hook(lambda m, a, out: self.readiness.hook_outputs(out))

    @torch.no_grad()
    def _place_parameters(self, device: torch.device) -> None:
        """See [Note: flat parameters]."""
        layout, dtype = self.layout, self.precision.param
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)
        alias = self.master_is_params()
        self.master = [self.flat[slice(*self._own(b))] if alias else self.new_state(self.flat[slice(*self._own(b))], device)
                       for b in layout.buckets]
        self.exp_avg = [self.new_state(m, device) for m in self.master]
        self.exp_avg_sq = [self.new_state(m, device) for m in self.master]
        for i, p in enumerate(self.params):
            full = local_tensor(p).detach().reshape(-1)  # where the user built it (copied across devices below)
            self.comm.broadcast(full, src=0)  # every rank starts from rank 0's values
            off, n = layout.offsets[i], layout.numels[i]
            self.flat[off : off + n].copy_(full)
            bucket = layout.buckets[layout.bucket_of[i]]
            lo, hi = self._own(bucket)
            a, b = max(lo, off), min(hi, off + n)
            if not alias and a < b:  # the exact fp32 values of the part this rank owns
                self.master[bucket.index][a - lo : b - lo].copy_(full[a - off : b - off])
            local = local_tensor(p)  # a DTensor's own piece (see [Note: sliced parameters])
            local.data = self.flat[off : off + n].view_as(local)

    def master_is_params(self) -> bool:
        """fp32 training without offload: the parameters are their own master (no second copy)."""
        return self.precision.param == torch.float32 and self.offload is None

    def _owned_part(self, i: int) -> tuple[Bucket, int, int, int, int]:
        """Parameter i's bucket, the start `lo` of this rank's slice of it, the parameter's offset
        `off`, and [a, b): the part of the parameter inside the slice (flat-buffer elements; empty
        when a == b)."""
        off, n = self.layout.offsets[i], self.layout.numels[i]
        bucket = self.layout.buckets[self.layout.bucket_of[i]]
        lo, hi = self._own(bucket)
        a = max(lo, off)
        return bucket, lo, off, a, max(a, min(hi, off + n))

    def param_chunks(self, param: nn.Parameter, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        i = self._index.get(param)
        if i is None:  # frozen: replicated on every rank, written by rank 0
            whole = local_tensor(param).detach().reshape(-1)
            return [("model", 0, whole)] if not saving or self.comm.rank == 0 else []
        bucket, lo, off, a, b = self._owned_part(i)
        n = self.layout.numels[i]
        out = []
        if saving and (self.partitions > 1 or self.comm.rank == 0):
            out.append(("model", a - off, self.flat[a:b]))  # this rank's slice (stage 0: rank 0 writes all)
        elif not saving:
            out.append(("model", 0, self.flat[off : off + n]))  # every rank holds the whole parameter
        if saving and self.partitions == 1 and self.comm.rank != 0:
            return out
        master = self.master[bucket.index]
        for kind, t in (("master", master), ("exp_avg", self.exp_avg[bucket.index]),
                        ("exp_avg_sq", self.exp_avg_sq[bucket.index])):
            out.append((kind, a - off, t[a - lo : b - lo]))
        return out

    def grad_piece(self, param: nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        i = self._index[param]
        if self.stage < 2:
            off = self.layout.offsets[i]
            return 0, self.flat_grad[off : off + self.layout.numels[i]], False
        bucket, lo, off, a, b = self._owned_part(i)
        return a - off, self.shards[bucket.index][a - lo : b - lo], True

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        i = self._index.get(param)
        if i is None:
            return None
        bucket, lo, _, a, b = self._owned_part(i)
        return self.shards[bucket.index][a - lo : b - lo] if a < b else None

    def load_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """The master's part of `param` takes `value` exactly (torch then writes the 16-bit param)."""
        i = self._index.get(param)
        if i is None:
            return None
        bucket, lo, off, a, b = self._owned_part(i)
        master = self.master[bucket.index]
        if a < b and master.data_ptr() != self.flat[slice(*self._own(bucket))].data_ptr():
            master[a - lo : b - lo].copy_(value.detach().reshape(-1)[a - off : b - off])
        return None

    def adopt_edit(self, param: nn.Parameter) -> None:
        self.load_param(param, param.detach())

    def _own(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.slice_range(self.rank) if self.partitions > 1 else (bucket.start, bucket.start + bucket.numel)

    # -- gradients: stages 0 and 1 ------------------------------------------------------------

    def _accumulate(self, param: nn.Parameter) -> None:
        grad, param.grad = local_grad(param), None
        if grad is not None:
            off = self.layout.offsets[self._index[param]]
            self.flat_grad[off : off + grad.numel()].add_(grad.reshape(-1))
            if not self.reduce.ignore_unused_parameters:
                self._seen.add(param)

    def _reduce_bucket(self, bucket: Bucket, buf: torch.Tensor, async_op: bool):
        """Sum `buf` (one whole bucket) over ranks; afterwards this rank's slice of it holds its
        share of the sum (or all of it, in stage 0)."""
        if self.options.predivide != 1.0:
            buf.div_(self.options.predivide)
        if self.partitions == 1 or not self.reduce.reduce_scatter:
            return self.comm.all_reduce(buf, "sum", async_op=async_op)
        lo, hi = bucket.slice_range(self.rank)
        return self.comm.reduce_scatter(buf[lo - bucket.start : hi - bucket.start], buf, async_op=async_op)

    def reduce_gradients(self) -> None:
        """Stages 0 and 1: reduce the accumulated flat gradient, bucket by bucket."""
        if self.stage == 2:
            return
        if not self.reduce.ignore_unused_parameters:
            unused = [self.names.get(p, "?") for p in self.params if p not in self._seen]
            self._seen.clear()
            if unused:
                raise UnusedParameterError(
                    f"{len(unused)} trainable parameter(s) got no gradient in this step: {unused[:8]}. Set "
                    f"zero_optimization.ignore_unused_parameters to true, or freeze them before zero.initialize.")
        for bucket in self.layout.buckets:
            full = self.flat_grad[bucket.start : bucket.start + bucket.numel]
            buf = full if full.dtype == self.precision.reduce else full.to(self.precision.reduce)
            self.gauges.reduce_buffers.add(0 if buf is full else buf.untyped_storage().nbytes())
            self._reduce_bucket(bucket, buf, async_op=False)
            if buf is not full:
                lo, hi = self._own(bucket)
                full[lo - bucket.start : hi - bucket.start].copy_(buf[lo - bucket.start : hi - bucket.start])
                self.gauges.reduce_buffers.sub(buf.untyped_storage().nbytes())
            self.grad_final(self.shards[bucket.index])

    # -- gradients: stage 2 (see [Note: gradient readiness]) -------------------------------------

    def _staging_for(self, b: int) -> torch.Tensor:
        staging = self._staging.get(b)
        if staging is None:
            bucket = self.layout.buckets[b]
            staging = self._staging[b] = torch.zeros(bucket.numel, dtype=self.precision.reduce, device=self.flat.device)
            self.gauges.reduce_buffers.add(staging.untyped_storage().nbytes())
        return staging

    def _take(self, b: int, param: nn.Parameter) -> None:
        grad, param.grad = local_grad(param), None
        if grad is not None:
            i = self._index[param]
            off = self.layout.offsets[i] - self.layout.buckets[b].start
            self._staging_for(b)[off : off + grad.numel()].add_(grad.reshape(-1))

    def _launch(self, b: int) -> None:
        what = f"stage 2, gradient reduction of bucket {b}"
        if self.comm.world_size > 1:
            work, tags = self.comm.start_tag([3, b, self.layout.buckets[b].numel])
            if self._check_at_once:
                self.comm.check_tags(work, tags, what)
            else:
                self._unchecked.append((work, tags, what))
        staging = self._staging_for(b)  # a bucket without any gradient on this rank contributes zeros
        self._work[b] = self._reduce_bucket(self.layout.buckets[b], staging, async_op=self.reduce.overlap_comm)

    def _check_deferred_tags(self) -> None:
        pending, self._unchecked = self._unchecked, []
        for work, tags, what in pending:
            self.comm.check_tags(work, tags, what)

    def _finish(self, b: int) -> None:
        with record_function("zero::accumulate_grad_shard"):
            work = self._work.pop(b)
            if work is not None:
                work.wait()
            staging = self._staging.pop(b)
            bucket = self.layout.buckets[b]
            lo, hi = self._own(bucket)
            self.shards[b].add_(staging[lo - bucket.start : hi - bucket.start])
            self.gauges.reduce_buffers.sub(staging.untyped_storage().nbytes())
        self.grad_final(self.shards[b])

    def _recover(self) -> None:
        if self.readiness.recover():
            self._check_deferred_tags()
            for staging in self._staging.values():
                self.gauges.reduce_buffers.sub(staging.untyped_storage().nbytes())
            self._staging.clear()

    # -- the optimizer's view ------------------------------------------------------------------

    def slots(self):
        out = []
        for bucket in self.layout.buckets:
            b = bucket.index
            lo, hi = self._own(bucket)
            aliased = self.master[b].data_ptr() == self.flat[lo:hi].data_ptr()
            out16 = None if aliased else self.flat[lo:hi]
            out.append((bucket.group, self.master[b], self.shards[b], self.exp_avg[b], self.exp_avg_sq[b], out16))
        return out

    def norm_is_partitioned(self) -> bool:
        return self.partitions > 1

    def publish(self) -> None:
        if self.partitions > 1:
            works = [self.comm.all_gather(self.flat[bk.start : bk.start + bk.numel], self.flat[slice(*self._own(bk))],
                                          async_op=True) for bk in self.layout.buckets]
            for w in works:
                w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine does this after every step)."""
        if self.readiness is not None:
            self._recover()
        super().zero_grad()
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:
            for s in self.shards:
                s.zero_()

    def memory_report(self) -> dict[str, int]:
        return self._measure({
            "params": [self.flat],
            "grads": [self.flat_grad] if self.flat_grad is not None else self.shards,
            "fp32_master": self.master,
            "optimizer_states": self.exp_avg + self.exp_avg_sq,
        }, set())

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
training in fp32 without offload, so fp32 training holds no second copy), the optimizer state its
param group's rule declares (Adam's exp_avg and exp_avg_sq; see [Note: declared state] in
zero/optim/rules.py), and its gradient shard.

[Note: gradient path of stages 0-2]
A post-accumulate-grad hook on every trainable parameter takes its gradient as soon as autograd
has it, adds it into a bucket buffer and frees `param.grad`. Two paths, one interface (`shards`,
`reduce`, `piece`, `zero`):
- `FlatGradients` (stages 0 and 1) accumulates into one flat gradient buffer the size of the model
  and communicates only at the accumulation boundary (`reduce`, called by the optimizer's step):
  each bucket is all-reduced (stage 0: every rank keeps the whole sum) or reduce-scattered in
  place (stage 1: each rank receives the sum of its own slice, which is then its gradient shard).
- `BucketGradients` (stage 2) keeps no full gradient. A bucket gets a staging buffer with its
  first gradient; when all of the bucket's gradients have arrived it is reduce-scattered (see
  [Note: gradient readiness] in zero/stages/readiness.py: strict bucket order, at most two in
  flight), the rank's slice of the sum is added to its gradient shard, and the staging buffer is
  freed. So gradient memory is the shard plus the buckets in flight. Stage 2 communicates on every
  micro-step, accumulation or not (as DeepSpeed does).
Sums are not divided by the world size here; see [Note: one divisor] in zero/optim/step.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zero.offload.policy import OffloadPolicy
from zero.parallel.comm import Comm
from zero.parallel.sliced import local_grad, local_tensor
from zero.parallel.tags import Tag
from zero.partition.layout import Bucket, ShardLayout
from zero.stages.memory import Gauges
from zero.stages.placement import Placement, ReplicasSummedError
from zero.stages.policies import Precision, ReduceOptions
from zero.stages.readiness import GradReadiness, UnusedParameterError
from zero.stages.storage import ParamStorage, Slot
from zero.state import StateSpecs, saved_specs


class GradPath(Protocol):
    """How gradients reach the shards of stages 0-2 (see [Note: gradient path of stages 0-2])."""

    shards: list[torch.Tensor]  # this rank's gradient shard of each bucket

    def reduce(self, communicate: bool = True) -> None:
        """Finish the reduction owed at the step (`communicate=False`: only the bookkeeping)."""

    def piece(self, i: int) -> tuple[int, torch.Tensor, bool]:
        """Parameter i's gradient on this rank: see ParamStorage.grad_piece."""

    def zero(self) -> None:
        """Forget the step's gradients."""

    def buffers(self) -> list[torch.Tensor]:
        """The gradient buffers it holds, for the memory report."""


@dataclass(eq=False)
class Range:
    """One range of a bucket whose reduced gradient, master and optimizer state this rank keeps
    (see [Note: placements] in zero/stages/placement.py): [lo, hi) in flat-buffer elements, its
    place `at` in the bucket's gradient shard, the parameter it is whole of (Owned) or None."""

    lo: int
    hi: int
    at: int
    param: int | None
    master: torch.Tensor
    state: dict[str, torch.Tensor]
    grad: torch.Tensor | None = None  # its view of the gradient shard (one object: offload knows it by identity)


class FlatParams(ParamStorage):
    """The storage of stages 0, 1 and 2: one flat parameter buffer in buckets (see [Note: flat
    parameters]) and its gradient path (see [Note: gradient path of stages 0-2]). Each bucket is
    cut into this rank's ranges by its param group's placement (see [Note: placements] in
    zero/stages/placement.py).

    Args:
        module: the model (stage 2 hooks its forward to recover from a failed backward).
        params: the trainable parameters, in param-group order.
        groups: the param-group index of each parameter.
        stage: 0, 1 or 2.
        comm, precision, offload, gauges: see ParamStorage.
        reduce: gradient-reduction policies.
        predivide: gradients are divided by this before their reduction.
        device: where the model computes.
        master_is_params: keep no separate master: the parameters are their own (fp32 training, or
            bf16 training with a bf16 master, without offload).
        grad_final, step_number, state_specs: see ParamStorage.
        placements: each param group's placement (all with the same number of partitions);
            Owned groups (Muon's) hold nothing else, so their buckets hold only their parameters.
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: list[int], *, stage: int, comm: Comm,
                 precision: Precision, offload: OffloadPolicy | None, gauges: Gauges, reduce: ReduceOptions,
                 predivide: float, device: torch.device, master_is_params: bool,
                 grad_final: Callable[[torch.Tensor], None], step_number: Callable[[], int],
                 state_specs: StateSpecs, placements: list[Placement]):
        super().__init__(params, {p: n for n, p in module.named_parameters()}, comm, precision, offload, gauges,
                         grad_final=grad_final, step_number=step_number, state_specs=state_specs, device=device)
        self.stage = stage
        self.reduce = reduce
        self.predivide = predivide
        self.placements = placements
        self.partitions = placements[0].partitions if placements else (1 if stage == 0 else comm.world_size)
        self.rank = comm.rank if self.partitions > 1 else 0
        self.layout = ShardLayout([local_tensor(p).numel() for p in params], groups, self.partitions,
                                  reduce.bucket_elements)
        self._index = {p: i for i, p in enumerate(params)}
        self._place_parameters(device, master_is_params)
        self.hook_state_dict_loads(module)
        if not master_is_params:
            self.watch_edits(params)  # the master is a copy (16-bit or offloaded); fp32: the parameters
        path = FlatGradients if stage < 2 else BucketGradients
        self.grads: GradPath = path(self, module, device)

    def placement(self, bucket: Bucket) -> Placement:
        return self.placements[bucket.group]

    def is_matrix(self, param: nn.Parameter) -> bool:
        i = self._index.get(param)
        return i is not None and self.placements[self.layout.groups[i]].matrix(i) is not None

    def mine(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(begin, end, place in the gradient shard) of each range of `bucket` whose reduced
        gradient this rank keeps (see Placement.ranges)."""
        return [(r.lo, r.hi, r.at) for r in self.ranges[bucket.index]]

    def shard_numel(self, bucket: Bucket) -> int:
        """Elements of this rank's gradient shard of `bucket`."""
        return sum(r.hi - r.lo for r in self.ranges[bucket.index])

    @torch.no_grad()
    def _place_parameters(self, device: torch.device, alias: bool) -> None:
        """See [Note: flat parameters]."""
        layout, dtype = self.layout, self.precision.param
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)
        self.ranges: list[list[Range]] = []
        for bucket in layout.buckets:  # each range's master and optimizer state, as its group declares it
            mine, at = [], 0
            for lo, hi, i in self.placement(bucket).ranges(bucket, layout):
                master = self.new_master(self.flat[lo:hi], alias)
                mine.append(Range(lo, hi, at, i, master, self.new_states(bucket.group, master)))
                at += hi - lo
            self.ranges.append(mine)
        for i, p in enumerate(self.params):
            full = local_tensor(p).detach().reshape(-1)  # where the user built it (copied across devices below)
            self.placements[self.layout.groups[i]].broadcast_initial(full)  # every rank starts from rank 0's values
            off, n = layout.offsets[i], layout.numels[i]
            self.flat[off : off + n].copy_(full)
            for r in self.ranges[layout.bucket_of[i]]:
                a, b = max(r.lo, off), min(r.hi, off + n)
                if not alias and a < b:  # the exact fp32 values of the part this rank owns
                    r.master[a - r.lo : b - r.lo].copy_(full[a - off : b - off])
            local = local_tensor(p)  # a DTensor's own piece (see [Note: sliced parameters])
            local.data = self.flat[off : off + n].view_as(local)

    @property
    def master(self) -> list[torch.Tensor]:
        """Each bucket's first range's master (the only one of a Sharded bucket)."""
        return [rs[0].master if rs else self.flat[:0] for rs in self.ranges]

    def own(self, bucket: Bucket) -> tuple[int, int]:
        """[begin, end) of this rank's slice of `bucket` in the flat buffer (all of it at stage 0)."""
        return bucket.slice_range(self.rank) if self.partitions > 1 else (bucket.start, bucket.start + bucket.numel)

    def reduce_bucket(self, bucket: Bucket, buf: torch.Tensor, async_op: bool, replicas: bool = True):
        """Sum `buf` (one whole bucket) over ranks (without the replicas: `replicas` False);
        afterwards this rank's ranges of it hold their sums. Returns the collective's handle."""
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        return self.placement(bucket).reduce_bucket(bucket, buf, self.layout, async_op, self.reduce.reduce_scatter,
                                                    replicas)

    # -- what the step sees -----------------------------------------------------------------------

    def range_grad(self, bucket: Bucket, r: Range) -> torch.Tensor:
        """A range's reduced gradient (the same view object, always)."""
        if r.grad is None:
            shard = self.grads.shards[bucket.index]
            if isinstance(self.grads, FlatGradients) and r.param is not None:  # a whole parameter's: where it is
                r.grad = self.grads.flat[r.lo : r.hi]
            else:
                r.grad = shard if r.at == 0 and r.hi - r.lo == shard.numel() else shard[r.at : r.at + r.hi - r.lo]
        return r.grad

    def slots(self) -> list[Slot]:
        out = []
        for bucket in self.layout.buckets:
            place, specs = self.placement(bucket), self.state_specs(bucket.group)
            for r in self.ranges[bucket.index]:
                view = self.flat[r.lo : r.hi]
                out16 = None if r.master.data_ptr() == view.data_ptr() else view
                out.append(Slot(bucket.group, r.master, self.range_grad(bucket, r), r.state, specs, out16, index=r.lo,
                                matrix=place.matrix(r.param) if r.param is not None else None))
        return out

    def final_grads(self, bucket: Bucket) -> list[torch.Tensor]:
        """The gradient shards that are final once `bucket` is reduced (for `grad_final`)."""
        return [self.range_grad(bucket, r) for r in self.ranges[bucket.index]]

    def reduce_gradients(self, communicate: bool = True) -> None:
        """See GradPath.reduce."""
        self.grads.reduce(communicate)

    def sum_replicas(self) -> None:
        if isinstance(self.grads, BucketGradients):  # stages 0-1 sum over the replicas inside the step's reduce
            self.grads.reduce()

    def norm_is_partitioned(self) -> bool:
        return self.partitions > 1

    @property
    def summed(self) -> int:
        return self.placements[0].summed if self.placements else self.comm.world_size

    @property
    def replicate(self):
        return self.placements[0].replicate if self.placements else None

    def norm_copies(self) -> int:
        replicas = self.summed // self.comm.world_size
        return replicas if self.partitions > 1 else replicas * self.comm.world_size

    def out16_on_host(self) -> bool:
        return False

    def publish(self) -> None:
        works = [w for bucket in self.layout.buckets for w in self.placement(bucket).gather_bucket(self.flat, bucket,
                                                                                                   self.layout)]
        for w in works:
            w.wait()

    def zero_grads(self) -> None:
        self.grads.zero()

    def _parts(self, i: int):
        """(bucket, range, [a, b)) for each range holding part of parameter i on this rank."""
        bucket = self.layout.buckets[self.layout.bucket_of[i]]
        off, n = self.layout.offsets[i], self.layout.numels[i]
        for r in self.ranges[bucket.index]:
            a, b = max(r.lo, off), min(r.hi, off + n)
            if a < b:
                yield bucket, r, a, b

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        i = self._index.get(param)
        if i is None:
            return None
        for bucket, r, a, b in self._parts(i):
            return self.range_grad(bucket, r)[a - r.lo : b - r.lo]
        return None

    def memory_parts(self) -> tuple[dict[str, list[torch.Tensor]], set[str]]:
        ranges = [r for rs in self.ranges for r in rs]
        return {"params": [self.flat], "grads": self.grads.buffers(), "fp32_master": [r.master for r in ranges],
                "optimizer_states": [t for r in ranges for t in r.state.values()]}, set()

    # -- checkpoints ----------------------------------------------------------------------------------

    def param_chunks(self, param: nn.Parameter, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        i = self._index.get(param)
        if i is None:  # frozen: replicated on every rank, written by rank 0 (of the first replica)
            whole = local_tensor(param).detach().reshape(-1)
            first = self.comm.rank == 0 and (self.replicate is None or self.replicate.rank == 0)
            return [("model", 0, whole)] if not saving or first else []
        off, n = self.layout.offsets[i], self.layout.numels[i]
        bucket = self.layout.buckets[self.layout.bucket_of[i]]
        if saving and not self.placement(bucket).writes:  # another rank writes what this one holds
            return []
        out = [] if saving else [("model", 0, self.flat[off : off + n])]  # every rank holds the whole parameter
        specs = saved_specs(self.state_specs(bucket.group))
        for _, r, a, b in self._parts(i):
            if saving:
                out.append(("model", a - off, self.flat[a:b]))  # its ranges (stage 0: rank 0 writes all)
            out.append(("master", a - off, r.master[a - r.lo : b - r.lo]))
            for spec in specs:
                view = self.store.view((bucket.index, r.lo), spec, r.state)
                if spec.per == "element":
                    out.append((spec.name, a - off, view[a - r.lo : b - r.lo]))
                elif a == off or not saving:  # a scalar: written with the parameter's first element
                    out.append((spec.name, 0, view))
        return out

    def grad_piece(self, param: nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        return self.grads.piece(self._index[param])

    # -- user code changing parameters --------------------------------------------------------------

    def load_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """The master's part of `param` takes `value` exactly (torch then writes the 16-bit param)."""
        i = self._index.get(param)
        if i is None:
            return None
        off = self.layout.offsets[i]
        for _, r, a, b in self._parts(i):
            if r.master.data_ptr() != self.flat[r.lo : r.hi].data_ptr():
                r.master[a - r.lo : b - r.lo].copy_(value.detach().reshape(-1)[a - off : b - off])
        return None

    def adopt_edit(self, param: nn.Parameter) -> None:
        self.load_param(param, param.detach())


class FlatGradients:
    """Stages 0 and 1: gradients accumulate in one flat buffer and are reduced at the step (see
    [Note: gradient path of stages 0-2])."""

    def __init__(self, storage: FlatParams, module: nn.Module, device: torch.device):
        self.storage = storage
        layout = storage.layout
        self.flat = torch.zeros(layout.numel, dtype=storage.precision.grad, device=device)
        self.shards = [self.flat[slice(*storage.own(b))] for b in layout.buckets]
        self._seen: set[nn.Parameter] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in storage.params]

    def __getstate__(self) -> dict:
        return {}  # see ParamStorage.__getstate__: a copy leaves its model's gradients alone

    def _accumulate(self, param: nn.Parameter) -> None:
        if not self.__dict__:
            return
        grad, param.grad = local_grad(param), None
        if grad is not None:
            off = self.storage.layout.offsets[self.storage._index[param]]
            self.flat[off : off + grad.numel()].add_(grad.reshape(-1))
            if not self.storage.reduce.ignore_unused_parameters:
                self._seen.add(param)

    def reduce(self, communicate: bool = True) -> None:
        """Reduce the accumulated flat gradient, bucket by bucket (`communicate=False`: keep each
        rank's own sum, for 0/1 Adam's local steps)."""
        s = self.storage
        if not s.reduce.ignore_unused_parameters:
            unused = [s.names.get(p, "?") for p in s.params if p not in self._seen]
            self._seen.clear()
            if unused and communicate:
                raise UnusedParameterError(
                    f"{len(unused)} trainable parameter(s) got no gradient in this step: {unused[:8]}. Set "
                    f"zero_optimization.ignore_unused_parameters to true, or freeze them before zero.initialize.")
        if not communicate:
            return
        for bucket in s.layout.buckets:
            full = self.flat[bucket.start : bucket.start + bucket.numel]
            buf = full if full.dtype == s.precision.reduce else full.to(s.precision.reduce)
            s.gauges.reduce_buffers.add(0 if buf is full else buf.untyped_storage().nbytes())
            s.reduce_bucket(bucket, buf, async_op=False)
            if buf is not full:
                for lo, hi, _ in s.mine(bucket):
                    full[lo - bucket.start : hi - bucket.start].copy_(buf[lo - bucket.start : hi - bucket.start])
                s.gauges.reduce_buffers.sub(buf.untyped_storage().nbytes())
            for grad in s.final_grads(bucket):
                s.grad_final(grad)

    def piece(self, i: int) -> tuple[int, torch.Tensor, bool]:
        off = self.storage.layout.offsets[i]
        return 0, self.flat[off : off + self.storage.layout.numels[i]], False

    def zero(self) -> None:
        self.flat.zero_()

    def buffers(self) -> list[torch.Tensor]:
        return [self.flat]


class BucketGradients:
    """Stage 2: each bucket is reduce-scattered into the shards as soon as its gradients are
    ready (see [Note: gradient path of stages 0-2])."""

    def __init__(self, storage: FlatParams, module: nn.Module, device: torch.device):
        self.storage = storage
        s = storage
        self.shards = [torch.zeros(s.shard_numel(b), dtype=s.precision.grad, device=device) for b in s.layout.buckets]
        self._staging: dict[int, torch.Tensor] = {}
        self._work: dict[int, Any] = {}
        self.replicas_summed = False  # see [Note: the replicas' sum, once] in zero/stages/placement.py
        self.replicas_owed = False  # a bucket was reduced in its shard group since the gradients were zeroed
        self.readiness = GradReadiness(
            [[s.params[i] for i in b.params] for b in s.layout.buckets], take=self._take, launch=self._launch,
            finish=self._finish, comm=s.comm, ordered=True, overlap=s.reduce.overlap_comm, names=s.names,
            ignore_unused=s.reduce.ignore_unused_parameters)
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    def __getstate__(self) -> dict:
        return {}  # see ParamStorage.__getstate__: a copy's hooks do nothing

    def _before_forward(self, module: nn.Module, args) -> None:
        if self.__dict__:
            self.recover()

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if self.__dict__:
            self.readiness.hook_outputs(output)

    def _staging_for(self, b: int) -> torch.Tensor:
        staging = self._staging.get(b)
        if staging is None:
            s = self.storage
            staging = self._staging[b] = torch.zeros(s.layout.buckets[b].numel, dtype=s.precision.reduce,
                                                     device=self.shards[b].device)
            s.gauges.reduce_buffers.add(staging.untyped_storage().nbytes())
        return staging

    def _take(self, b: int, param: nn.Parameter) -> None:
        grad, param.grad = local_grad(param), None
        if grad is not None:
            layout = self.storage.layout
            off = layout.offsets[self.storage._index[param]] - layout.buckets[b].start
            self._staging_for(b)[off : off + grad.numel()].add_(grad.reshape(-1))

    def _launch(self, b: int) -> None:
        s = self.storage
        bucket = s.layout.buckets[b]
        if s.placement(bucket).defers_replicas:
            if self.replicas_summed:  # before any shard changes
                raise ReplicasSummedError(s.names.get(s.params[bucket.params[0]], "?"))
            self.replicas_owed = True
        s.comm.tagged(Tag.BUCKET_REDUCE, b, bucket.numel, f"stage 2, gradient reduction of bucket {b}")
        staging = self._staging_for(b)  # a bucket without any gradient on this rank contributes zeros
        # replicas (hybrid sharding) sum their shards once, at the step (`reduce`)
        self._work[b] = s.reduce_bucket(bucket, staging, async_op=s.reduce.overlap_comm,
                                        replicas=not s.placement(bucket).defers_replicas)

    def _finish(self, b: int) -> None:
        s = self.storage
        with record_function("zero::accumulate_grad_shard"):
            work = self._work.pop(b)
            if work is not None:
                work.wait()
            staging = self._staging.pop(b)
            bucket = s.layout.buckets[b]
            for lo, hi, at in s.mine(bucket):
                self.shards[b][at : at + hi - lo].add_(staging[lo - bucket.start : hi - bucket.start])
            s.gauges.reduce_buffers.sub(staging.untyped_storage().nbytes())
        if not s.placement(bucket).defers_replicas:
            for grad in s.final_grads(bucket):
                s.grad_final(grad)

    def recover(self) -> None:
        """Forget what a backward that raised left behind (see [Note: gradient readiness])."""
        if self.readiness.recover():
            for staging in self._staging.values():
                self.storage.gauges.reduce_buffers.sub(staging.untyped_storage().nbytes())
            self._staging.clear()

    def reduce(self, communicate: bool = True) -> None:
        """Every bucket was reduced inside its shard group during backward; what is owed at the step
        is the sum over the replicas (hybrid sharding), once per optimizer step (see [Note: the
        replicas' sum, once] in zero/stages/placement.py)."""
        s = self.storage
        if self.replicas_summed or not self.replicas_owed:  # summed already, or nothing reduced since zeroed
            return
        for bucket in s.layout.buckets:
            place = s.placement(bucket)
            if place.defers_replicas:
                place.reduce_replicas([self.shards[bucket.index]])
                for grad in s.final_grads(bucket):
                    s.grad_final(grad)
                self.replicas_summed = True

    def piece(self, i: int) -> tuple[int, torch.Tensor, bool]:
        s = self.storage
        off = s.layout.offsets[i]
        for bucket, r, a, b in s._parts(i):  # one range of it, at most: a slice, or the whole parameter
            return a - off, s.range_grad(bucket, r)[a - r.lo : b - r.lo], True
        return 0, self.shards[s.layout.bucket_of[i]][:0], True

    def zero(self) -> None:
        self.recover()
        self.replicas_summed = self.replicas_owed = False
        for s in self.shards:
            s.zero_()

    def buffers(self) -> list[torch.Tensor]:
        return self.shards

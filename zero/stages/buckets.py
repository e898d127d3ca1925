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
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zero.optim.muon import assign_owners
from zero.optim.rules import StateSpecs, saved_specs
from zero.parallel.comm import Comm, Tag
from zero.partition.layout import Bucket, ShardLayout, local_grad, local_tensor
from zero.stages.memory import Gauges
from zero.stages.policies import OffloadOptions, Precision, ReduceOptions
from zero.stages.readiness import GradReadiness, UnusedParameterError
from zero.stages.storage import ParamStorage, Slot


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


class FlatParams(ParamStorage):
    """The storage of stages 0, 1 and 2: one flat parameter buffer in buckets (see [Note: flat
    parameters]) and its gradient path (see [Note: gradient path of stages 0-2]).

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
        matrices: parameter index -> matrix shape of the parameters Muon updates (in param groups
            of their own, so their buckets hold nothing else); see [Note: Muon in buckets].
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: list[int], *, stage: int, comm: Comm,
                 precision: Precision, offload: OffloadOptions | None, gauges: Gauges, reduce: ReduceOptions,
                 predivide: float, device: torch.device, master_is_params: bool,
                 grad_final: Callable[[torch.Tensor], None], step_number: Callable[[], int],
                 state_specs: StateSpecs, matrices: dict[int, tuple[int, int]] | None = None):
        super().__init__(params, {p: n for n, p in module.named_parameters()}, comm, precision, offload, gauges,
                         grad_final=grad_final, step_number=step_number, state_specs=state_specs)
        self.stage = stage
        self.reduce = reduce
        self.predivide = predivide
        self.partitions = 1 if stage == 0 else comm.world_size
        self.rank = comm.rank if self.partitions > 1 else 0
        self.layout = ShardLayout([local_tensor(p).numel() for p in params], groups, self.partitions,
                                  reduce.bucket_elements)
        self._index = {p: i for i, p in enumerate(params)}
        self._plan_matrices(matrices or {})
        self._place_parameters(device, master_is_params)
        self.hook_state_dict_loads(module)
        if not master_is_params:
            self.watch_edits(params)  # the master is a copy (16-bit or offloaded); fp32: the parameters
        path = FlatGradients if stage < 2 else BucketGradients
        self.grads: GradPath = path(self, module, device)

    def _plan_matrices(self, matrices: dict[int, tuple[int, int]]) -> None:
        """[Note: Muon in buckets]
        Muon's matrices (zero/optim/muon.py) lie in buckets of their own. Such a bucket is not cut into
        equal slices: each matrix has one owner rank (whole matrices assigned by their
        Newton-Schulz work, `assign_owners`), which keeps its fp32 master and momentum. Its
        gradient is reduced to the owner (one reduce per matrix, in place of the bucket's
        reduce-scatter) and its updated values are broadcast from the owner (in place of the
        all-gather): the same bytes as Adam's path. Stage 0 keeps every matrix on every rank."""
        self.matrices = matrices
        whole = sorted(matrices)
        owners = assign_owners([matrices[i] for i in whole], self.partitions) if self.partitions > 1 else [0] * len(whole)
        self.owner = dict(zip(whole, owners))
        self.muon_buckets = set()
        self.muon_pos: dict[int, int] = {}  # an owned matrix's place in its bucket's gradient shard
        self._muon_grads: dict[int, torch.Tensor] = {}
        for bucket in self.layout.buckets:
            held = [i in matrices for i in bucket.params]
            if any(held):
                if not all(held):
                    raise ValueError(f"bucket {bucket.index} mixes Muon matrices with other parameters: Muon's "
                                     f"parameters need param groups of their own")
                self.muon_buckets.add(bucket.index)
                at = 0
                for i in bucket.params:
                    if self.owner[i] == self.rank:
                        self.muon_pos[i] = at
                        at += self.layout.numels[i]

    def is_matrix(self, param: nn.Parameter) -> bool:
        return self._index.get(param) in self.matrices

    def owns(self, i: int) -> bool:
        """Does this rank update parameter i's matrix (Muon's; see [Note: Muon in buckets])?"""
        return i in self.muon_pos

    def mine(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(begin, end, place in the gradient shard) of each range of `bucket` whose reduced
        gradient this rank keeps: its slice, or the matrices it owns in a Muon bucket."""
        if bucket.index not in self.muon_buckets:
            lo, hi = self.own(bucket)
            return [(lo, hi, 0)]
        layout = self.layout
        return [(layout.offsets[i], layout.offsets[i] + layout.numels[i], self.muon_pos[i])
                for i in bucket.params if self.owns(i)]

    def shard_numel(self, bucket: Bucket) -> int:
        """Elements of this rank's gradient shard of `bucket`."""
        return sum(hi - lo for lo, hi, _ in self.mine(bucket))

    @torch.no_grad()
    def _place_parameters(self, device: torch.device, alias: bool) -> None:
        """See [Note: flat parameters]."""
        layout, dtype = self.layout, self.precision.param
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)
        muon = self.muon_buckets
        nothing = torch.empty(0)
        self.master = [self.new_state(nothing, device) if b.index in muon else
                       self.new_master(self.flat[slice(*self.own(b))], device, alias) for b in layout.buckets]
        # each bucket's optimizer state as its group's rule declares it (a Muon bucket's is per matrix)
        self.state = [{} if b.index in muon else self.new_states(self.state_specs(b.group), m, device)
                      for b, m in zip(layout.buckets, self.master)]
        self.muon_master: dict[int, torch.Tensor] = {}  # owned matrices: fp32 master (flat) and state
        self.matrix_state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self.params):
            full = local_tensor(p).detach().reshape(-1)  # where the user built it (copied across devices below)
            self.comm.broadcast(full, src=0)  # every rank starts from rank 0's values
            off, n = layout.offsets[i], layout.numels[i]
            self.flat[off : off + n].copy_(full)
            if self.owns(i):
                view = self.flat[off : off + n]
                self.muon_master[i] = view if alias else self.new_state(view, device).copy_(full)
                self.matrix_state[i] = self.new_states(self.state_specs(self.layout.groups[i]), view, device)
            bucket = layout.buckets[layout.bucket_of[i]]
            lo, hi = self.own(bucket)
            a, b = max(lo, off), min(hi, off + n)
            if not alias and a < b and bucket.index not in muon:  # the exact fp32 values of the part this rank owns
                self.master[bucket.index][a - lo : b - lo].copy_(full[a - off : b - off])
            local = local_tensor(p)  # a DTensor's own piece (see [Note: sliced parameters])
            local.data = self.flat[off : off + n].view_as(local)

    def own(self, bucket: Bucket) -> tuple[int, int]:
        """[begin, end) of this rank's slice of `bucket` in the flat buffer (all of it at stage 0)."""
        return bucket.slice_range(self.rank) if self.partitions > 1 else (bucket.start, bucket.start + bucket.numel)

    def owned_part(self, i: int) -> tuple[Bucket, int, int, int, int]:
        """Parameter i's bucket, the start `lo` of this rank's slice of it, the parameter's offset
        `off`, and [a, b): the part of the parameter inside the slice (flat-buffer elements; empty
        when a == b)."""
        off, n = self.layout.offsets[i], self.layout.numels[i]
        bucket = self.layout.buckets[self.layout.bucket_of[i]]
        lo, hi = self.own(bucket)
        a = max(lo, off)
        return bucket, lo, off, a, max(a, min(hi, off + n))

    def reduce_bucket(self, bucket: Bucket, buf: torch.Tensor, async_op: bool):
        """Sum `buf` (one whole bucket) over ranks; afterwards this rank's slice of it holds its
        share of the sum (or all of it, in stage 0). Returns the collective's handle."""
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        if self.partitions == 1 or not self.reduce.reduce_scatter:
            return self.comm.all_reduce(buf, "sum", async_op=async_op)
        if bucket.index in self.muon_buckets:  # each matrix to its owner (see [Note: Muon in buckets])
            layout = self.layout
            works = [self.comm.reduce(buf[layout.offsets[i] - bucket.start : layout.offsets[i] - bucket.start
                                          + layout.numels[i]], self.owner[i], async_op=True) for i in bucket.params]
            return _Each(works).done(async_op)
        lo, hi = bucket.slice_range(self.rank)
        return self.comm.reduce_scatter(buf[lo - bucket.start : hi - bucket.start], buf, async_op=async_op)

    # -- what the step sees -----------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        out = []
        for bucket in self.layout.buckets:
            b = bucket.index
            if b in self.muon_buckets:
                out += self._matrix_slots(bucket)
                continue
            lo, hi = self.own(bucket)
            aliased = self.master[b].data_ptr() == self.flat[lo:hi].data_ptr()
            out16 = None if aliased else self.flat[lo:hi]
            out.append(Slot(bucket.group, self.master[b], self.grads.shards[b], self.state[b],
                            self.state_specs(bucket.group), out16, index=lo))
        return out

    def _matrix_slots(self, bucket: Bucket) -> list[Slot]:
        """One slot per matrix this rank owns in a Muon bucket (see Slot)."""
        out = []
        for i in bucket.params:
            if self.owns(i):
                off, n = self.layout.offsets[i], self.layout.numels[i]
                master, view = self.muon_master[i], self.flat[off : off + n]
                out.append(Slot(bucket.group, master, self.muon_grad(i), self.matrix_state[i],
                                self.state_specs(bucket.group), None if master.data_ptr() == view.data_ptr() else view,
                                index=off, matrix=self.matrices[i]))
        return out

    def muon_grad(self, i: int) -> torch.Tensor:
        """The reduced gradient of matrix i, which this rank owns (one view object, always: offload
        knows the gradients it copies by identity)."""
        view = self._muon_grads.get(i)
        if view is None:
            if isinstance(self.grads, FlatGradients):
                off = self.layout.offsets[i]
                view = self.grads.flat[off : off + self.layout.numels[i]]
            else:
                at = self.muon_pos[i]
                view = self.grads.shards[self.layout.bucket_of[i]][at : at + self.layout.numels[i]]
            self._muon_grads[i] = view
        return view

    def final_grads(self, bucket: Bucket) -> list[torch.Tensor]:
        """The gradient shards that are final once `bucket` is reduced (for `grad_final`)."""
        if bucket.index in self.muon_buckets:
            return [self.muon_grad(i) for i in bucket.params if self.owns(i)]
        return [self.grads.shards[bucket.index]]

    def reduce_gradients(self, communicate: bool = True) -> None:
        """See GradPath.reduce."""
        self.grads.reduce(communicate)

    def norm_is_partitioned(self) -> bool:
        return self.partitions > 1

    def out16_on_host(self) -> bool:
        return False

    def publish(self) -> None:
        if self.partitions > 1:
            layout, works = self.layout, []
            for bk in layout.buckets:
                if bk.index in self.muon_buckets:  # each matrix from its owner (see [Note: Muon in buckets])
                    works += [self.comm.broadcast(self.flat[layout.offsets[i] : layout.offsets[i] + layout.numels[i]],
                                                  self.owner[i], async_op=True, label="broadcast_params")
                              for i in bk.params]
                else:
                    works.append(self.comm.all_gather(self.flat[bk.start : bk.start + bk.numel],
                                                      self.flat[slice(*self.own(bk))], async_op=True))
            for w in works:
                w.wait()

    def zero_grads(self) -> None:
        self.grads.zero()

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        i = self._index.get(param)
        if i is None or (i in self.matrices and not self.owns(i)):
            return None
        if i in self.matrices:
            return self.muon_grad(i)
        bucket, lo, _, a, b = self.owned_part(i)
        return self.grads.shards[bucket.index][a - lo : b - lo] if a < b else None

    def memory_parts(self) -> tuple[dict[str, list[torch.Tensor]], set[str]]:
        return {"params": [self.flat], "grads": self.grads.buffers(),
                "fp32_master": self.master + list(self.muon_master.values()),
                "optimizer_states": [t for state in [*self.state, *self.matrix_state.values()] for t in state.values()]
                }, set()

    # -- checkpoints ----------------------------------------------------------------------------------

    def param_chunks(self, param: nn.Parameter, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        i = self._index.get(param)
        if i is None:  # frozen: replicated on every rank, written by rank 0
            whole = local_tensor(param).detach().reshape(-1)
            return [("model", 0, whole)] if not saving or self.comm.rank == 0 else []
        if i in self.matrices:
            return self._matrix_chunks(i, saving)
        bucket, lo, off, a, b = self.owned_part(i)
        n = self.layout.numels[i]
        out = []
        if saving and (self.partitions > 1 or self.comm.rank == 0):
            out.append(("model", a - off, self.flat[a:b]))  # this rank's slice (stage 0: rank 0 writes all)
        elif not saving:
            out.append(("model", 0, self.flat[off : off + n]))  # every rank holds the whole parameter
        if saving and self.partitions == 1 and self.comm.rank != 0:
            return out
        k = bucket.index
        out.append(("master", a - off, self.master[k][a - lo : b - lo]))
        for spec in saved_specs(self.state_specs(bucket.group)):
            view = self.state_view(k, spec, self.state[k])
            if spec.per == "element":
                out.append((spec.name, a - off, view[a - lo : b - lo]))
            elif a < b and (a == off or not saving):  # a scalar: written with the parameter's first element
                out.append((spec.name, 0, view))
        return out

    def _matrix_chunks(self, i: int, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        """A Muon matrix's chunks: whole, from (or into) its owner; every rank reads the model."""
        off, n = self.layout.offsets[i], self.layout.numels[i]
        writes = self.owns(i) if self.partitions > 1 else self.comm.rank == 0
        out = [("model", 0, self.flat[off : off + n])] if writes or not saving else []
        if (writes if saving else self.owns(i)):
            out.append(("master", 0, self.muon_master[i]))
            specs = saved_specs(self.state_specs(self.layout.groups[i]))
            out += [(spec.name, 0, self.state_view(("matrix", i), spec, self.matrix_state[i])) for spec in specs]
        return out

    def grad_piece(self, param: nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        return self.grads.piece(self._index[param])

    # -- user code changing parameters --------------------------------------------------------------

    def load_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """The master's part of `param` takes `value` exactly (torch then writes the 16-bit param)."""
        i = self._index.get(param)
        if i is None:
            return None
        if i in self.matrices:
            master = self.muon_master.get(i)
            if master is not None and master.data_ptr() != self.flat[self.layout.offsets[i]].data_ptr():
                master.copy_(value.detach().reshape(-1))
            return None
        bucket, lo, off, a, b = self.owned_part(i)
        master = self.master[bucket.index]
        if a < b and master.data_ptr() != self.flat[slice(*self.own(bucket))].data_ptr():
            master[a - lo : b - lo].copy_(value.detach().reshape(-1)[a - off : b - off])
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
        s.comm.tagged(Tag.BUCKET_REDUCE, b, bucket.numel, f"stage 2, gradient reduction of bucket {b}")
        staging = self._staging_for(b)  # a bucket without any gradient on this rank contributes zeros
        self._work[b] = s.reduce_bucket(bucket, staging, async_op=s.reduce.overlap_comm)

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
        for grad in s.final_grads(s.layout.buckets[b]):
            s.grad_final(grad)

    def recover(self) -> None:
        """Forget what a backward that raised left behind (see [Note: gradient readiness])."""
        if self.readiness.recover():
            for staging in self._staging.values():
                self.storage.gauges.reduce_buffers.sub(staging.untyped_storage().nbytes())
            self._staging.clear()

    def reduce(self, communicate: bool = True) -> None:
        """Nothing is owed at the step: every bucket was reduced during backward."""

    def piece(self, i: int) -> tuple[int, torch.Tensor, bool]:
        s = self.storage
        if i in s.matrices:  # whole on its owner, nothing elsewhere
            shard = self.shards[s.layout.bucket_of[i]]
            return 0, s.muon_grad(i) if s.owns(i) else shard[:0], True
        bucket, lo, off, a, b = s.owned_part(i)
        return a - off, self.shards[bucket.index][a - lo : b - lo], True

    def zero(self) -> None:
        self.recover()
        for s in self.shards:
            s.zero_()

    def buffers(self) -> list[torch.Tensor]:
        return self.shards


class _Each:
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

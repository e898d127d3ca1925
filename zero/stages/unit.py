"""Stage 3 storage: parameters grouped into units that are gathered and freed together.

[Note: parameter units]
A `ParamUnit` is a set of parameters gathered and released together, usually those of one
transformer block. Its rank-local storage is flat: the shards of its parameters back to back
(see [Note: parameter shards] in zero/partition/shards.py), trainable ones first and grouped by
param group, so each group's range gets one Adam call and every rank's shard has the same length
S. Gathering is one all-gather of S elements per rank into an (N, S) buffer whose columns
[off_p, off_p + s_p) hold parameter p's rows; one `torch.split_with_sizes_copy` moves every
parameter's (N, s_p) block into the unit's full buffer, in which each parameter is a contiguous
view. A unit of one parameter is gathered into its full buffer directly. Reducing gradients is
the reverse: one `torch._chunk_cat` lays the gradients out as (N, S_trainable) in the reduce
dtype, and one reduce-scatter leaves every rank the sum of its own shards.

[Note: freeing gathered parameters]
Autograd saves views of the parameters that backward needs (F.linear saves `weight.t()`), and a
saved view keeps its storage alive: swapping `param.data` frees nothing. So a unit owns one
full-size buffer for its whole life, and each parameter's full value is a view into it, made once.
Releasing the unit resizes that buffer's storage to 0 bytes, which frees the memory, also under
every view autograd saved. Gathering resizes the same storage back and writes into it, so a saved
view reads the new values when backward uses it (the runtime gathers the unit again before its
backward; see [Note: stage 3 hooks]). Between uses `param.data` is an empty tensor, so nothing
reads the freed storage by accident. This is FSDP2's [Note: FSDP and autograd] (in torch's
torch/distributed/fsdp/_fully_shard/_fsdp_param.py) applied to units.

A world of one without parameter offload needs none of this: the shard is the whole parameter,
and the parameters stay views into the shard.

A unit's parameters are divided over its placement's shard group (see [Note: placements] in
zero/stages/placement.py): its reduce-scatter and all-gather are the placement's. Parameters whole
on an owner (Muon's matrices) are laid out last and handled apart; see [Note: owned parameters in
units] in zero/stages/owned.py.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zero.parallel.comm import Comm
from zero.parallel.sliced import local_grad, local_tensor
from zero.partition.shards import ZeroParamStatus, gather_param, mark_ds, take_shard
from zero.stages.memory import Gauges
from zero.stages.owned import OwnedParams
from zero.stages.placement import Owned, Sharded
from zero.stages.policies import Precision
from zero.state import StateSpecs, saved_specs

if TYPE_CHECKING:
    from zero.offload.param_swap import ParamSwap


class ShardedState(enum.Enum):
    SHARDED = "sharded"  # the full buffer's storage is freed; parameters' .data are empty
    GATHERING = "gathering"  # an all-gather is in flight (a prefetch)
    GATHERED = "gathered"  # parameters are views into the full buffer


@dataclass
class GroupRange:
    """One param group's part of a unit's shard, [lo, hi), with its optimizer tensors."""

    group: int
    lo: int
    hi: int
    master: torch.Tensor
    state: dict[str, torch.Tensor]  # as the group's rule declares it (see [Note: declared state] in zero/optim/rules.py)
    grad: torch.Tensor


@dataclass
class _InFlight:
    """A collective of this unit that may still be running, and the buffers it uses."""

    work: object
    buffer: torch.Tensor | None  # all-gather output or reduce-scatter input (counted in the comm gauge)
    source: torch.Tensor | None = None  # the shard staged onto the device (offload_param)
    mine: torch.Tensor | None = None  # a reduce-scatter's output: this rank's row
    owned: list = dataclasses.field(default_factory=list)  # the owned parameters' collectives (zero/stages/owned.py)
    keep: bool = True  # an all-gather from every rank's shard: hpZ keeps a secondary shard of it


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


class ParamUnit:
    """Parameters gathered and released together; see [Note: parameter units].

    Args:
        index: position among the engine's units (its tag in collectives).
        name: module path, for messages ("" is the root module).
        params: the parameters, each described by `param._zero` (see describe_shard).
        groups: the optimizer param-group index of each parameter, or -1 for a frozen one.
        placement: how its parameters lie over the ranks (a Sharded placement; see [Note:
            placements] in zero/stages/placement.py): its shard group divides them, its
            reduce-scatter and all-gather are the unit's.
        precision: parameter, reduce and gradient dtypes.
        device: where the model computes (full parameters, gradients).
        local_shard: gives this rank's shard of a parameter (see take_local_shard); its values,
            usually fp32, also start the fp32 master.
        new_master: makes the master of a piece of the shard (ParamStorage.new_master).
        new_states: makes the optimizer state of a master, given its param group
            (ParamStorage.new_states with the group's declared state).
        state_specs: the state each param group keeps (see ParamStorage).
        alias_master: state beside the shard in the shard's own dtype (fp32, or bf16 with a bf16
            master): the shard is its own master.
        persistent: gathered once and never released (small parameters).
        offload_param: the shard lives in host memory; it is staged onto the device to gather.
        host_empty: allocates that host shard (pinned when asked).
        gauges: where the bytes of full buffers, all-gather and reduce buffers are measured.
        owned: the Owned placement of the parameters kept whole on owners (see [Note: owned
            parameters in units] in zero/stages/owned.py), or None.
        new_state: makes a zero fp32 tensor shaped like a tensor, where optimizer state lives (in
            host memory under optimizer offload; ParamStorage.new_state).
        host16: allocates an owner's host copy of a matrix in the training dtype (offload; pinned
            when asked).
        swap: the shard lives on disk in this swap (see [Note: parameters on NVMe] in
            zero/offload/param_swap.py), or None.
        hpz: the group of this rank's node that keeps a secondary shard of the gathered unit from
            forward to backward (ZeRO++ hpZ; see [Note: hpZ]), or None.
        quantized: its all-gather sends int8 weight blocks (ZeRO++ qwZ; see [Note: int8 weight
            blocks] in zero/zeropp/blocks.py); the shard and its master stay exact.
    """

    def __init__(self, index: int, name: str, params: list[nn.Parameter], groups: list[int], placement: Sharded,
                 precision: Precision, device: torch.device, local_shard: Callable[[nn.Parameter], torch.Tensor],
                 new_master: Callable[[torch.Tensor], torch.Tensor],
                 new_states: Callable[[int, torch.Tensor], dict[str, torch.Tensor]], state_specs: StateSpecs, *,
                 alias_master: bool, persistent: bool,
                 offload_param: bool, host_empty: Callable[..., torch.Tensor], gauges: Gauges,
                 owned: Owned | None = None,
                 new_state: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 host16: Callable[[int], torch.Tensor] | None = None, swap: ParamSwap | None = None,
                 hpz: Comm | None = None, quantized: bool = False):
        comm = placement.comm
        self.quantized = quantized and not persistent  # its all-gather sends int8 blocks (ZeRO++ qwZ)
        self.index, self.name, self.placement, self.comm, self.device = index, name, placement, comm, device
        self.dtype, self.reduce_dtype = precision.param, precision.reduce
        self.persistent, self.offload_param, self.swap = persistent, offload_param, swap
        self.hpz = hpz if hpz is not None and hpz.world_size > 1 and not persistent else None
        self.secondary: torch.Tensor | None = None  # see [Note: hpZ]
        self.gauges = gauges
        self.specs = lambda g: saved_specs(state_specs(g))  # what checkpoints hold of a group's state
        whole = {p for p in params if owned is not None and owned.matrix(p) is not None}
        # trainable first, by group; owned parameters last (see [Note: owned parameters in units])
        order = sorted(range(len(params)), key=lambda i: (params[i] in whole, groups[i] < 0, groups[i]))
        self.params = [params[i] for i in order]
        self.groups = [groups[i] for i in order]
        self.trainable = [p for p, g in zip(self.params, self.groups) if g >= 0]
        self.has_frozen = len(self.trainable) < len(self.params)
        world = comm.world_size
        info = [p._zero for p in self.params]
        self.split_sizes = [z.shard_numel for z in info]
        self.offsets = [sum(self.split_sizes[:i]) for i in range(len(info))]
        self.numel = sum(self.split_sizes)  # S
        self.aliased = world == 1 and not offload_param  # the shard is the parameter (see the notes above)
        self.matrices = OwnedParams(self, owned, [i for i, p in enumerate(self.params) if p in whole],
                                    new_state or (lambda like: torch.zeros(like.shape, device=device)), new_states,
                                    host16 or (lambda n: host_empty(n, dtype=self.dtype)))
        if self.matrices:  # Muon's whole matrices come from their owners: such a unit keeps no secondary shard
            self.hpz = None
        self.gathered = len(self.params) - len(whole)  # the parameters the all-gather carries, first
        self.gather_numel = sum(self.split_sizes[: self.gathered])
        self.trainable_numel = sum(self.split_sizes[: len(self.trainable) - len(whole)])  # reduce-scattered
        self.full_numel = world * self.numel  # gathered elements (what stage3_max_live_parameters counts)

        with torch.no_grad():
            self.shard = swap.new(self.numel, self.dtype) if swap is not None else \
                host_empty(self.numel, dtype=self.dtype) if offload_param else \
                torch.empty(self.numel, dtype=self.dtype, device=device)
            self.ranges: list[GroupRange] = []
            for g in sorted({g for i, g in enumerate(self.groups) if g >= 0 and i not in self.matrices}):
                members = [i for i, gi in enumerate(self.groups) if gi == g]
                lo, hi = self.offsets[members[0]], self.offsets[members[-1]] + self.split_sizes[members[-1]]
                master = new_master(self.shard[lo:hi])
                self.ranges.append(GroupRange(g, lo, hi, master, new_states(g, master),
                                              torch.zeros(hi - lo, dtype=precision.grad, device=device)))
            for i, (p, z, off) in enumerate(zip(self.params, info, self.offsets)):  # one parameter at a time
                local = local_shard(p)
                self.shard[off : off + z.shard_numel].copy_(local)
                if i in self.matrices:
                    self.matrices.take_initial(i, gather_param(local, z.numel, comm), precision.grad)
                r = next((r for r in self.ranges if r.lo <= off < r.hi), None)
                if r is not None and not alias_master:  # from the shard's own (fp32) values, not their rounding
                    r.master[off - r.lo : off - r.lo + z.shard_numel].copy_(local)
                z.unit, z.offset = self, off
                del local

        for p, z, off in zip(self.params, info, self.offsets):  # see [Note: ds attributes]
            mark_ds(p, z, self.shard[off : off + z.shard_numel], persistent)
        # the full buffer and the parameters' views into it, made once (see [Note: freeing gathered parameters])
        self.full = self.shard if self.aliased else torch.empty(self.full_numel, dtype=self.dtype, device=device)
        self._views = [self.full[world * off : world * off + z.numel].view(z.shape) for z, off in zip(info, self.offsets)]
        self._blocks = [self.full[world * off : world * (off + s)].view(world, s)
                        for off, s in zip(self.offsets[: self.gathered], self.split_sizes[: self.gathered])]
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        self._gather: _InFlight | None = None
        self._reduce: _InFlight | None = None
        if self.aliased:
            self.state = ShardedState.GATHERED
            self._show()
        else:
            self.state = ShardedState.SHARDED
            self.full.untyped_storage().resize_(0)
            self._hide()

        # training state, owned by the stage-3 runtime (see [Note: stage 3 hooks])
        self.forward_uses = 0  # forwards of this unit's modules now running (nested calls count)
        self.needed_in_backward = False  # backward reached it and still needs its values
        self.grads_done = False  # its gradients were reduced in this backward
        self.inputs_done = False  # a backward of its module produced the gradients of its inputs
        self.trace_pos = -1  # where the runtime last recorded its use in the current pass
        self.leaf = False  # marked with set_z3_leaf_modules (see [Note: leaf units] in stage3.py)

    def __repr__(self) -> str:
        return f"ParamUnit({self.index}, '{self.name or '<root>'}', {len(self.params)} params, {self.full_numel} elements)"

    @property
    def label(self) -> str:
        return repr(self.name or "<root>")

    @property
    def resident(self) -> bool:
        """Never released: persistent, or a world of one where the shard is the parameter."""
        return self.persistent or self.aliased

    # -- storage ------------------------------------------------------------------------------------

    def _show(self) -> None:
        for p, view in zip(self.params, self._views):
            local_tensor(p).data = view
            p.ds_status = ZeroParamStatus.AVAILABLE

    def _hide(self) -> None:
        for p in self.params:
            local_tensor(p).data = self._empty
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE

    def _allocate(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._full_nbytes)
            if not self.persistent:  # persistent parameters are model state, counted as such
                self.gauges.gathered.add(self._full_nbytes)

    def held_bytes(self) -> int:
        """Bytes the full buffer holds now, beyond the shard."""
        return 0 if self.aliased else self.full.untyped_storage().nbytes()

    def start_gather(self) -> None:
        """Issue the all-gather of this unit (asynchronously): from the secondary shards of this
        rank's node while they are kept (see [Note: hpZ]), else from every rank's shard."""
        assert self.state is ShardedState.SHARDED, self
        if self.secondary is not None:
            self._allocate()
            with record_function(f"zero::gather_unit_in_node[{self.name}]"):
                work = self.hpz.all_gather(self.full, self.secondary, async_op=True, label="all_gather (hpZ)")
            self._gather = _InFlight(work, None, keep=False)
            self.state = ShardedState.GATHERING
            return
        shard = self.shard
        if self.swap is not None and self.gathered:  # on disk: the copy read into a host buffer (an I/O
            shard = self.swap.take(self)  # error raises here, leaving the unit as it was)
        self.state = ShardedState.GATHERING
        if shard.device != self.device:  # offload_param on a GPU: bring the shard to the device
            with record_function(f"zero::fetch_offloaded_shard[{self.name}]"):
                host, shard = shard, torch.empty(self.numel, dtype=self.dtype, device=self.device)
                shard.copy_(host, non_blocking=True)
        world, n = self.comm.world_size, self.gather_numel
        with record_function(f"zero::gather_unit[{self.name}]"):
            if not self.gathered:
                self._gather = _InFlight(None, None)
            elif world == 1 or self.gathered == 1:  # the output layout is the full buffer's own
                self._allocate()
                work = self.placement.all_gather(self.full[: world * n], shard[:n], async_op=True,
                                                 quantized=self.quantized)
                self._gather = _InFlight(work, None, source=shard)
            else:
                buffer = torch.empty(world * n, dtype=self.dtype, device=self.device)
                self.gauges.gather_buffers.add(_nbytes(buffer))
                self._gather = _InFlight(self.placement.all_gather(buffer, shard[:n], async_op=True,
                                                                   quantized=self.quantized), buffer, source=shard)
            if self.matrices:
                self._allocate()
                self._gather.owned = self.matrices.start_gather()

    def finish_gather(self, wait: Callable[[object], None]) -> None:
        """Wait for the all-gather (`wait(work)`), write the full buffer and show the parameters."""
        assert self.state is ShardedState.GATHERING, self
        inflight, self._gather = self._gather, None
        if inflight.work is not None:
            wait(inflight.work)
        inflight.source = None  # the staged shard (offload_param) is not needed any more
        if self.swap is not None and self.gathered and inflight.keep:  # (not a gather of hpZ's secondary shards)
            self.swap.give_back(self, copied=self.device.type == "cuda")
        if inflight.buffer is not None:
            with record_function(f"zero::unshard_unit[{self.name}]"):
                self._allocate()
                rows = inflight.buffer.view(self.comm.world_size, self.gather_numel)
                torch.split_with_sizes_copy(rows, self.split_sizes[: self.gathered], dim=1, out=self._blocks)
            self.gauges.gather_buffers.sub(_nbytes(inflight.buffer))
        self.matrices.finish_gather(inflight.owned, wait)
        if inflight.keep and self.hpz is not None and torch.is_grad_enabled():  # for backward, in the node
            part = self.full_numel // self.hpz.world_size
            self.secondary = self.full[self.hpz.rank * part : (self.hpz.rank + 1) * part].clone()
            self.gauges.secondary.add(_nbytes(self.secondary))
        self._show()
        self.state = ShardedState.GATHERED

    def drop_secondary(self) -> None:
        """Forget the secondary shard (the end of a backward, a step, a change of the shard)."""
        if self.secondary is not None:
            self.gauges.secondary.sub(_nbytes(self.secondary))
            self.secondary = None

    def mark_updated(self, masters_written: bool = False) -> None:
        """See OwnedParams.mark_updated."""
        self.matrices.mark_updated(masters_written)

    def freshen(self) -> None:
        """See OwnedParams.freshen."""
        self.matrices.freshen()

    def free(self) -> None:
        """Free the full buffer's storage; only the shard remains (see [Note: freeing gathered
        parameters])."""
        assert self.state is ShardedState.GATHERED and not self.resident, self
        self._hide()
        self.gauges.gathered.sub(self.full.untyped_storage().nbytes())
        self.full.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    def refresh(self, wait: Callable[[object], None]) -> None:
        """Persistent units: gather the updated shards into the (still allocated) full buffer."""
        if self.aliased:
            return
        self.state = ShardedState.SHARDED
        self.start_gather()
        self.finish_gather(wait)

    def param_chunks(self, p: nn.Parameter, view: Callable, saving: bool = True
                     ) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's pieces of `p`: its shard (without padding) and, if trainable, the master's
        and the optimizer state's parts (see ParamStorage.param_chunks); `view(key, spec, state)`
        gives what a checkpoint reads and writes of one state (StateStore.view)."""
        i = next(i for i, q in enumerate(self.params) if q is p)
        z, off, s = p._zero, self.offsets[i], self.split_sizes[i]
        if saving and not self.placement.writes:  # a replica writes what this rank holds
            return []
        if i in self.matrices:
            return self.matrices.chunks(i, saving, view, self.specs)
        start = self.comm.rank * s
        n = max(0, min(z.numel, start + s) - start)
        out = [("model", start, self.shard[off : off + n])]
        k, r = next(((k, r) for k, r in enumerate(self.ranges) if r.lo <= off < r.hi), (None, None))
        if r is not None:
            out.append(("master", start, r.master[off - r.lo : off - r.lo + n]))
            for spec in self.specs(r.group):
                t = view((self.index, k), spec, r.state)
                if spec.per == "element":
                    out.append((spec.name, start, t[off - r.lo : off - r.lo + n]))
                elif n and (start == 0 or not saving):  # a scalar: written with the parameter's first element
                    out.append((spec.name, 0, t))
        return out

    def grad_piece(self, p: nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        """This rank's part of the reduced gradient of trainable `p` (see ShardedOptimizer.grad_piece)."""
        i = next(i for i, q in enumerate(self.params) if q is p)
        z, off, s = p._zero, self.offsets[i], self.split_sizes[i]
        if i in self.matrices:
            return self.matrices.grad_piece(i)
        start = self.comm.rank * s
        n = max(0, min(z.numel, start + s) - start)
        r = next((r for r in self.ranges if r.lo <= off < r.hi), None)
        if r is None:  # none of `p` on this rank
            return start, torch.empty(0, dtype=self.ranges[0].grad.dtype, device=self.device), True
        return start, r.grad[off - r.lo : off - r.lo + n], True

    @torch.no_grad()
    def load_param(self, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor | None:
        """Set `p` to `value` (its full value): this rank's shard, its fp32 master and, while the
        unit is gathered, the full buffer. Returns the empty tensor torch should copy instead
        while the unit is released."""
        i = next(i for i, q in enumerate(self.params) if q is p)
        off, n = self.offsets[i], self.split_sizes[i]
        local = take_shard(value.detach().to(self.shard.device), self.comm.rank, self.comm.world_size)
        self.shard[off : off + n].copy_(local)
        if self.swap is not None:  # a read ahead of the old values is stale
            self.swap.forget(self)
        self.drop_secondary()  # and so is a secondary shard
        if i in self.matrices:
            self.matrices.load(i, value)
        r = next((r for r in self.ranges if r.lo <= off < r.hi), None)
        if r is not None and r.master.data_ptr() != self.shard[r.lo : r.hi].data_ptr():
            r.master[off - r.lo : off - r.lo + n].copy_(local)
        if self.state is ShardedState.GATHERED:
            return None  # torch copies `value` into the gathered view
        return local_tensor(p).data

    # -- gradients ----------------------------------------------------------------------------------

    def start_reduce(self, predivide: float) -> None:
        """Lay the trainable parameters' gradients out as (N, S_trainable) in the reduce dtype and
        issue one reduce-scatter; a missing gradient counts as zero. Frees `param.grad`."""
        world, rank = self.comm.world_size, self.comm.rank
        grads = []
        for p in self.trainable:
            g = local_grad(p)
            p.grad = None
            grads.append(g.reshape(-1) if g is not None else torch.zeros(p._zero.numel, dtype=self.dtype, device=self.device))
        sent = []  # owned parameters' gradients to their owners, in place of their share of the reduce-scatter
        owned = len(self.matrices.params)
        if owned:  # the last trainable parameters
            grads, whole = grads[:-owned], grads[-owned:]
            sent = self.matrices.start_reduce(whole, predivide)
        if not grads:
            self._reduce = _InFlight(None, None, owned=sent)
            return
        with record_function(f"zero::pack_grads[{self.name}]"):
            send = torch.empty(world * self.trainable_numel, dtype=self.reduce_dtype, device=self.device)
            torch._chunk_cat(grads, 0, world, out=send.view(world, self.trainable_numel))
            del grads
            if predivide != 1.0:
                send.div_(predivide)
        mine = send[rank * self.trainable_numel : (rank + 1) * self.trainable_numel]
        self.gauges.reduce_buffers.add(_nbytes(send))
        work = self.placement.reduce_scatter(mine, send, async_op=True,  # the replicas sum once, at the step
                                             replicas=not self.placement.defers_replicas)
        self._reduce = _InFlight(work, send, mine=mine, owned=sent)

    def finish_reduce(self, wait: Callable[[object], None]) -> list[torch.Tensor]:
        """Wait for the reduce-scatter and add this rank's part to the gradient shards.

        Returns:
            The gradient shards it added to.
        """
        inflight, self._reduce = self._reduce, None
        if inflight.work is not None:
            wait(inflight.work)
            for r in self.ranges:
                r.grad.add_(inflight.mine[r.lo : r.hi])
            self.gauges.reduce_buffers.sub(_nbytes(inflight.buffer))
        return [r.grad for r in self.ranges] + self.matrices.finish_reduce(inflight.owned, wait)

    def zero_grads(self) -> None:
        for r in self.ranges:
            r.grad.zero_()
        self.matrices.zero_grads()
        for p in self.params:
            p.grad = None

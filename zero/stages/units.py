"""Stage 3 storage: every parameter sharded across ranks, grouped into units that gather together.

[Note: parameter shards]
A parameter of n elements is padded to N*s elements, s = ceil(n / N), and rank r keeps elements
[r*s, (r+1)*s) of its flattened value: its shard (`ShardedParam`). The `nn.Parameter` object
stays in the module, but between uses its `.data` is an empty tensor; the shape lives in
`param._zero.shape`. Sharding per parameter (as FSDP2 and DeepSpeed do) lets `zero.Init`,
`GatheredParameters`, external parameters and consolidated saving all work on one parameter at
a time.

[Note: parameter units]
A `ParamUnit` is a set of parameters that are gathered and released together, usually those of
one transformer block. Its rank-local storage is flat: the shards of its parameters back to back,
trainable ones first and grouped by param group, so each group's range gets one Adam call and
every rank's shard has the same length S. Gathering a unit is one all-gather of S elements per
rank into an (N, S) buffer whose column range [off_p, off_p + s_p) holds parameter p's rows;
one strided copy per parameter turns that into the unit's full buffer, in which each parameter
is a contiguous view. Reducing gradients is the reverse: each gradient is copied into the same
(N, S_trainable) layout and one reduce-scatter leaves every rank the sum of its own shards.

A world of one needs neither collective nor copy: the shard is the whole parameter, so the
parameters are views into the shard itself.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from zero.comm import Comm


def shard_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


@dataclass
class ShardedParam:
    """Bookkeeping attached to a stage-3 parameter as `param._zero`.

    Args:
        shape: the parameter's full shape.
        numel: its element count.
        shard_numel: s, the elements each rank keeps.
        local: this rank's shard while no unit owns it (under `zero.Init`, before `initialize`).
        unit: the unit that owns it once the engine exists.
        offset: where its shard starts in the unit's flat storage.
    """

    shape: torch.Size
    numel: int
    shard_numel: int
    local: torch.Tensor | None = None
    unit: "ParamUnit | None" = None
    offset: int = 0
    name: str = ""

    def shard(self) -> torch.Tensor:
        """This rank's shard (s elements), wherever it lives."""
        if self.unit is not None:
            return self.unit.shard16[self.offset : self.offset + self.shard_numel]
        return self.local


def take_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's padded slice of a full tensor, as a new contiguous 1-D tensor."""
    s = shard_numel(full.numel(), world_size)
    flat = full.detach().reshape(-1)
    out = torch.zeros(s, dtype=full.dtype, device=full.device)
    lo, hi = min(rank * s, flat.numel()), min((rank + 1) * s, flat.numel())
    out[: hi - lo].copy_(flat[lo:hi])
    return out


def gather_param(shard: torch.Tensor, numel: int, comm: Comm) -> torch.Tensor:
    """The full flattened value of one parameter from every rank's shard (all ranks call it)."""
    if comm.world_size == 1:
        return shard[:numel].clone()
    out = torch.empty(comm.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard.contiguous())
    return out[:numel]


class UnitState(enum.Enum):
    SHARDED = "sharded"  # parameters' .data are empty
    GATHERING = "gathering"  # an all-gather is in flight (a prefetch)
    GATHERED = "gathered"  # parameters are views into `full`


@dataclass
class GroupRange:
    """One param group's part of a unit's shard: [lo, hi), with its optimizer tensors."""

    group: int
    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor


@dataclass
class _InFlight:
    work: object
    buffer: torch.Tensor
    tag_work: object = None
    tags: torch.Tensor | None = None
    mine: torch.Tensor | None = None  # a reduce-scatter's own slice


class ParamUnit:
    """Parameters gathered and released together; see [Note: parameter units].

    Args:
        index: position among the engine's units (also its tag in collectives).
        name: module path, used in messages ("" is the root module).
        params: the parameters, each already carrying `param._zero` (a ShardedParam).
        groups: the optimizer param-group index of each parameter, or -1 for a frozen one.
        comm: the data-parallel group.
        dtype: the 16-bit (or fp32) dtype parameters are used in.
        grad_dtype: dtype of the gradient shard (fp32 when accumulating micro-batches).
        comm_dtype: dtype gradients are reduce-scattered in.
        master_shards: fp32 shard of each trainable parameter (its exact original values).
        device: where the model computes (gathered parameters, gradients).
        new_state: makes an fp32 optimizer-state tensor (where the optimizer keeps its state).
        alias_master: fp32 training with state beside the shard: the shard is its own master.
        persistent: never released (small parameters kept whole on every rank).
        offload_param: keep the 16-bit shard in host memory; stage it onto the device to gather.
        pin_memory: pin that host shard (with CUDA).
    """

    def __init__(self, index: int, name: str, params: list[torch.nn.Parameter], groups: list[int], comm: Comm,
                 dtype: torch.dtype, grad_dtype: torch.dtype, comm_dtype: torch.dtype,
                 master_shards: dict[torch.nn.Parameter, torch.Tensor], device: torch.device, new_state,
                 alias_master: bool = False, persistent: bool = False, offload_param: bool = False,
                 pin_memory: bool = False):
        self.index, self.name, self.comm, self.dtype, self.comm_dtype = index, name, comm, dtype, comm_dtype
        self.persistent = persistent
        self.device = device
        self.offload_param = offload_param
        self.on_final = None  # called with each gradient shard once it is reduced
        order = sorted(range(len(params)), key=lambda i: (groups[i] < 0, groups[i]))  # trainable first, by group
        self.params = [params[i] for i in order]
        self.groups = [groups[i] for i in order]
        self.world = comm.world_size
        offsets, at = [], 0
        for p in self.params:
            offsets.append(at)
            at += p._zero.shard_numel
        self.numel = at  # S
        self.trainable_numel = sum(p._zero.shard_numel for p, g in zip(self.params, self.groups) if g >= 0)
        self.full_numel = self.world * self.numel  # gathered elements (counted against max_live)

        self.shard16 = torch.empty(self.numel, dtype=dtype, device="cpu" if offload_param else device)
        if offload_param and pin_memory and torch.cuda.is_available():
            self.shard16 = self.shard16.pin_memory()
        for p, off in zip(self.params, offsets):
            info: ShardedParam = p._zero
            self.shard16[off : off + info.shard_numel].copy_(info.shard())
            info.unit, info.offset, info.local = self, off, None

        self.ranges: list[GroupRange] = []
        for g in sorted({g for g in self.groups if g >= 0}):
            members = [i for i, gi in enumerate(self.groups) if gi == g]
            lo, hi = offsets[members[0]], offsets[members[-1]] + self.params[members[-1]]._zero.shard_numel
            master = self.shard16[lo:hi] if alias_master else new_state(self.shard16[lo:hi], device)
            for i in members:
                p, off = self.params[i], offsets[i]
                src = master_shards.get(p)
                master[off - lo : off - lo + p._zero.shard_numel].copy_(src if src is not None else self.shard16[off : off + p._zero.shard_numel])
            self.ranges.append(GroupRange(g, lo, hi, master, new_state(master, device), new_state(master, device),
                                          torch.zeros(hi - lo, dtype=grad_dtype, device=device)))
        self.offsets = offsets

        self.state = UnitState.SHARDED
        self.full: torch.Tensor | None = None
        self.users = 0  # forward/backward uses currently running
        self._gather: _InFlight | None = None
        self._reduce: _InFlight | None = None
        self._empty = torch.empty(0, dtype=dtype, device=device)
        for p in self.params:
            p.data = self._empty

    def __repr__(self) -> str:
        return f"ParamUnit({self.index}, '{self.name or '<root>'}', {len(self.params)} params, {self.full_numel} elements)"

    # -- gather / release -----------------------------------------------------------------------

    def start_gather(self, tag: torch.Tensor | None) -> None:
        """Issue the all-gather of this unit (asynchronously)."""
        assert self.state is UnitState.SHARDED, self
        self.state = UnitState.GATHERING
        shard = self.shard16
        if self.offload_param:  # the shard lives on the host: bring this rank's part to the device
            with record_function(f"zero::fetch_offloaded_shard[{self.name}]"):
                shard = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                shard.copy_(self.shard16, non_blocking=True)
        if self.world == 1:
            self._gather = _InFlight(None, shard)
            return
        with record_function(f"zero::gather_unit[{self.name}]"):
            buffer = torch.empty(self.full_numel, dtype=self.dtype, device=self.device)
            work = self.comm.all_gather(buffer, shard, async_op=True)
            inflight = _InFlight(work, buffer)
            if tag is not None:
                inflight.tags = torch.empty(self.world * tag.numel(), dtype=tag.dtype, device=tag.device)
                inflight.tag_work = self.comm.all_gather(inflight.tags, tag, async_op=True, label="unit_tags")
            self._gather = inflight

    def finish_gather(self, check_tags, describe) -> None:
        """Wait for the all-gather and point every parameter at its full value."""
        assert self.state is UnitState.GATHERING, self
        inflight, self._gather = self._gather, None
        if self.world == 1:
            full = inflight.buffer
            for p, off in zip(self.params, self.offsets):
                p.data = full[off : off + p._zero.numel].view(p._zero.shape)
        else:
            self.comm.wait_for(inflight.tag_work, describe)
            if inflight.tags is not None:
                check_tags(inflight.tags)
            self.comm.wait_for(inflight.work, describe)
            with record_function(f"zero::unshard_unit[{self.name}]"):
                rows = inflight.buffer.view(self.world, self.numel)
                full = torch.empty(self.full_numel, dtype=self.dtype, device=self.device)
                at = 0
                for p, off in zip(self.params, self.offsets):
                    s = p._zero.shard_numel
                    full[at : at + self.world * s].view(self.world, s).copy_(rows[:, off : off + s])
                    p.data = full[at : at + p._zero.numel].view(p._zero.shape)
                    at += self.world * s
        self.full = full
        self.state = UnitState.GATHERED

    def release(self) -> None:
        """Drop the full parameters; only the shard remains."""
        assert self.state is UnitState.GATHERED and not self.persistent, self
        for p in self.params:
            p.data = self._empty
        self.full = None
        self.state = UnitState.SHARDED

    # -- gradients --------------------------------------------------------------------------------

    def start_reduce(self, tag: torch.Tensor | None, predivide: float) -> None:
        """Move the trainable parameters' gradients into the (N, S_trainable) layout and issue
        one reduce-scatter; missing gradients count as zero. Frees `param.grad`."""
        if self.trainable_numel == 0:
            return
        t = self.trainable_numel
        device = self.device
        with record_function(f"zero::pack_grads[{self.name}]"):
            send = torch.zeros(self.world * t, dtype=self.comm_dtype, device=device)
            rows = send.view(self.world, t)
            for p, off, g in zip(self.params, self.offsets, self.groups):
                if g < 0:
                    continue
                grad, p.grad = p.grad, None
                if grad is None:
                    continue
                s = p._zero.shard_numel
                flat = grad.reshape(-1)
                pad = self.world * s - flat.numel()
                if pad:
                    flat = torch.nn.functional.pad(flat, (0, pad))
                rows[:, off : off + s].copy_(flat.view(self.world, s))
            if predivide != 1.0:
                send.div_(predivide)
        mine = send[self.comm.rank * t : (self.comm.rank + 1) * t] if self.world > 1 else send
        work = self.comm.reduce_scatter(mine, send, async_op=True)
        inflight = _InFlight(work, send, mine=mine)
        if tag is not None and self.world > 1:
            inflight.tags = torch.empty(self.world * tag.numel(), dtype=tag.dtype, device=tag.device)
            inflight.tag_work = self.comm.all_gather(inflight.tags, tag, async_op=True, label="unit_tags")
        self._reduce = inflight

    @property
    def reducing(self) -> bool:
        return self._reduce is not None

    def finish_reduce(self, check_tags, describe) -> None:
        """Wait for the reduce-scatter and add this rank's part to the gradient shards."""
        inflight, self._reduce = self._reduce, None
        if inflight is None:
            return
        self.comm.wait_for(inflight.tag_work, describe)
        if inflight.tags is not None:
            check_tags(inflight.tags)
        self.comm.wait_for(inflight.work, describe)
        mine = inflight.mine
        for r in self.ranges:
            r.grad.add_(mine[r.lo : r.hi])
            if self.on_final is not None:
                self.on_final(r.grad)

    # -- after the optimizer step -----------------------------------------------------------------

    def refresh_persistent(self) -> None:
        """Persistent units: gather the updated shards back into the full parameters."""
        self.state = UnitState.SHARDED
        self.start_gather(None)
        self.finish_gather(lambda tags: None, lambda: f"all-gather of persistent parameters ({self.name})")

    def zero_grads(self) -> None:
        for r in self.ranges:
            r.grad.zero_()

    def state_bytes(self) -> dict[str, int]:
        def nb(t):
            return t.numel() * t.element_size()

        aliased = any(r.master.data_ptr() == self.shard16[r.lo : r.hi].data_ptr() for r in self.ranges)
        return {
            "params": nb(self.shard16),
            "persistent_full": nb(self.full) if self.persistent and self.full is not None else 0,
            "grads": sum(nb(r.grad) for r in self.ranges),
            "fp32_master": 0 if aliased else sum(nb(r.master) for r in self.ranges),
            "optimizer_states": sum(nb(r.exp_avg) + nb(r.exp_avg_sq) for r in self.ranges),
        }

"""Whole parameters on owner ranks inside a stage-3 unit: the `Owned` placement (Muon's matrices).

[Note: owned parameters in units]
An Owned parameter (a matrix Muon updates whole, zero/optim/muon.py) has one owner rank, chosen by
the placement (see [Note: placements] in zero/stages/placement.py), which keeps its fp32 master,
optimizer state and reduced gradient. A unit lays its owned parameters out last and leaves them out
of its all-gather and reduce-scatter: an owned parameter's gradient is reduced to its owner, and
gathering broadcasts it from its owner, which casts its master (or, under optimizer offload, copies
its host 16-bit copy) into the unit's full buffer. These move the bytes the parameter's share of the
unit's collectives would have moved. Every rank still keeps its 16-bit shard of each owned
parameter, as of every parameter, for checkpoints, `GatheredParameters` and `ds_tensor`: after a
step the shards are stale (`mark_updated`) until the next gather copies each rank's slice out of
the broadcast value, or `freshen` (GatheredParameters, `param.all_gather()`) broadcasts them first.
Checkpoints take an owned parameter whole from its owner's master.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zero.partition.shards import take_shard
from zero.stages.placement import Owned


@dataclass
class OwnedParam:
    """An owned parameter of a unit: on its owner its fp32 master, optimizer state and reduced
    gradient (None elsewhere)."""

    owner: int
    shape: tuple[int, int]
    group: int
    master: torch.Tensor | None = None
    state: dict[str, torch.Tensor] | None = None
    grad: torch.Tensor | None = None
    out16: torch.Tensor | None = None  # under optimizer offload: the owner's 16-bit copy in host memory
    stale: bool = False  # the ranks' 16-bit shards predate the owner's last update


class OwnedParams:
    """The owned parameters of one unit (see [Note: owned parameters in units]).

    Args:
        unit: the unit (zero/stages/unit.py): its parameters, shard, full buffer's views.
        placement: the Owned placement (owners and shapes, keyed by parameter).
        positions: the owned parameters' places among the unit's parameters (its last ones).
        new_state, new_states, host16: how the owner allocates a master, state and host copy
            (see ParamUnit).
    """

    def __init__(self, unit, placement: Owned, positions: list[int], new_state: Callable, new_states: Callable,
                 host16: Callable):
        self.unit, self.placement = unit, placement
        self.new_state, self.new_states, self.host16 = new_state, new_states, host16
        self.params = {i: OwnedParam(placement.owner(unit.params[i]), placement.matrix(unit.params[i]),
                                     unit.groups[i]) for i in positions}

    def __bool__(self) -> bool:
        return bool(self.params)

    def __contains__(self, i: int) -> bool:
        return i in self.params

    def take_initial(self, i: int, full: torch.Tensor, grad_dtype: torch.dtype) -> None:
        """On the owner: parameter i's fp32 master from its exact values, a zero state and gradient."""
        m, unit = self.params[i], self.unit
        if m.owner == self.placement.comm.rank:
            m.master = self.new_state(full).copy_(full)
            m.state = self.new_states(m.group, full)
            m.grad = torch.zeros(full.numel(), dtype=grad_dtype, device=unit.device)
            offloaded = m.master.device != unit.device or unit.offload_param
            if offloaded and not unit.aliased:  # gathers copy 16 bits from the host, not 32
                m.out16 = self.host16(full.numel()).copy_(full)

    # -- gathering

    def start_gather(self) -> list:
        """Issue the broadcast of every owned parameter into the unit's full buffer."""
        return [(i, self._broadcast(i, self.unit._views[i].view(-1))) for i in self.params]

    def finish_gather(self, started: list, wait: Callable[[object], None]) -> None:
        for i, work in started:
            wait(work)
            self._take_shard(i, self.unit._views[i].view(-1))  # a local copy of s elements: cheaper than a flag

    def _broadcast(self, i: int, into: torch.Tensor):
        """Issue the broadcast of parameter i's values from its owner (who casts its master) into `into`."""
        m = self.params[i]
        if m.master is not None:
            into.copy_(m.out16 if m.out16 is not None else m.master)
        return self.placement.broadcast_from(into, self.unit.params[i], async_op=True)

    def _take_shard(self, i: int, full: torch.Tensor) -> None:
        """This rank's 16-bit shard of parameter i from its whole value (kept for checkpoints and
        GatheredParameters, as every parameter's is)."""
        unit, comm = self.unit, self.placement.comm
        off, s = unit.offsets[i], unit.split_sizes[i]
        unit.shard[off : off + s].copy_(take_shard(full, comm.rank, comm.world_size))
        self.params[i].stale = False

    def mark_updated(self, masters_written: bool = False) -> None:
        """The owners updated their parameters: the ranks' shards are stale until the next gather.
        `masters_written`: the masters were written from outside the step (a checkpoint load, an
        accessor), so the owners' host copies (offload) follow them now."""
        if self.unit.aliased:  # the step writes the parameter itself (its slot's out16); nothing is gathered
            return
        for m in self.params.values():
            m.stale = True
            if masters_written and m.out16 is not None:
                m.out16.copy_(m.master)

    def freshen(self) -> None:
        """Bring stale shards up to date from their owners (collective: every rank calls it for the
        same units, as GatheredParameters and `param.all_gather()` are)."""
        unit = self.unit
        if not self.params or unit.aliased:
            return
        positions = sorted(self.params)
        stale = torch.tensor([self.params[i].stale for i in positions], dtype=torch.uint8)
        self.placement.comm.control().all_reduce(stale, "max")  # stale on any rank (a local accessor on some ranks)
        for i, flag in zip(positions, stale.tolist()):
            if flag:
                full = torch.empty(unit.params[i]._zero.numel, dtype=unit.dtype, device=unit.device)
                self._broadcast(i, full).wait()
                self._take_shard(i, full)

    # -- gradients

    def start_reduce(self, grads: list[torch.Tensor], predivide: float) -> list:
        """Issue the reduce of each owned parameter's gradient to its owner; (position, handle, buffer)."""
        unit, sent = self.unit, []
        for i, g in zip(sorted(self.params), grads):
            buf = g.to(unit.reduce_dtype)
            if predivide != 1.0:
                buf.div_(predivide)
            unit.gauges.reduce_buffers.add(buf.untyped_storage().nbytes())
            sent.append((i, self.placement.reduce_to(buf, unit.params[i], async_op=True), buf))
        return sent

    def finish_reduce(self, sent: list, wait: Callable[[object], None]) -> list[torch.Tensor]:
        """Wait for the reduces; the owner adds its sum to its gradient. Returns the gradients added to."""
        added = []
        for i, work, buf in sent:
            wait(work)
            m = self.params[i]
            if m.grad is not None:
                m.grad.add_(buf)
                added.append(m.grad)
            self.unit.gauges.reduce_buffers.sub(buf.untyped_storage().nbytes())
        return added

    def zero_grads(self) -> None:
        for m in self.params.values():
            if m.grad is not None:
                m.grad.zero_()

    # -- what the step, checkpoints and accessors see

    def mine(self) -> list[tuple[int, OwnedParam]]:
        """The owned parameters this rank updates (position, parameter)."""
        return [(i, m) for i, m in self.params.items() if m.master is not None]

    def chunks(self, i: int, saving: bool, view: Callable, specs: Callable) -> list[tuple[str, int, torch.Tensor]]:
        """Parameter i's checkpoint pieces: its owner writes it whole (the model from its master,
        which the ranks' shards may not have caught up with yet) and reads its master and state;
        every rank reads its shard of the model."""
        unit, m = self.unit, self.params[i]
        z = unit.params[i]._zero
        state = [] if m.master is None else [(spec.name, 0, view((unit.index, "matrix", i), spec, m.state))
                                             for spec in specs(m.group)]
        if saving:
            return [] if m.master is None else [("model", 0, m.master.to(unit.dtype)), ("master", 0, m.master), *state]
        start, s = self.placement.comm.rank * unit.split_sizes[i], unit.split_sizes[i]
        n = max(0, min(z.numel, start + s) - start)
        out = [("model", start, unit.shard[unit.offsets[i] : unit.offsets[i] + n])]
        if m.master is not None:
            out += [("master", 0, m.master), *state]
        return out

    def grad_piece(self, i: int) -> tuple[int, torch.Tensor, bool]:
        """Whole on its owner, nothing elsewhere."""
        grad = self.params[i].grad
        return 0, grad if grad is not None else torch.empty(0, dtype=self.unit.dtype, device=self.unit.device), True

    def load(self, i: int, value: torch.Tensor) -> None:
        """Parameter i set from outside to `value` (its full value): the owner's master and copy."""
        m = self.params[i]
        m.stale = False
        if m.master is not None:
            m.master.copy_(value.detach().reshape(-1))
            if m.out16 is not None:
                m.out16.copy_(m.master)

"""ZeRO stage 3's storage: the model's parameters as units of shards (see [Note: parameter units]
in zero/stages/unit.py), what the optimizer steps on (slots), what checkpoints and accessors read,
and what the memory report counts; the runtime that gathers and frees the units around their use
is Stage3Runtime (zero/stages/stage3.py)."""
from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.offload.param_swap import ParamSwap
from zero.offload.policy import OffloadPolicy
from zero.parallel.comm import Comm
from zero.parallel.sliced import local_tensor
from zero.stages.memory import Gauges
from zero.stages.placement import Owned, Sharded
from zero.stages.planning import describe_shard, plan_disk, plan_units, reshard_init, take_local_shard
from zero.stages.policies import Precision, ReduceOptions, Stage3Options
from zero.stages.stage3 import Stage3Runtime
from zero.stages.storage import ParamStorage, Slot
from zero.stages.unit import ParamUnit, ShardedState
from zero.state import StateSpecs


class UnitParams(ParamStorage):
    """The storage of stage 3: parameter units (see [Note: parameter units] in zero/stages/unit.py);
    the runtime that gathers and frees them around their use lives in `self.runtime`.

    Args:
        module: the model; its parameters become shards in units.
        params: the trainable parameters, in param-group order.
        groups: the param-group index of each trainable parameter.
        comm, precision, offload, gauges: see ParamStorage.
        reduce: gradient-reduction policies.
        options: stage-3 policies.
        predivide: gradients are divided by this before their reduction.
        device: where the model computes.
        grad_final, step_number, state_specs: see ParamStorage.
        placement: how the units' parameters lie over the ranks (default: sharded over `comm`; see
            [Note: placements] in zero/stages/placement.py).
        owned: the placement of the parameters kept whole on owners (Muon's matrices; see [Note:
            owned parameters in units] in zero/stages/owned.py), or None.
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: list[int], *, comm: Comm,
                 precision: Precision, offload: OffloadPolicy | None, gauges: Gauges, reduce: ReduceOptions,
                 options: Stage3Options, predivide: float, device: torch.device,
                 grad_final: Callable[[torch.Tensor], None], step_number: Callable[[], int],
                 state_specs: StateSpecs, placement: Sharded | None = None, owned: Owned | None = None):
        super().__init__(params, {p: n for n, p in module.named_parameters()}, comm, precision, offload, gauges,
                         grad_final=grad_final, step_number=step_number, state_specs=state_specs, device=device)
        self.offload_param = options.offload_param
        self.swap: ParamSwap | None = None  # shards on NVMe (see [Note: parameters on NVMe])
        on_disk: dict[str, bool] = {}
        if options.param_nvme is not None:
            plan = plan_disk(module, options, comm.world_size, precision.param)  # refuses a small buffer_size
            on_disk = plan.on_disk
            self.swap = ParamSwap(options.param_nvme, self.host_memory)
        group_of = dict(zip(params, groups))
        for p in module.parameters():
            reshard_init(p, comm)  # zero.Init cut it over the world; hybrid sharding shards over fewer ranks
            describe_shard(p, comm.world_size)
        planned, persistent = plan_units(module, options.persistence_threshold, options.unit_elements,
                                         options.persistence_budget)
        modules = dict(module.named_modules())
        placement = self.placement = placement or Sharded(comm, comm.world_size)
        placement.temporaries = gauges.collective_temporaries  # qwZ's gathers count their messages there
        hpz = self.hpz = _node_group(comm, options.hpz) if options.hpz > 1 else None  # see [Note: hpZ]
        _warn_useless_zeropp(comm, options)
        if (options.quantize_gradients or options.hierarchical_gather) and comm.world_size > 1:
            from zero.zeropp.reduce import TwoHop  # see [Note: qgZ] and [Note: the two-hop gather] there

            hop = TwoHop(comm, gauges.collective_temporaries)
            placement.two_hop = hop if options.quantize_gradients else None
            placement.hierarchical = hop if options.hierarchical_gather and hop.nodes > 1 else None
        self.units: list[ParamUnit] = []
        unit_modules: list[nn.Module | None] = []
        host_empty = self.host_memory.empty if options.pin_memory else self.host_memory.empty_pageable
        pin = self.store.policy.pin_memory if self.store.on_host else options.pin_memory  # owners' host copies
        alias = precision.master_is_model and not self.store.on_host and not options.offload_param
        for path, unit_params in planned + ([("<persistent>", persistent)] if persistent else []):
            unit = ParamUnit(len(self.units), path, unit_params, [group_of.get(p, -1) for p in unit_params], placement,
                             precision, device, lambda p: take_local_shard(p, comm, placement.broadcast_initial),
                             lambda shard: self.new_master(shard, alias), self.new_states, state_specs,
                             alias_master=alias,
                             persistent=path == "<persistent>", offload_param=options.offload_param,
                             host_empty=host_empty, gauges=gauges, owned=owned,
                             new_state=lambda like: self.store.new(like.shape),
                             host16=lambda n: self.host_memory.empty((n,), precision.param, pin),
                             swap=self.swap if on_disk.get(path) and path != "<persistent>" else None, hpz=hpz,
                             quantized=options.quantize_weights or (options.quantize_frozen_weights and all(
                                 group_of.get(p, -1) < 0 for p in unit_params)))
            self.units.append(unit)
            unit_modules.append(None if unit.persistent else modules.get(path))
        if self.swap is not None:
            self.swap.size_buffers(max((u.shard.untyped_storage().nbytes() for u in self.units if u.swap), default=0))
        self.hook_state_dict_loads(module)
        self.runtime = Stage3Runtime(module, self.units, unit_modules, comm, options, reduce, predivide, self.names,
                                     step_number, grad_final)
        for unit in self.units:
            if unit.persistent:
                unit.refresh(lambda work: work.wait())
        if options.gather_on_apply:
            _gather_on_apply(module)
        self.watch_edits([p for unit in self.units for p in unit.params])
        if not self.store.on_host and not options.offload_param and comm.world_size > 1 and \
                any(unit.matrices for unit in self.units):  # the same on every rank
            self.forward_kinds = frozenset({"fp32_master"})  # gathers read the owners' masters (zero/stages/owned.py)

    def slots(self) -> list[Slot]:
        out = []
        for unit in self.units:
            for r in unit.ranges:
                shard = unit.shard[r.lo : r.hi]
                out16 = None if r.master.data_ptr() == shard.data_ptr() else shard
                index = (unit.index << 40) + self.comm.rank * unit.numel + r.lo  # unique over ranks and units
                out.append(Slot(r.group, r.master, r.grad, r.state, self.state_specs(r.group), out16, index=index))
            for i, m in unit.matrices.mine():  # the owned parameters this rank updates
                out16 = unit.shard[unit.offsets[i] : unit.offsets[i] + m.master.numel()] if unit.aliased else m.out16
                out.append(Slot(m.group, m.master, m.grad, m.state, self.state_specs(m.group), out16,
                                index=(unit.index << 40) + unit.offsets[i], matrix=m.shape))
        return out

    def param_chunks(self, param: nn.Parameter, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        return param._zero.unit.param_chunks(param, self.store.view, saving)

    def grad_piece(self, param: nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        return param._zero.unit.grad_piece(param)

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return param._zero.unit.grad_piece(param)[1]

    def load_param(self, param: nn.Parameter, value: torch.Tensor) -> torch.Tensor | None:
        z = getattr(param, "_zero", None)
        return None if z is None or z.unit is None else z.unit.load_param(param, value)

    def adopt_edit(self, param: nn.Parameter) -> None:
        unit = param._zero.unit
        if unit.state is ShardedState.GATHERED:  # the edit is in the gathered values: take it into the shard
            unit.load_param(param, local_tensor(param).detach().clone())
            return
        raise RuntimeError(
            f"parameter {self.names.get(param, '?')!r} was changed in place while ZeRO-3 held only this rank's shard "
            f"of it (between uses its .data is empty), so the change was lost. Change sharded parameters inside "
            f"`with zero.GatheredParameters(params, modifier_rank=0):`, or with model.load_state_dict(...).")

    def reduce_gradients(self) -> None:
        """Hybrid sharding: the replicas sum the gradient shards once per optimizer step (see
        [Note: the replicas' sum, once] in zero/stages/placement.py); then they are final."""
        if not self.placement.defers_replicas or self.runtime.replicas_summed or not self.runtime.replicas_owed:
            return
        grads = [r.grad for u in self.units for r in u.ranges] + _owned(self.units, "grad")  # owners: the same
        self.placement.reduce_replicas(grads)  # matrices at the same place of every replica
        for grad in grads:
            self.grad_final(grad)
        self.runtime.replicas_summed = True

    def sum_replicas(self) -> None:
        self.reduce_gradients()

    @property
    def summed(self) -> int:
        return self.placement.summed  # the shard group, times its replicas (hybrid sharding)

    def norm_copies(self) -> int:
        return self.placement.summed // self.comm.world_size  # each replica holds every shard once

    def out16_on_host(self) -> bool:
        return self.offload_param

    def state_written(self) -> None:
        """After an accessor wrote into the views: besides encoding 8-bit moments, an owned master
        written alone (safe_set_local_fp32_param) leaves the ranks' shards behind it."""
        super().state_written()
        self._drop_reads()
        for unit in self.units:
            unit.mark_updated(masters_written=True)

    def is_matrix(self, param: nn.Parameter) -> bool:
        unit = getattr(getattr(param, "_zero", None), "unit", None)
        return unit is not None and any(unit.params[i] is param for i in unit.matrices.params)

    def values_set(self, param: nn.Parameter) -> None:
        """A persistent unit stays gathered: gather it again from the shards (and Muon's owners)."""
        unit = param._zero.unit
        self._drop_reads()
        if unit.persistent:
            unit.refresh(lambda work: work.wait())

    def after_checkpoint_load(self) -> None:
        for unit in self.units:
            unit.mark_updated(masters_written=True)
        super().after_checkpoint_load()

    def publish(self) -> None:
        """Gathered copies are stale after an update: release them; refresh persistent units."""
        self.runtime.release_all()
        self._drop_reads()
        for unit in self.units:
            unit.mark_updated()
            if unit.persistent:
                unit.refresh(lambda work: work.wait())
        self.runtime.read_ahead()

    def release_gathered(self) -> None:
        self.runtime.release_all()

    def _drop_reads(self) -> None:
        """The shards changed: reads of them ahead (see [Note: parameters on NVMe]) and hpZ's
        secondary shards (see [Note: hpZ]) are stale."""
        if self.swap is not None:
            self.swap.drop()
        for unit in self.units:
            unit.drop_secondary()

    def close(self) -> None:
        super().close()
        if self.swap is not None:
            self.swap.close()

    def in_files(self, t: torch.Tensor) -> bool:
        return super().in_files(t) or (self.swap is not None and self.swap.holds(t))

    def side_comms(self) -> list:
        hop = self.placement.two_hop or self.placement.hierarchical
        two_hop = hop.side_comms() if hop is not None else []
        return ([self.hpz] if self.hpz is not None else []) + two_hop

    @property
    def replicate(self):
        return self.placement.replicate

    def zero_grads(self) -> None:
        self.runtime.recover()
        self.runtime.replicas_summed = self.runtime.replicas_owed = False
        for unit in self.units:
            unit.zero_grads()

    def memory_parts(self) -> tuple[dict[str, list[torch.Tensor]], set[str]]:
        host_copies = [m.out16 for u in self.units for _, m in u.matrices.mine() if m.out16 is not None]
        return {
            "host_copies": host_copies,  # Muon owners' 16-bit copies under offload (not a model state kind)
            "params": [u.shard for u in self.units],
            "persistent_full": [u.full for u in self.units if u.persistent],
            "grads": [r.grad for u in self.units for r in u.ranges] + _owned(self.units, "grad"),
            "fp32_master": [r.master for u in self.units for r in u.ranges] + _owned(self.units, "master"),
            "optimizer_states": [t for u in self.units for r in u.ranges for t in r.state.values()]
            + [t for state in _owned(self.units, "state") for t in state.values()],
        }, ({"params"} if self.offload_param else set()) | {"host_copies"}

    def memory_extras(self, report: dict[str, int]) -> None:
        persistent = report.pop("persistent_full")  # full copies, on the device, counted as parameters
        report["params"] += persistent
        report["model_states_total"] += persistent
        report["gathered_bytes"] = sum(u.held_bytes() for u in self.units if not u.persistent)
        report["gathered_peak"] = self.gauges.gathered.peak
        report["gather_buffers_peak"] = self.gauges.gather_buffers.peak
        report["persistent_params"] = sum(u.full_numel for u in self.units if u.persistent)
        report["hpz_secondary_peak"] = self.gauges.secondary.peak  # hpZ's secondary shards (see [Note: hpZ])
        report["collective_temporaries_peak"] = self.gauges.collective_temporaries.peak  # zero/zeropp's
        if self.swap is not None:  # shards on NVMe: on disk, not in host memory; their buffers are
            disk = sum(u.shard.untyped_storage().nbytes() for u in self.units if u.swap is not None)
            buffers = sum(b.untyped_storage().nbytes() for b in self.swap.buffers())
            report["host_bytes"] += buffers - disk
            report["disk_bytes"] += disk
            report["nvme_buffers"] += buffers


def _node_group(comm: Comm, size: int) -> Comm:
    """[Note: hpZ]
    ZeRO++'s hierarchical partitioning (`zero_hpz_partition_size` = L, the ranks of a node): the
    shards stay divided over every rank, and forward gathers a unit from all of them, across nodes.
    Then each rank keeps a secondary shard, its 1/L slice of the gathered unit, so that backward
    gathers the unit from the L ranks of its node only: no byte of backward's all-gathers crosses a
    node. The secondary shards live from a forward to the end of its backward (they cost the
    parameters' bytes / L while they do), and are dropped then, by a step, by a checkpoint load or
    by any change of a shard, so backward never reads stale values. Forwards without grad keep none.

    The group: `size` consecutive ranks of `comm` (made once; every rank makes its own)."""
    from zero.parallel.groups import group_of

    members = dist.get_process_group_ranks(comm.group or dist.group.WORLD)
    if comm.node_of is not None:  # every group inside one node (the same verdict on every rank)
        for at in range(0, len(members), size):
            if len(set(comm.node_of[at : at + size])) > 1:
                raise ValueError(f"zero_optimization.zero_hpz_partition_size = {size}, but ranks "
                                 f"{members[at : at + size]} are not all on one node: give the ranks per node (or a "
                                 f"divisor of them)")
    first = comm.rank - comm.rank % size
    node = Comm(group_of(members[first : first + size]))
    if comm.node_of is not None:
        node.place_on_nodes({m: comm.node_of[i] for i, m in enumerate(members)})
    return node


def _warn_useless_zeropp(comm: Comm, options: Stage3Options) -> None:
    """ZeRO++'s rounding where it saves nothing, and the two-hop gather where qwZ replaces it: said
    once, at build (the same on every rank)."""
    import warnings

    one_node = comm.node_of is not None and len(set(comm.node_of)) == 1
    if one_node and comm.world_size > 1 and (options.quantize_weights or options.quantize_gradients):
        warnings.warn("zero_optimization.zero_quantized_weights / zero_quantized_gradients: every rank of the shard "
                      "group is on one node, so nothing crosses a node and the int8 collectives only round weights "
                      "and gradients; leave them off on one node (or with a shard group inside a node)", stacklevel=3)
    if options.quantize_weights and options.hierarchical_gather:
        warnings.warn("zero_optimization.mics_hierarchical_params_gather with zero_quantized_weights: the gathers "
                      "send int8 blocks in one hop; the two-hop gather applies to exact gathers only", stacklevel=3)


def _owned(units: list[ParamUnit], kind: str) -> list:
    """This rank's tensors of one kind for the owned parameters it updates."""
    return [getattr(m, kind) for u in units for _, m in u.matrices.mine()]


def _gather_on_apply(module: nn.Module) -> None:
    """`module.apply(fn)` on a sharded model gathers each module's own parameters around `fn`,
    keeping rank 0's changes (DeepSpeed's `override_module_apply`)."""
    from zero.init import GatheredParameters

    def apply(self: nn.Module, fn):
        for child in self.children():
            child.apply(fn)
        with GatheredParameters(list(self.parameters(recurse=False)), modifier_rank=0):
            fn(self)
        return self

    for m in module.modules():
        m.apply = types.MethodType(apply, m)

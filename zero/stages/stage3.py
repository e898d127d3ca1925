"""ZeRO stage 3: parameters live as shards and are gathered around each unit's forward and backward.

[Note: stage 3 hooks]
- A forward pre-hook on a unit's module gathers the unit (waiting for a prefetch if one is in
  flight); a forward post-hook releases it, and registers a hook on every output tensor that
  needs a gradient. That tensor hook runs when backward reaches the module's outputs, i.e. just
  before the module's own backward, and gathers the unit again.
- A post-accumulate-grad hook on each trainable parameter counts arriving gradients. Autograd
  runs a parameter's accumulation only after every operation that used it has produced its part
  of the gradient, so once all of a unit's trainable parameters have theirs, no backward step
  still needs the unit's values: its gradients are reduce-scattered and it is released. (A unit
  with frozen parameters is released at the end of backward instead: a frozen weight may still
  be needed for the gradient of an input.)
- A callback at the end of backward reduces every unit that got no (or only part of its)
  gradients, as zeros, so all ranks issue the same collectives, waits for all reductions and
  releases anything still gathered.

[Note: prefetch and reuse]
Each forward pass (from the root module's pre-hook to its post-hook) and each backward pass
records the order in which units were gathered. The next pass of the same kind follows that
trace: after gathering trace[i] it starts all-gathers of trace[i+1] (always, if the gathered
total stays within `stage3_max_live_parameters`), then trace[i+2], ... while their elements
stay within `stage3_prefetch_bucket_size`; 0 turns prefetching off. As soon as a pass deviates from its trace (eval, another branch),
prefetching stops for that pass and the pass's own order becomes the trace for the next one:
the engine re-records rather than giving up on prefetching. A unit whose next use in the
recorded traces is within `stage3_max_reuse_distance` gathered elements is kept after its
forward instead of being released, if `stage3_max_live_parameters` allows. Prefetch decisions
depend only on the traces, so every rank issues the same collectives in the same order.

[Note: rank-divergent control flow]
Every unit all-gather and reduce-scatter travels with a tiny all-gather of (unit, phase). If
ranks disagree, every rank raises with the unit each rank was fetching and the step; a
collective that never completes (a rank stopped issuing them) raises after
ZERO_COLLECTIVE_TIMEOUT seconds instead of hanging (see Comm.wait_for). Host tags (gloo) are
checked at once. GPU tags are checked together at the end of each forward or backward pass,
because reading them per unit would stall the CPU until the GPU catches up; a hang before then is
bounded by NCCL's process-group timeout.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zero.comm import Comm
from zero.offload import OffloadOptions
from zero.precision import LossScaler
from zero.stages.optimizer import ShardedAdam
from zero.stages.units import ParamUnit, ShardedParam, UnitState, shard_numel, take_shard

PHASES = {"forward": 0, "backward": 1}


class RankDivergenceError(RuntimeError):
    """Ranks ran different modules (or in a different order) in the same step."""


# ------------------------------------------------------------------------------------ planning


def _owner(paths: list[str]) -> str:
    """The deepest module path that is a prefix (an ancestor) of every path in `paths`."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _in_subtree(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def plan_units(module: nn.Module, persistence_threshold: int, unit_threshold: int,
               persistence_budget: int | None = None) -> tuple[list[tuple[str, list[nn.Parameter]]], list[nn.Parameter]]:
    """Decide which parameters form which unit.

    A parameter belongs to the deepest module that contains every module holding it (a tied
    embedding/output weight belongs to their common ancestor, so it stays gathered across both
    uses). Parameters of at most `persistence_threshold` elements are persistent. Walking the
    module tree bottom-up, a module becomes a unit when the unclaimed parameters of its subtree
    reach `unit_threshold` elements, or when it is marked with `zero.set_z3_leaf_modules`; the
    root takes whatever is left. ModuleList/ModuleDict are skipped: they are never called.
    `persistence_budget` caps the total elements kept persistent (smallest parameters first).

    Returns:
        ([(module path, params)] in module order, persistent params)
    """
    holders: dict[nn.Parameter, list[str]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(p, []).append(path)
    owner = {p: _owner(paths) for p, paths in holders.items()}
    size = {p: p._zero.numel if getattr(p, "_zero", None) is not None else p.numel() for p in holders}
    persistent, kept = [], 0
    for p in sorted((p for p in holders if size[p] <= persistence_threshold), key=size.__getitem__):
        if persistence_budget is not None and kept + size[p] > persistence_budget:
            break
        persistent.append(p)
        kept += size[p]
    unclaimed = set(holders) - set(persistent)
    modules = dict(module.named_modules())
    order = {path: i for i, path in enumerate(modules)}
    rank_of = {p: i for i, p in enumerate(holders)}
    units: list[tuple[str, list[nn.Parameter]]] = []
    for path in sorted(modules, key=lambda p: (-(p.count(".") + 1 if p else 0), order[p])):
        if isinstance(modules[path], (nn.ModuleList, nn.ModuleDict)):
            continue  # containers are never called, so their hooks would never fire
        mine = [p for p in unclaimed if _in_subtree(owner[p], path)]
        leaf = getattr(modules[path], "_zero_unit", False)
        if mine and (path == "" or leaf or sum(size[p] for p in mine) >= unit_threshold):
            mine.sort(key=rank_of.__getitem__)
            units.append((path, mine))
            unclaimed -= set(mine)
    units.sort(key=lambda u: order[u[0]])
    return units, persistent


def shard_module_params(module: nn.Module, comm: Comm, dtype: torch.dtype, names: dict[nn.Parameter, str]) -> dict[nn.Parameter, torch.Tensor]:
    """Shard every parameter not sharded yet (see [Note: parameter shards]); keep `dtype` shards.

    Returns the exact fp32 shard of each parameter (the master's starting values)."""
    fp32 = {}
    for p in names:
        if getattr(p, "_zero", None) is None:
            full = p.detach()
            shard = take_shard(full, comm.rank, comm.world_size)
            p._zero = ShardedParam(full.shape, full.numel(), shard_numel(full.numel(), comm.world_size), local=shard)
        p._zero.name = names[p]
        fp32[p] = p._zero.local.float()
        p._zero.local = p._zero.local.to(dtype)
        p.data = p._zero.local[:0]
    return fp32


# ------------------------------------------------------------------------------------- runtime


class Stage3Optimizer(ShardedAdam):
    """Adam over stage-3 shards, plus the hooks that gather and release parameters.

    Args:
        module: the model (its parameters become shards).
        param_groups, comm, dtype, gradient_clipping, loss_scaler, check_overflow, predivide:
            see ShardedAdam.
        comm_dtype: dtype of gradient reduction.
        accumulation_steps: micro-batches per step (fp32 gradient shards when > 1).
        persistence_threshold: parameters this small stay whole on every rank.
        persistence_budget: at most this many elements stay whole in total (None: no cap).
        unit_threshold: elements that make a module a unit (see plan_units).
        prefetch_elements, max_live_elements, max_reuse_distance: see [Note: prefetch and reuse].
        overlap_comm: reduce-scatter asynchronously while backward goes on.
        offload: optimizer offload (see ShardedAdam).
        offload_param: keep parameter shards in host memory (see ParamUnit).
        pin_memory: pin host parameter shards.
    """

    def __init__(self, module: nn.Module, param_groups: list[dict[str, Any]], *, comm: Comm, dtype: torch.dtype,
                 comm_dtype: torch.dtype, accumulation_steps: int, persistence_threshold: int, unit_threshold: int,
                 persistence_budget: int | None,
                 prefetch_elements: int, max_live_elements: int, max_reuse_distance: int, overlap_comm: bool,
                 device: torch.device, gradient_clipping: float = 0.0, loss_scaler: LossScaler | None = None,
                 check_overflow: bool = False, predivide: float = 1.0, offload: OffloadOptions | None = None,
                 offload_param: bool = False, pin_memory: bool = False):
        super().__init__(param_groups, comm=comm, dtype=dtype, gradient_clipping=gradient_clipping,
                         loss_scaler=loss_scaler, check_overflow=check_overflow, predivide=predivide, offload=offload)
        self.offload_param = offload_param
        self.module = module
        self.prefetch_elements = prefetch_elements
        self.max_live = max_live_elements
        self.max_reuse = max_reuse_distance
        self.overlap = overlap_comm
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        names = {}
        for name, p in module.named_parameters(remove_duplicate=True):
            names[p] = name
        with torch.no_grad():
            master = shard_module_params(module, comm, dtype, names)
        grad_dtype = torch.float32 if accumulation_steps > 1 or dtype == torch.float32 else comm_dtype

        planned, persistent = plan_units(module, persistence_threshold, unit_threshold, persistence_budget)
        modules = dict(module.named_modules())
        self.units: list[ParamUnit] = []
        self.unit_module: list[nn.Module | None] = []
        for path, params in planned + ([("<persistent>", persistent)] if persistent else []):
            unit = ParamUnit(len(self.units), path, params, [group_of.get(p, -1) for p in params], comm, dtype,
                             grad_dtype, comm_dtype, master, device, self.new_state,
                             alias_master=dtype == torch.float32 and offload is None and not offload_param,
                             persistent=path == "<persistent>",
                             offload_param=offload_param, pin_memory=pin_memory)
            unit.on_final = self.grad_final
            self.units.append(unit)
            self.unit_module.append(modules.get(path) if not unit.persistent else None)
        for unit in self.units:
            if unit.persistent:
                unit.refresh_persistent()

        # runtime state
        self.live = 0
        self.peak_live = 0
        self.prefetched = 0  # gathers started ahead of use
        self.traces: dict[str, list[int]] = {"forward": [], "backward": []}
        self._pass: str | None = None
        self._recording: list[int] = []
        self._pos = 0
        self._following = False
        self._backward_queued = False
        self._pending = {u.index: self._trainable_count(u) for u in self.units}
        self._seen: set[int] = set()
        self._reduced: set[int] = set()
        self._late: set[int] = set()
        self._bwd_uses: dict[int, int] = {}
        self._inflight_reduces: list[ParamUnit] = []
        self._unchecked_tags: list[tuple[torch.Tensor, str]] = []
        self._handles = []
        self._install_hooks()

    @staticmethod
    def _trainable_count(unit: ParamUnit) -> int:
        return sum(1 for g in unit.groups if g >= 0)

    # -- hooks ------------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        this = weakref.proxy(self)
        root = self.module
        self._handles.append(root.register_forward_pre_hook(lambda m, a: this._begin_pass("forward")))
        for unit, mod in zip(self.units, self.unit_module):
            if mod is None:
                continue
            self._handles.append(mod.register_forward_pre_hook(lambda m, a, u=unit: this._pre_forward([u])))
            self._handles.append(mod.register_forward_hook(lambda m, a, out, u=unit: this._post_forward([u], out)))
        for mod in root.modules():
            external = [p._zero.unit for p in getattr(mod, "_zero_external_params", []) if getattr(p, "_zero", None)]
            if external:
                units = sorted({u.index: u for u in external if not u.persistent}.values(), key=lambda u: u.index)
                self._handles.append(mod.register_forward_pre_hook(lambda m, a, us=units: this._pre_forward(us)))
                self._handles.append(mod.register_forward_hook(lambda m, a, out, us=units: this._post_forward(us, out)))
        self._handles.append(root.register_forward_hook(lambda m, a, out: this._end_forward()))
        for unit in self.units:
            for p, g in zip(unit.params, unit.groups):
                if g >= 0:
                    self._handles.append(p.register_post_accumulate_grad_hook(lambda p, u=unit: this._on_grad(u, p)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- passes and traces ------------------------------------------------------------------------

    def _begin_pass(self, phase: str) -> None:
        self._pass = phase
        self._recording = []
        self._pos = 0
        self._following = bool(self.traces[phase])

    def _end_pass(self) -> None:
        self._check_pending_tags()
        if self._pass is not None and self._recording != self.traces[self._pass]:
            self.traces[self._pass] = self._recording  # the order changed: re-record
        self._pass = None

    def _record(self, unit: ParamUnit) -> None:
        self._recording.append(unit.index)
        trace = self.traces.get(self._pass or "forward", [])
        if self._following:
            if self._pos < len(trace) and trace[self._pos] == unit.index:
                self._pos += 1
            else:
                self._following = False

    def _prefetch(self) -> None:
        if not self._following or self.prefetch_elements <= 0:
            return
        trace = self.traces[self._pass]
        budget = 0
        for idx in trace[self._pos :]:
            unit = self.units[idx]
            if unit.state is not UnitState.SHARDED:
                continue
            # the next unit is always fetched ahead (a unit larger than the budget would otherwise
            # never be prefetched); further ones while they fit in the budget
            if (budget and budget + unit.full_numel > self.prefetch_elements) or self.live + unit.full_numel > self.max_live:
                break
            budget += unit.full_numel
            self._start_gather(unit)
            self.prefetched += 1

    # -- gather and release -----------------------------------------------------------------------

    def _tag(self, unit: ParamUnit, phase: str) -> torch.Tensor:
        return torch.tensor([unit.index, PHASES[phase]], dtype=torch.int64, device=unit.device)

    def _check_tags(self, tags: torch.Tensor, what: str) -> None:
        if tags.is_cuda:  # see [Note: rank-divergent control flow]
            self._unchecked_tags.append((tags, what))
            return
        self._verify_tags(tags, what)

    def _check_pending_tags(self) -> None:
        pending, self._unchecked_tags = self._unchecked_tags, []
        if pending:
            rows = torch.stack([t for t, _ in pending]).cpu()  # one sync per pass
            for row, (_, what) in zip(rows, pending):
                self._verify_tags(row, what)

    def _verify_tags(self, tags: torch.Tensor, what: str) -> None:
        rows = tags.view(self.world_size, 2).tolist()
        if any(r != rows[0] for r in rows):
            def name(i):
                return repr(self.units[i].name or "<root>") if 0 <= i < len(self.units) else f"#{i}"

            seen = "; ".join(f"rank {r}: {'forward' if ph == 0 else 'backward'} of unit {name(u)}" for r, (u, ph) in enumerate(rows))
            raise RankDivergenceError(
                f"ZeRO-3 ranks diverged at step {self.step_count + 1} during {what}: {seen}. Every rank must run the "
                f"same modules in the same order (rank-dependent branches, early exits or a different number of "
                f"forward passes cause this; for generation pass synced_gpus=True)."
            )

    def _start_gather(self, unit: ParamUnit) -> None:
        self._make_room(unit.full_numel)
        unit.start_gather(self._tag(unit, self._pass or "forward") if self.world_size > 1 else None)
        self.live += unit.full_numel
        self.peak_live = max(self.peak_live, self.live)

    def _finish_gather(self, unit: ParamUnit) -> None:
        what = f"the all-gather of unit {unit.name or '<root>'!r}"
        unit.finish_gather(lambda tags: self._check_tags(tags, what),
                           lambda: f"ZeRO-3 step {self.step_count + 1}: {what}")

    def _make_room(self, need: int) -> None:
        """Release idle gathered units until `need` more elements fit under max_live."""
        if self.live + need <= self.max_live:
            return
        for unit in self.units:
            if unit.state is UnitState.GATHERED and unit.users == 0 and not unit.persistent:
                self._release(unit)
                if self.live + need <= self.max_live:
                    return

    def _release(self, unit: ParamUnit) -> None:
        unit.release()
        self.live -= unit.full_numel

    def _acquire(self, unit: ParamUnit) -> None:
        self._record(unit)
        if not unit.persistent:
            if unit.state is UnitState.SHARDED:
                self._start_gather(unit)
            if unit.state is UnitState.GATHERING:
                self._finish_gather(unit)
        unit.users += 1
        self._prefetch()

    def _next_use_distance(self, unit: ParamUnit) -> float:
        """Gathered elements between now and this unit's next use in the recorded traces."""
        upcoming = self.traces.get(self._pass or "forward", [])[self._pos :]
        if self._pass == "forward" and torch.is_grad_enabled():
            upcoming = upcoming + self.traces["backward"]
        distance, counted = 0, set()
        for idx in upcoming:
            if idx == unit.index:
                return distance
            if idx not in counted:
                counted.add(idx)
                distance += self.units[idx].full_numel
        return float("inf")

    def _drop_use(self, unit: ParamUnit) -> None:
        unit.users -= 1
        if unit.users > 0 or unit.persistent or unit.state is not UnitState.GATHERED:
            return
        if self._next_use_distance(unit) < self.max_reuse and self.live <= self.max_live:
            return  # kept: it is used again soon (see [Note: prefetch and reuse])
        self._release(unit)

    # -- forward ----------------------------------------------------------------------------------

    def _pre_forward(self, units: list[ParamUnit]) -> None:
        for unit in units:
            self._acquire(unit)

    def _post_forward(self, units: list[ParamUnit], output):
        for unit in units:
            self._drop_use(unit)
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors_in(output) if t.requires_grad]
            if tensors:
                fired = [False]
                this = weakref.proxy(self)

                def before_backward(grad, us=units, fired=fired):
                    if not fired[0]:
                        fired[0] = True
                        this._pre_backward(us)
                    return grad

                for t in tensors:
                    t.register_hook(before_backward)
        return output

    def _end_forward(self) -> None:
        if not torch.is_grad_enabled():  # no backward follows: drop what is only kept for it
            for unit in self.units:
                if unit.state is UnitState.GATHERED and unit.users == 0 and not unit.persistent:
                    self._release(unit)
        self._finish_prefetches()
        self._end_pass()

    def _finish_prefetches(self) -> None:
        """Complete prefetches the pass did not use, and release them."""
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                self._finish_gather(unit)
                if unit.users == 0:
                    self._release(unit)

    # -- backward ---------------------------------------------------------------------------------

    def _pre_backward(self, units: list[ParamUnit]) -> None:
        if not self._backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._backward_queued = True
            self._begin_pass("backward")
        for unit in units:
            self._acquire(unit)
            self._bwd_uses[unit.index] = self._bwd_uses.get(unit.index, 0) + 1

    def _on_grad(self, unit: ParamUnit, param: nn.Parameter) -> None:
        key = id(param)
        if unit.index in self._reduced:
            self._late.add(unit.index)  # a gradient after its unit was reduced: sent again at the end
            return
        if key in self._seen:
            return
        self._seen.add(key)
        self._pending[unit.index] -= 1
        if self._pending[unit.index] == 0:
            self._reduce_unit(unit)
            if all(g >= 0 for g in unit.groups):  # nothing frozen: no backward step needs it any more
                self._drop_backward_uses(unit)

    def _reduce_unit(self, unit: ParamUnit) -> None:
        self._reduced.add(unit.index)
        unit.start_reduce(self._tag(unit, "backward") if self.world_size > 1 else None, self.predivide)
        if unit.reducing:
            self._inflight_reduces.append(unit)
            if not self.overlap:
                self._finish_reduces()

    def _finish_reduces(self) -> None:
        for unit in self._inflight_reduces:
            what = f"the gradient reduce-scatter of unit {unit.name or '<root>'!r}"
            unit.finish_reduce(lambda tags, w=what: self._check_tags(tags, w),
                               lambda w=what: f"ZeRO-3 step {self.step_count + 1}: {w}")
        self._inflight_reduces.clear()

    def _drop_backward_uses(self, unit: ParamUnit) -> None:
        for _ in range(self._bwd_uses.pop(unit.index, 0)):
            unit.users -= 1
        if unit.users <= 0 and unit.state is UnitState.GATHERED and not unit.persistent:
            unit.users = 0
            self._release(unit)

    def _end_backward(self) -> None:
        """Runs once at the end of each backward (see [Note: stage 3 hooks])."""
        self._backward_queued = False
        with record_function("zero::end_of_backward"):
            for unit in self.units:
                if self._trainable_count(unit) and unit.index not in self._reduced:
                    self._reduce_unit(unit)
            self._finish_reduces()  # a unit may be both in flight and late: one at a time
            for idx in sorted(self._late):
                self._reduce_unit(self.units[idx])
            self._finish_reduces()
            self._finish_prefetches()
            for unit in self.units:
                self._bwd_uses.pop(unit.index, None)
                if not unit.persistent:
                    unit.users = 0
                    if unit.state is UnitState.GATHERED:
                        self._release(unit)
        self._seen.clear()
        self._reduced.clear()
        self._late.clear()
        self._pending = {u.index: self._trainable_count(u) for u in self.units}
        self._end_pass()

    # -- optimizer ----------------------------------------------------------------------------------

    def slots(self):
        out = []
        for unit in self.units:
            for r in unit.ranges:
                shard = unit.shard16[r.lo : r.hi]
                out16 = None if r.master.data_ptr() == shard.data_ptr() else shard
                out.append((r.group, r.master, r.grad, r.exp_avg, r.exp_avg_sq, out16))
        return out

    def out16_on_host(self) -> list[bool]:
        return [self.offload_param for unit in self.units for _ in unit.ranges]

    def reduce_gradients(self) -> None:
        self._finish_reduces()

    def publish(self) -> None:
        """Gathered copies are stale after an update: release them; refresh persistent params."""
        for unit in self.units:
            if unit.persistent:
                unit.refresh_persistent()
            elif unit.state is UnitState.GATHERING:
                self._finish_gather(unit)
                self._release(unit)
            elif unit.state is UnitState.GATHERED:
                unit.users = 0
                self._release(unit)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            unit.zero_grads()
            for p in unit.params:
                p.grad = None

    def memory_report(self) -> dict[str, int]:
        from zero.stages.optimizer import split_by_place

        parts = {"params": 0, "persistent_full": 0, "grads": 0, "fp32_master": 0, "optimizer_states": 0}
        for unit in self.units:
            for k, v in unit.state_bytes().items():
                parts[k] += v
        host = ({"fp32_master", "optimizer_states"} if self.offload is not None else set()) | \
            ({"params"} if self.offload_param else set())
        report = {"params": parts["params"] + parts["persistent_full"], "grads": parts["grads"],
                  "fp32_master": parts["fp32_master"], "optimizer_states": parts["optimizer_states"], "comm_buffers": 0}
        report = split_by_place(report, host, self._host.host_bytes() if self._host is not None else 0)
        if self.offload_param:  # the persistent full copies stay on the device
            report["host_bytes"] -= parts["persistent_full"]
            report["device_bytes"] += parts["persistent_full"]
        elsize = torch.finfo(self.dtype).bits // 8
        report["gathered_peak"] = self.peak_live * elsize
        report["persistent_params"] = sum(u.full_numel for u in self.units if u.persistent)
        return report


def _tensors_in(obj) -> list[torch.Tensor]:
    """Tensors inside a module output: a tensor, or tuples/lists/dicts of them (HF outputs too)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors_in(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors_in(x)]
    return []

"""ZeRO stage 3: the runtime that gathers and frees units around their use (its storage, the
units, is UnitParams in zero/stages/unit_params.py).

[Note: stage 3 hooks]
- A forward pre-hook on a unit's module gathers the unit (waiting for a prefetch if one is in
  flight) and counts a forward use; the forward post-hook ends that use, releases the unit if
  nothing else holds it (see [Note: prefetch and reuse]), and hooks every output tensor that
  needs a gradient. That tensor hook runs when backward reaches the module's outputs, just before
  the module's own backward: it gathers the unit again and marks it needed in backward.
- A unit is released in backward as soon as its gradients are reduced (see [Note: gradient
  readiness] in zero/stages/readiness.py): once all of its trainable parameters have their
  gradients, no backward step still needs its values. A unit with frozen parameters may still be
  needed for the gradient of an input: an identity autograd function on its module's inputs
  (whose backward runs once those gradients are done) tells when; it is released when both are
  done, or at the end of backward.
- A forward re-run inside backward (activation checkpointing) keeps its unit for the backward that
  follows at once. A backward hook fires once per backward, so `retain_graph` and repeated
  backward passes gather again.
- At the end of each backward every unit still gathered is released.
- What is gathered is really freed on release, also under the views autograd saved; see
  [Note: freeing gathered parameters] in zero/stages/unit.py. A unit whose module hides its
  outputs from the hooks (no tensor in a tensor/tuple/list/dict/dataclass output needs a
  gradient, though its parameters do) is not released until the end of backward, since nothing
  would gather it again before backward reads it.

[Note: prefetch and reuse]
Each forward pass (from the root module's pre-hook to its post-hook) and each backward pass
records the order in which units were gathered. The next pass of the same kind follows that
trace: after gathering trace[i] it starts the all-gather of trace[i+1] (always, if the gathered
total stays within `stage3_max_live_parameters`), then trace[i+2], ... while their elements stay
within `stage3_prefetch_bucket_size`; 0 turns prefetching off. As soon as a pass deviates from its
trace (eval, another branch), prefetching stops for that pass, and the pass's own order becomes
the trace for the next one: the runtime re-records rather than giving up on prefetching. Shards
on NVMe are read into host buffers further ahead than that, as far as free buffers allow (see
[Note: parameters on NVMe] in zero/offload/param_swap.py). A unit
whose next use in the recorded traces is within `stage3_max_reuse_distance` gathered elements is
kept after its forward instead of being released, while `stage3_max_live_parameters` allows.
Prefetch decisions depend only on the traces, so every rank issues the same collectives in the
same order.

[Note: rank-divergent control flow]
Before every all-gather and reduce-scatter of a unit, the ranks all-gather a tag (unit, phase) on a
control group of their own (gloo, host tensors; `Comm.control`), so a tag never waits behind the
data collectives in flight and never touches the GPU. If ranks disagree, every rank raises
RankDivergenceError with the unit each rank was at and the step; a tag exchange that never
completes (a rank stopped) raises CollectiveTimeout after ZERO_COLLECTIVE_TIMEOUT seconds instead
of hanging (see Comm.wait_for). With gloo data collectives each tag is checked before its
collective is issued, so mismatched collectives (which abort gloo) never start. With NCCL the tags
are checked together at the end of each backward (or of a forward without grad), so the CPU never
waits per unit; NCCL does not check sizes, so there the check is best effort, and
`enable_sanity_checks` (or TORCH_DISTRIBUTED_DEBUG=DETAIL) checks each tag before its collective,
at one host round trip per collective.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn

from zero.graph import graph_outputs, in_backward
from zero.init import external_parameters
from zero.parallel.comm import Comm
from zero.parallel.tags import Tag
from zero.stages.placement import ReplicasSummedError
from zero.stages.policies import ReduceOptions, Stage3Options
from zero.stages.readiness import GradReadiness
from zero.stages.unit import ParamUnit, ShardedState

FORWARD, BACKWARD, REDUCE = "forward", "backward", "reduce"  # what a unit collective is for
_PHASE_TAG = {FORWARD: Tag.UNIT_FORWARD, BACKWARD: Tag.UNIT_BACKWARD, REDUCE: Tag.UNIT_REDUCE}


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the module's backward has produced
    the gradients of those inputs: the module's own backward is then done (FSDP2 does the same)."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class Stage3Runtime:
    """Hooks, traces, prefetch and divergence tags around the units of one model.

    Args:
        module: the root module.
        units: its units, in module order.
        unit_modules: the module whose forward uses each unit (None for the persistent unit).
        comm: the data-parallel group.
        options: stage-3 policies.
        reduce: gradient-reduction policies.
        predivide: gradients are divided by this before their reduction.
        names: parameter names, for messages.
        step: the number of the current optimizer step, for messages.
        grad_final: called with each gradient shard once it is reduced (offload copies it out).
    """

    def __init__(self, module: nn.Module, units: list[ParamUnit], unit_modules: list[nn.Module | None], comm: Comm,
                 options: Stage3Options, reduce: ReduceOptions, predivide: float, names: dict[nn.Parameter, str],
                 step: Callable[[], int], grad_final: Callable[[torch.Tensor], None]):
        self.module, self.units, self.comm, self.options = module, units, comm, options
        self.predivide, self._step, self._grad_final = predivide, step, grad_final
        self.replicas_summed = False  # see [Note: the replicas' sum, once] in zero/stages/placement.py
        self.replicas_owed = False  # a unit was reduced in its shard group since the gradients were zeroed
        self.reserved = 0  # elements of non-resident units gathering or gathered (what max_live caps)
        self.prefetched = 0  # gathers started ahead of use
        self.traces: dict[str, list[int]] = {FORWARD: [], BACKWARD: []}
        self._pass: str | None = None
        self._recording: list[int] = []
        self._pos = 0
        self._following = False
        self._reuse: dict[bool, dict[int, float]] = {}  # see _reuse_distances
        self._control = comm.control()  # tags travel on their own (gloo, host) group
        self._reducible = [u for u in units if u.trainable]
        self.readiness = GradReadiness(
            [u.trainable for u in self._reducible], take=lambda gi, p: None, launch=self._launch_reduce,
            finish=self._finish_reduce, comm=comm, ordered=False, overlap=reduce.overlap_comm, names=names,
            ignore_unused=reduce.ignore_unused_parameters, on_end=self._end_backward)
        # [Note: leaf units]
        # A unit marked with set_z3_leaf_modules (a mixture-of-experts block, say) may run only some
        # of its parameters, different ones on different ranks, so its gradients are complete at a
        # different point of the backward on each rank. Its reduction is launched instead when its
        # module's backward is done (the identity on the module's inputs, as for frozen weights):
        # the same point on every rank. A gradient that lands after it is re-sent at the end.
        for unit, mod in zip(units, unit_modules):
            unit.leaf = bool(getattr(mod, "_zero_unit", False)) and unit.trainable != []
        self.readiness.on_signal = {gi for gi, u in enumerate(self._reducible) if u.leaf}
        self._install_hooks(unit_modules)

    # -- hooks --------------------------------------------------------------------------------------

    def _install_hooks(self, unit_modules: list[nn.Module | None]) -> None:
        """The module hooks that gather and release units around forward (backward's are set
        on the outputs during forward). Their handles are in `forward_hooks`, as DeepSpeed's
        stage-3 optimizer keeps them, for code that removes them around generation with every
        parameter gathered (TRL's unwrap_model_for_generation) and puts them back with
        `_register_hooks_recursively`."""
        this = weakref.proxy(self)
        root = self.module
        self._unit_modules = unit_modules
        hooks = self.forward_hooks = []
        self.backward_hooks: list = []
        hooks.append(root.register_forward_pre_hook(lambda m, a: this._begin_forward()))
        for unit, mod in zip(self.units, unit_modules):
            if mod is not None:
                hooks.append(mod.register_forward_pre_hook(lambda m, a, u=unit: this._pre_forward([u], a)))
                hooks.append(mod.register_forward_hook(lambda m, a, out, u=unit: this._post_forward([u], out)))
        for mod in root.modules():
            external = [p._zero.unit for p in external_parameters(mod) if getattr(p, "_zero", None)]
            users = sorted({u.index: u for u in external if not u.resident}.values(), key=lambda u: u.index)
            if users:
                hooks.append(mod.register_forward_pre_hook(lambda m, a, us=users: this._pre_forward(us, a)))
                hooks.append(mod.register_forward_hook(lambda m, a, out, us=users: this._post_forward(us, out)))
        hooks.append(root.register_forward_hook(lambda m, a, out: this._end_forward(out)))

    def _register_hooks_recursively(self, module: nn.Module | None = None, *args) -> None:
        """Put the forward hooks back (after code removed them): DeepSpeed's name, which TRL
        calls (`_register_deepspeed_module` in its older releases)."""
        for handle in self.forward_hooks:
            handle.remove()
        self._install_hooks(self._unit_modules)

    _register_deepspeed_module = _register_hooks_recursively

    # -- passes and traces --------------------------------------------------------------------------

    def _begin_pass(self, phase: str) -> None:
        self._pass = phase
        self._recording = []
        self._pos = 0
        self._following = bool(self.traces[phase])

    def _end_pass(self) -> None:
        if self._pass is not None and self._recording != self.traces[self._pass]:
            if self.options.log_trace_changes and self.traces[self._pass] and self.comm.rank == 0:
                warnings.warn(f"zero: stage 3 re-recorded the {self._pass} "
                              f"order of units at step {self._step()} (the model ran modules in a new order)",
                              stacklevel=2)
            self.traces[self._pass] = self._recording
            self._reuse = self._reuse_distances()
        self._pass = None
        self._recording = []

    def _reuse_distances(self) -> dict[bool, dict[int, float]]:
        """For each forward trace position, the gathered elements between it and its unit's next
        use: later in this forward, or (keyed True, when a backward follows) in the backward."""
        out: dict[bool, dict[int, float]] = {}
        for with_backward in (False, True):
            upcoming = self.traces[FORWARD] + (self.traces[BACKWARD] if with_backward else [])
            dist: dict[int, float] = {}
            for pos, idx in enumerate(self.traces[FORWARD]):
                distance, counted = 0, set()
                dist[pos] = float("inf")
                for later in upcoming[pos + 1 :]:
                    if later == idx:
                        dist[pos] = distance
                        break
                    if later not in counted:
                        counted.add(later)
                        distance += self.units[later].full_numel
            out[with_backward] = dist
        return out

    def _record(self, unit: ParamUnit) -> None:
        unit.trace_pos = len(self._recording)
        self._recording.append(unit.index)
        trace = self.traces.get(self._pass, [])
        if self._following:
            if self._pos < len(trace) and trace[self._pos] == unit.index:
                self._pos += 1
            else:
                self._following = False

    def _prefetch(self) -> None:
        if not self._following or self.options.prefetch_elements <= 0:
            return
        budget = 0
        ahead = self.traces[self._pass][self._pos :]
        stopped = len(ahead)
        in_flight = set()  # (a unit may come more than once ahead)
        for k, idx in enumerate(ahead):
            unit = self.units[idx]
            if unit.state is ShardedState.GATHERING:  # in flight already: its elements are in the budget
                if idx not in in_flight:
                    in_flight.add(idx)
                    budget += unit.full_numel
                continue
            if unit.state is not ShardedState.SHARDED:
                continue
            # the next unit is always fetched ahead (one larger than the budget would otherwise
            # never be prefetched); further ones while they fit in the budget, and a shard on
            # NVMe while a buffer can take it
            if (budget and budget + unit.full_numel > self.options.prefetch_elements) or \
                    self.reserved + unit.full_numel > self.options.max_live_elements or \
                    (unit.swap is not None and not unit.swap.fetch(unit)):
                stopped = k
                break
            budget += unit.full_numel
            self._start_gather(unit, self._pass)
            self.prefetched += 1
        self._read_ahead(ahead[stopped:])

    def _read_ahead(self, order: list[int]) -> None:
        """Start reading the shards on NVMe of the units in `order` into free buffers, nearest first,
        looking no further than the buffers could hold (see [Note: parameters on NVMe])."""
        seen = 0
        for idx in order:
            unit = self.units[idx]
            if unit.swap is None or unit.state is not ShardedState.SHARDED:
                continue
            seen += 1
            if seen > unit.swap.policy.buffer_count or not unit.swap.fetch(unit):
                break

    # -- divergence tags ------------------------------------------------------------------------------

    def _describe(self, unit: ParamUnit, phase: str) -> str:
        what = "gradient reduce-scatter" if phase == REDUCE else "all-gather"
        return f"the {what} of unit {unit.label}"

    def _exchange_tag(self, unit: ParamUnit, phase: str) -> None:
        """See [Note: rank-divergent control flow]."""
        if self.comm.world_size == 1:  # nothing to agree on: no closure per gather on this hot path
            return
        step = self._step()
        # the third field: whether the gather comes from hpZ's secondary shards (ranks that disagree
        # would issue different collectives; see [Note: hpZ] in zero/stages/unit_params.py)
        self.comm.tagged(_PHASE_TAG[phase], unit.index, int(unit.secondary is not None and phase != REDUCE),
                         lambda: f"ZeRO-3 step {step}, {self._describe(unit, phase)}", self._unit_label,
                         advice=" (rank-dependent branches, early exits or a different number of forward passes "
                                "cause this; for generation pass synced_gpus=True)")

    def _unit_label(self, i: int) -> str:
        return self.units[i].label if 0 <= i < len(self.units) else f"#{i}"

    def _wait(self, work, what: str, comm: Comm | None = None) -> None:
        """Wait for a collective of `comm` (default: the data group); see Comm.wait_for."""
        (comm or self.comm).wait_for(work, lambda: f"ZeRO-3 step {self._step()}: {what}")

    # -- gather and release ---------------------------------------------------------------------------

    def _start_gather(self, unit: ParamUnit, phase: str) -> None:
        self._make_room(unit.full_numel)
        self._exchange_tag(unit, phase)
        unit.start_gather()
        self.reserved += unit.full_numel

    def _finish_gather(self, unit: ParamUnit) -> None:
        what = self._describe(unit, FORWARD)
        unit.finish_gather(lambda work: self._wait(work, what))

    def _make_room(self, need: int) -> None:
        """Release idle gathered units until `need` more elements fit under max_live."""
        for unit in self.units:
            if self.reserved + need <= self.options.max_live_elements:
                return
            if unit.state is ShardedState.GATHERED and self._idle(unit):
                self._release(unit)

    @staticmethod
    def _idle(unit: ParamUnit) -> bool:
        return not unit.resident and unit.forward_uses == 0 and not unit.needed_in_backward

    def _release(self, unit: ParamUnit) -> None:
        unit.free()
        self.reserved -= unit.full_numel

    def _acquire(self, unit: ParamUnit, phase: str) -> None:
        self._record(unit)
        if unit.state is ShardedState.SHARDED:
            self._start_gather(unit, phase)
        if unit.state is ShardedState.GATHERING:
            self._finish_gather(unit)
        self._prefetch()

    def _finish_prefetches(self) -> None:
        """Complete gathers the pass started but did not use, and release them."""
        for unit in self.units:
            if unit.state is ShardedState.GATHERING:
                self._finish_gather(unit)
                if self._idle(unit):
                    self._release(unit)

    def release_all(self) -> None:
        """Release every unit that is not resident (after a step the gathered values are stale)."""
        self._finish_prefetches()
        for unit in self.units:
            unit.forward_uses = 0
            unit.needed_in_backward = unit.grads_done = unit.inputs_done = False
            unit.drop_secondary()  # kept from a forward for its backward only (see [Note: hpZ])
            if unit.state is ShardedState.GATHERED and not unit.resident:
                self._release(unit)

    # -- forward ----------------------------------------------------------------------------------------

    def _begin_forward(self) -> None:
        if in_backward():  # a forward re-run inside backward (activation checkpointing)
            return
        self.recover()
        if self._pass == FORWARD:  # the previous forward raised before its end: its uses are over
            for unit in self.units:
                unit.forward_uses = 0
        self._begin_pass(FORWARD)

    def _pre_forward(self, units: list[ParamUnit], args: tuple):
        recompute = in_backward()  # activation checkpointing re-runs the forward inside backward
        for unit in units:
            self._acquire(unit, BACKWARD if recompute else FORWARD)
            unit.forward_uses += 1
        frozen = [u for u in units if u.has_frozen or u.leaf]
        if frozen and torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            # a unit with frozen weights is released when the module's backward is done, not when
            # its (trainable) gradients are: see [Note: stage 3 hooks]
            this = weakref.proxy(self)
            positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            wrapped = _PostBackward.apply(lambda: this._post_backward(frozen), *(args[i] for i in positions))
            args = list(args)
            for i, t in zip(positions, wrapped):
                args[i] = t
            return tuple(args)
        return None

    def _post_forward(self, units: list[ParamUnit], output):
        grad = torch.is_grad_enabled()
        hooked = graph_outputs(output) if grad else []
        recompute = in_backward()
        for unit in units:
            unit.forward_uses -= 1
            if grad and (recompute or (not hooked and any(p.requires_grad for p in unit.params))):
                # a recomputed unit is used by the backward that follows at once; a unit whose
                # outputs hide from the hooks would not be gathered again: keep both
                unit.needed_in_backward = True
            if unit.forward_uses == 0 and unit.state is ShardedState.GATHERED and self._idle(unit):
                if not self._kept_for_reuse(unit):
                    self._release(unit)
        if hooked:
            fired = [None]  # the backward (graph task) it last fired in: once per backward, also with retain_graph
            this = weakref.proxy(self)

            def before_backward(grad_out, us=units):
                task = torch._C._current_graph_task_id()
                if fired[0] != task:
                    fired[0] = task
                    this._pre_backward(us)
                return grad_out

            for t in hooked:
                t.register_hook(before_backward)
        return output

    def _kept_for_reuse(self, unit: ParamUnit) -> bool:
        if self.reserved > self.options.max_live_elements or self._pass != FORWARD or not self._following:
            return False
        distance = self._reuse.get(torch.is_grad_enabled(), {}).get(unit.trace_pos, float("inf"))
        return distance < self.options.max_reuse_distance

    def _end_forward(self, output) -> None:
        if in_backward():
            return
        self.readiness.hook_outputs(output)
        self._finish_prefetches()
        if not torch.is_grad_enabled():  # no backward follows: drop what is only kept for it
            for unit in self.units:
                if unit.state is ShardedState.GATHERED and self._idle(unit):
                    self._release(unit)
            self.comm.check_deferred()
        self._end_pass()

    # -- backward ---------------------------------------------------------------------------------------

    def _post_backward(self, units: list[ParamUnit]) -> None:
        """The gradients of a module's inputs are done; a unit with frozen weights is not needed
        any more once its trainable parameters' gradients are done too."""
        for unit in units:
            unit.inputs_done = True
            if unit.leaf and unit.trainable and not unit.grads_done:  # see [Note: leaf units]
                self.readiness.launch_now(self._reducible.index(unit))
            if not unit.trainable or unit.grads_done:
                self._done_in_backward(unit)

    def _done_in_backward(self, unit: ParamUnit) -> None:
        unit.needed_in_backward = False
        if unit.state is ShardedState.GATHERED and self._idle(unit):
            self._release(unit)

    def _pre_backward(self, units: list[ParamUnit]) -> None:
        self.readiness.begin_backward()
        if self._pass != BACKWARD:
            self._begin_pass(BACKWARD)
        for unit in units:
            self._acquire(unit, BACKWARD)
            unit.needed_in_backward = True

    def _launch_reduce(self, gi: int) -> None:
        unit = self._reducible[gi]
        if unit.placement.defers_replicas:
            if self.replicas_summed:  # before any shard changes
                raise ReplicasSummedError(unit.name or "<root>")
            self.replicas_owed = True
        self._exchange_tag(unit, REDUCE)
        unit.grads_done = True
        if not unit.has_frozen or unit.inputs_done:  # nothing in backward needs its values any more:
            self._done_in_backward(unit)  # free them before the reduce buffer is allocated
        unit.start_reduce(self.predivide)

    def _finish_reduce(self, gi: int) -> None:
        unit = self._reducible[gi]
        what = self._describe(unit, REDUCE)
        grads = unit.finish_reduce(lambda work: self._wait(work, what))
        if not unit.placement.defers_replicas:  # else final once the replicas summed them (UnitParams.reduce_gradients)
            for grad in grads:
                self._grad_final(grad)

    def _end_backward(self) -> None:
        """Runs once at the end of each backward, after every reduction finished."""
        self.release_all()
        self.comm.check_deferred()
        self._end_pass()
        self.read_ahead()

    def read_ahead(self) -> None:
        """Start reading the shards on NVMe the next forward gathers first, into free buffers (see
        [Note: parameters on NVMe]); after a step, once the step wrote them."""
        self._read_ahead(self.traces[FORWARD])

    def recover(self) -> None:
        """Drop what a backward that raised left behind (see [Note: gradient readiness])."""
        if self.readiness.recover():  # which checked the deferred tags
            self.release_all()
            self._pass = None

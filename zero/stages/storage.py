"""Where a stage keeps the parameters, their optimizer state and their gradient shards.

`ParamStorage` is what the optimizer's step sees of a stage (its slots, how gradients are
finished and how updated shards reach the model), what checkpoints read and write (each
parameter's chunks), and what happens when user code changes a parameter (an in-place edit, a
`load_state_dict`): those hooks belong to the storage that holds the values, as FSDP2 registers
them on its parameters. Two implementations: `FlatParams` (stages 0-2, one flat buffer in
buckets; zero/stages/buckets.py) and `UnitParams` (stage 3, parameter units;
zero/stages/unit_params.py).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from zero.offload.policy import OffloadPolicy
from zero.offload.store import make_store
from zero.ops.adam_formats import Q8_BLOCK
from zero.parallel.comm import Comm
from zero.stages.memory import Gauges
from zero.stages.policies import Precision
from zero.state import StateSpec, StateSpecs


@dataclass(eq=False)
class Slot:
    """One contiguous range of one param group that the optimizer steps on.

    Args:
        group: the param group's index.
        master: the master weights of the range (fp32, or bf16 with a bf16 master).
        grad: its reduced gradient shard.
        state: the optimizer state of its param group's rule, by name (see [Note: declared state]
            in zero/optim/rules.py), each tensor as `specs` declares it.
        specs: the declaration of `state`.
        out16: where the updated values go in the model's dtype, or None (the master is the
            parameter itself).
        index: the global position of the range's first element in the model's layout (the
            stochastic-rounding counter, so that rounding does not depend on how the model is split).
        matrix: a Muon slot is one whole matrix (see [Note: Muon and partitions] in
            zero/optim/muon.py): its shape.
    """

    group: int
    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    specs: tuple[StateSpec, ...]
    out16: torch.Tensor | None
    index: int = 0
    matrix: tuple[int, int] | None = None

    def tile(self, lo: int, hi: int, grad: torch.Tensor, out16: torch.Tensor | None) -> Slot:
        """Elements [lo, hi) (whole 8-bit blocks: `lo` a multiple of Q8_BLOCK) with this gradient
        and output: per-element state sliced, block state sliced by blocks, scalars shared."""
        state = {}
        for spec in self.specs:
            t = self.state[spec.name]
            state[spec.name] = t[lo:hi] if spec.per == "element" else \
                t[lo // Q8_BLOCK : -(-hi // Q8_BLOCK)] if spec.per == "block" else t
        return Slot(self.group, self.master[lo:hi], grad, state, self.specs, out16, self.index + lo, self.matrix)

    def with_grad(self, grad: torch.Tensor) -> Slot:
        """The same slot with another copy of its gradient (offload's host copy)."""
        return dataclasses.replace(self, grad=grad)


class ParamStorage(abc.ABC):
    """Parameters, optimizer state and gradient shards of one stage, on this rank.

    Args:
        params: the trainable parameters, in param-group order.
        names: parameter -> name in the model, for messages.
        comm: the data-parallel group.
        precision: the run's dtypes.
        offload: where the optimizer state lives (zero/offload/policy.py; None: with the model).
        gauges: where communication and gathered buffers are measured.
        grad_final: called with each gradient shard once it holds its final value for the step
            (offload starts its copy to the host then); given by the optimizer that steps on it.
        step_number: the number of the coming optimizer step (for messages and schedules).
        state_specs: the optimizer state each param group keeps (see [Note: declared state] in
            zero/optim/rules.py); given by the optimizer.
        device: where the model computes.
    """

    def __init__(self, params: list[nn.Parameter], names: dict[nn.Parameter, str], comm: Comm,
                 precision: Precision, offload: OffloadPolicy | None, gauges: Gauges, *,
                 grad_final: Callable[[torch.Tensor], None], step_number: Callable[[], int],
                 state_specs: StateSpecs, device: torch.device):
        self.params = params
        self.names = names
        self.comm = comm
        self.precision = precision
        self.gauges = gauges
        # the optimizer state: where the offload policy puts it (see [Note: offload policies])
        self.store = make_store(offload, device, self, step_number)
        self.host_memory = self.store.memory
        self._watched: list[nn.Parameter] = []
        self.grad_final = grad_final
        self.step_number = step_number
        self.state_specs = state_specs

    def __getstate__(self) -> dict:
        """Nothing: the model's hooks hold the storage, and `torch.save(model)` (or a deepcopy of the
        model, for an EMA copy) must not take the optimizer state or a process group along. The
        copy's hooks find an empty storage and do nothing (see `inert`)."""
        return {}

    @property
    def inert(self) -> bool:
        """A copy made by pickling or deepcopy of the model: its hooks leave the copy alone."""
        return "params" not in self.__dict__

    def new_master(self, shard: torch.Tensor, alias: bool) -> torch.Tensor:
        """The master of `shard` (this rank's part of the parameters): the shard itself when it is
        its own master (`alias`), else a new tensor of the master format (values set by the caller)."""
        return self.store.new_master(shard, self.precision.adam.master_dtype, alias)

    def new_states(self, group: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer state param group `group` declares, for the master `like` (in the store)."""
        return self.store.new_states(self.state_specs(group), like)

    # -- what the step sees -----------------------------------------------------------------------

    @abc.abstractmethod
    def slots(self) -> list[Slot]:
        """This rank's shards, one slot per contiguous range of one param group."""

    # memory-report kinds a forward reads besides the parameters (engine.offload_states must not
    # have moved them): stage 3 gathers Muon's matrices from their owners' masters
    forward_kinds: frozenset[str] = frozenset()

    def reduce_gradients(self) -> None:
        """Finish any gradient reduction still owed at the accumulation boundary (none here)."""
        return None

    def sum_replicas(self) -> None:
        """Hybrid sharding at stages 2-3: sum the reduced gradient shards over the replicas now,
        once per optimizer step (the step does it otherwise; see [Note: the replicas' sum, once] in
        zero/stages/placement.py). Collective over the replicate group. Nothing to do here."""
        return None

    @abc.abstractmethod
    def publish(self) -> None:
        """Make the updated shards visible to the model (all-gather them, release stale copies)."""

    def release_gathered(self) -> None:
        """Free copies of parameters made for computing (stage 3's gathered units); none here."""
        return None

    def close(self) -> None:
        """Remove what outlives the process otherwise (NVMe offload's swap files)."""
        self.store.close()

    @property
    def replicate(self):
        """The group holding copies of this rank's partition (hybrid sharding), or None."""
        return None

    def side_comms(self) -> list:
        """Comms of its own besides the data-parallel groups (stage 3's hpZ node group), whose counts
        join the comm report."""
        return []

    def in_files(self, t: torch.Tensor) -> bool:
        """Is `t` a view of values kept in a swap file (NVMe offload)? Checkpoints write those from
        the file's mapping instead of a host copy."""
        return self.store.in_files(t)

    @abc.abstractmethod
    def zero_grads(self) -> None:
        """Forget this step's gradients."""

    def norm_is_partitioned(self) -> bool:
        """True when each rank holds a different part of the gradient (so norms are summed)."""
        return self.comm.world_size > 1

    @property
    def summed(self) -> int:
        """Ranks whose gradients a reduced gradient sums: the data-parallel world of the step's
        divisor (see [Note: one divisor] in zero/optim/step.py and [Note: placements])."""
        return self.comm.world_size

    def norm_copies(self) -> int:
        """Data-parallel ranks holding each element of the reduced gradient (a norm summed over all
        of them counts it this many times)."""
        return 1 if self.norm_is_partitioned() else self.comm.world_size

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The part of `param`'s reduced gradient in this rank's slots (for the norm), or None."""
        return None

    @abc.abstractmethod
    def out16_on_host(self) -> bool:
        """Do the slots' 16-bit outputs live in host memory (stage 3 with offload_param)?"""

    @abc.abstractmethod
    def memory_parts(self) -> tuple[dict[str, list[torch.Tensor]], set[str]]:
        """(kind -> tensors holding it, kinds kept in host memory), for the memory report."""

    def memory_extras(self, report: dict[str, int]) -> None:
        """Add stage-specific entries to a measured report (none here)."""
        return None

    # -- checkpoints (see [Note: checkpoint chunks] in zero/checkpoint/chunks.py) -----------------

    @abc.abstractmethod
    def param_chunks(self, param: nn.Parameter, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        """(kind, offset, local 1-D view) of `param`'s global tensors this rank writes (`saving`)
        or reads: kind "model" (the parameter in the training dtype), and for a trainable
        parameter "master" and each state its update rule declares ("exp_avg" and "exp_avg_sq" for
        Adam; see [Note: declared state] in zero/optim/rules.py)."""

    @abc.abstractmethod
    def grad_piece(self, param: nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        """Where `param`'s gradient is on this rank: (offset into the flattened parameter, 1-D
        view, reduced). A reduced piece (stages 2 and 3, once its reduction finished) is this
        rank's part of the sum over ranks; an unreduced one (stages 0 and 1 until the step reduces
        the flat gradient) is this rank's own gradient, whole."""

    def state_written(self) -> None:
        """An accessor wrote into the store's views: encode what it wrote (8-bit moments)."""
        self.store.commit_views()

    def after_checkpoint_load(self) -> None:
        """Make the loaded values visible to the model (16-bit copies, gathered units)."""
        self.store.commit_views()
        self.publish()

    # -- user code changing parameters --------------------------------------------------------------

    def watch_edits(self, params: list[nn.Parameter]) -> None:
        """[Note: in-place edits]
        A parameter changed in place between steps (`with torch.no_grad(): p.mul_(0.5)`, an
        init function) changes only the model's copy: in 16-bit training the next step would
        overwrite it from the fp32 master, and under stage 3 a released parameter has no values
        to change. Every in-place op bumps the parameter's autograd version counter (zero's own
        writes go through the buffers the parameters view, which leaves it alone), so at each step
        `adopt_edits` finds the parameters whose version moved: the storage takes their new
        values into its own copies (`adopt_edit`), or, for a released stage-3 parameter, raises.
        Edits through `p.data` bypass the counter and are not seen."""
        self._watched = list(params)
        self.edits_seen(self._watched)

    @staticmethod
    def edits_seen(params) -> None:
        """Forget in-place changes of `params` so far (their values are already where they belong)."""
        for p in params:
            p._zero_version = p._version

    def adopt_edits(self) -> None:
        """See [Note: in-place edits]."""
        for p in self._watched:
            if p._version != p._zero_version:
                self.adopt_edit(p)
                p._zero_version = p._version

    @abc.abstractmethod
    def adopt_edit(self, param: nn.Parameter) -> None:
        """Take `param`'s current (edited) values into the storage's own copies."""

    def is_matrix(self, param: nn.Parameter) -> bool:
        """Does Muon update `param` (whole, on one owner rank; see zero/optim/muon.py)?"""
        return False

    def values_set(self, param: nn.Parameter) -> None:
        """`param`'s master and shards were set on every rank (a collective accessor): bring copies
        made from them up to date (stage 3's persistent units); none here."""
        return None

    @abc.abstractmethod
    def load_param(self, param: nn.Parameter, value: torch.Tensor) -> torch.Tensor | None:
        """Take `value` (the full, correctly shaped new value of `param`) into the storage's own
        copies; return what torch should copy into `param.data` instead of `value`, if anything."""

    def hook_state_dict_loads(self, module: nn.Module) -> None:
        """[Note: load_state_dict after initialize]
        `model.load_state_dict(sd)` after `zero.initialize` writes the model's (16-bit, or under
        stage 3 released and empty) parameters; left alone, the next step would overwrite them
        from the stale fp32 master. A pre-hook on every module with parameters of its own hands
        each incoming value to `load_param` first, which puts it where this storage keeps it
        (the master's exact fp32 values, stage 3's shard), then lets torch finish."""
        for m in module.modules():  # bound methods, not lambdas: the model stays picklable
            own = list(m.named_parameters(recurse=False))
            if own:
                m.register_load_state_dict_pre_hook(functools.partial(self._before_load, own))
                m.register_load_state_dict_post_hook(functools.partial(self._after_load, own))

    def _after_load(self, own: list, module, incompatible_keys) -> None:
        if not self.inert:
            self.edits_seen(p for _, p in own)

    @torch.no_grad()
    def _before_load(self, own: list, module, state_dict: dict, prefix: str, local_metadata: dict, strict, missing,
                     unexpected, errors: list[str]) -> None:
        if self.inert:
            return
        if local_metadata.get("assign_to_params_buffers"):
            errors.append("load_state_dict(assign=True) after zero.initialize would replace the parameters the "
                          "engine trains (their gradients would never reach it); load without assign=True")
            return
        for name, p in own:
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if getattr(p, "_zero", None) is not None and hasattr(p, "_local_tensor"):
                errors.append(f"{key}: load_state_dict into a tensor-sliced parameter under ZeRO stage 3 is not "
                              f"implemented; load the state dict before zero.initialize, or use "
                              f"engine.load_checkpoint")
                state_dict.pop(key)
                continue
            shape = p._zero.shape if getattr(p, "_zero", None) is not None else p.shape
            if value.shape != shape:
                errors.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                              f"the shape in current model is {shape}.")
                state_dict[key] = p.data  # torch's own message would show a released parameter's empty shape
                continue
            replacement = self.load_param(p, value)
            if replacement is not None:
                state_dict[key] = replacement

"""The optimizer step every stage shares: norm, overflow check, clipping and Adam on this rank's shards.

[Note: one divisor]
Gradients reach the shard as sums over ranks and micro-batches. The mean gradient is
`sum / (world_size / predivide) / accumulation_steps`, and clipping multiplies it by `clip_coef`.
All of that is one number, `grad_scale = world_size / predivide * accumulation_steps / clip_coef`,
which the Adam kernel divides by in the same pass that updates the weights: no separate unscale,
average or clip pass over the gradients. In fp32 and bf16 the loss is not divided by anything,
so `loss.backward()` and `engine.backward(loss)` give the same gradients. Under fp16 the loss is
multiplied by `loss_scale / accumulation_steps` (DeepSpeed's scaling, which keeps fp16 gradients'
headroom the same as there), so there the divisor holds `loss_scale` in place of
`accumulation_steps` (`StepOptions.accumulation` is 1). The norm is computed from the shard in one
pass per slot and one all-reduce; an inf or NaN anywhere makes the norm non-finite, which is also
the overflow test (see [Note: norm without overflow]).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch.autograd.profiler import record_function

from zero.offload.host import HostAdam
from zero.optim.loss_scale import LossScaler
from zero.optim.rules import ClientRule, UpdateRule
from zero.parallel.comm import Comm
from zero.stages.memory import measure_kinds
from zero.stages.policies import Precision, StepOptions
from zero.stages.storage import ParamStorage, Slot
from zero.state import StateSpec

logger = logging.getLogger("zero")
_FP32_MAX = float(torch.finfo(torch.float32).max)
ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True, adamw_mode=True)


class ShardedOptimizer(torch.optim.Optimizer):
    """The optimizer over this rank's shards: the step every stage shares, each param group
    updated by its rule (Adam/AdamW in every state format, Muon, or a client optimizer; see
    [Note: declared state] in zero/optim/rules.py).

    Behaves as a torch optimizer for schedulers and user code (`param_groups` with `lr`, `betas`,
    ... per group), but `step()` is meant to be called by the engine at the accumulation
    boundary. Where the shards are, how gradients reach them and how updated shards reach the
    model is the storage's business (`storage`: zero/stages/storage.py).

    Args:
        param_groups: torch-style groups of trainable parameters with their hyperparameters.
        storage: builds the stage's storage of parameters, optimizer state and gradient shards,
            given the optimizer's `grad_final` and `step_number` callbacks (ParamStorage's
            arguments of those names).
        comm: the data-parallel group.
        precision: the run's dtypes.
        step: clipping, predivide, accumulation and optimizer offload (see StepOptions).
        loss_scaler: fp16's dynamic loss scale (None: no scaling).
        rules: each param group's update rule (see [Note: declared state] in
            zero/optim/rules.py): Adam's, Muon's, a client optimizer's.
        model_parallel: the global norm over pipeline stages and tensor slices (zero/parallel/mesh.py's
            ModelParallelNorm), or None for a data-parallel model.
    """

    def __init__(self, param_groups, storage: Callable[..., ParamStorage], *, comm: Comm, precision: Precision,
                 step: StepOptions, rules: list[UpdateRule], loss_scaler: LossScaler | None = None,
                 model_parallel=None):
        super().__init__(param_groups, dict(ADAM_DEFAULTS))
        if len(rules) != len(self.param_groups):
            raise ValueError(f"{len(rules)} update rules for {len(self.param_groups)} param groups")
        self.rules = list(rules)
        self.comm = comm
        self.precision = precision
        self.options = step
        self.offload = step.offload  # where the state lives (zero/offload/policy.py)
        self.loss_scaler = loss_scaler or LossScaler.disabled()
        # a client optimizer's rule (its class and defaults), if the run has one
        self.client = next((r for r in self.rules if isinstance(r, ClientRule)), None)
        self.model_parallel = model_parallel
        self.at_boundary = True  # the engine says whether the coming backward ends an accumulation
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.step_count = 0
        self.global_grad_norm: float | None = None
        self.skipped: tuple[float, float, float] | None = None  # the last skipped step: (norm, scale before, after)
        self._host: HostAdam | None = None
        self.storage = storage(grad_final=self.grad_final, step_number=self.next_step_number,
                               state_specs=self.state_specs)
        self.gauges = self.storage.gauges

    def state_specs(self, group: int) -> tuple[StateSpec, ...]:
        """The optimizer state param group `group` keeps (see [Note: declared state] in zero/optim/rules.py)."""
        return self.rules[group].state(self.param_groups[group])

    def state_names(self, param: torch.nn.Parameter) -> tuple[str, ...]:
        """The names of the per-element state `param`'s rule keeps (what the accessors read)."""
        gi = next(i for i, g in enumerate(self.param_groups) if any(q is param for q in g["params"]))
        return tuple(s.name for s in self.state_specs(gi) if s.per == "element")

    def scalar_state(self) -> set[str]:
        """The names of per-slot scalar states any group keeps (a torch optimizer's `step`)."""
        return {s.name for gi in range(len(self.param_groups)) for s in self.state_specs(gi) if s.per == "scalar"}

    def next_step_number(self) -> int:
        """The number of the coming optimizer step (1 before the first)."""
        return self.step_count + 1

    # -- optimizer offload ------------------------------------------------------------------------

    def grad_final(self, grad: torch.Tensor) -> None:
        """The storage calls this when a gradient shard holds its final value for the step; with
        offload its copy to the host starts now, overlapping the rest of backward."""
        if self.offload.on_host and self.at_boundary:
            self._host_adam().grad_ready(grad)

    @property
    def host_adam(self) -> HostAdam | None:
        """The host side of optimizer offload, once it exists (None without offload)."""
        return self._host

    def _host_adam(self) -> HostAdam:
        if self._host is None:
            self._host = HostAdam(self.slots(), self.storage.store, getattr(self.storage, "swap", None))
        return self._host

    # -- the storage's view -----------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        """This rank's slots: each a range of one param group, with its master, gradient shard,
        declared state and 16-bit output (zero.stages.storage.Slot)."""
        return self.storage.slots()

    def reduce_gradients(self) -> None:
        """Finish any gradient reduction still owed at the accumulation boundary."""
        self.storage.reduce_gradients()

    def publish(self) -> None:
        """Make the updated shards visible to the model."""
        self.storage.publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (the engine does this after every step)."""
        if self._host is not None:
            self._host.discard()
        self.storage.zero_grads()
        for p in self.params:
            p.grad = None

    def rank_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state that belongs to this rank alone, not to any parameter's shard (1-bit
        Adam's error buffers); saved per rank by save_checkpoint. None here."""
        return {}

    def reset_rank_state(self) -> None:
        """Start `rank_state` afresh (a checkpoint's does not fit this run)."""
        for t in self.rank_state().values():
            t.zero_()

    def state_dict(self) -> dict:
        """The optimizer's own state besides its tensors (which checkpoints read and write through
        the storage's `param_chunks`): the step count, each group's hyperparameters and the loss
        scaler's progress. Plain values, JSON-serialisable."""
        fmt = self.precision.adam
        return {"step": self.step_count, "loss_scaler": self.loss_scaler.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "state_format": {"master": fmt.master, "state": fmt.state, "stochastic": fmt.stochastic}}

    def load_state_dict(self, state: dict) -> None:
        """Take what `state_dict` returned: the step count, the groups' hyperparameters (the same
        number of groups) and a dynamic loss scale's progress (this run's scaler settings stay)."""
        if not isinstance(state, dict) or not {"step", "loss_scaler", "param_groups"} <= set(state) <= \
                {"step", "loss_scaler", "param_groups", "state_format"}:
            raise ValueError(f"{type(self).__name__}.load_state_dict takes what its state_dict() returned "
                             f"({{'step', 'loss_scaler', 'param_groups'}}), got {type(state).__name__} "
                             f"{sorted(state) if isinstance(state, dict) else ''}")
        if len(state["param_groups"]) != len(self.param_groups):
            raise ValueError(f"the state has {len(state['param_groups'])} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        self.step_count = int(state["step"])
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.loss_scaler.load_progress(state["loss_scaler"])
        saved = state.get("state_format", {"master": "fp32", "state": "fp32"})  # older checkpoints: fp32
        fmt = self.precision.adam
        if (saved.get("master"), saved.get("state")) != (fmt.master, fmt.state):
            logger.info("zero: the optimizer state was saved with master %s / moments %s and is converted once "
                        "to this run's master %s / moments %s", saved.get("master"), saved.get("state"),
                        fmt.master, fmt.state)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind (measured from the storages: see
        zero/stages/memory.py), its host staging (offload), and the reduce buffers alive now and
        at most."""
        parts, host_kinds = self.storage.memory_parts()
        parts["host_staging"] = self._host.host_tensors() if self._host is not None else []
        parts["nvme_buffers"] = self.storage.store.buffers()
        store = self.storage.store
        report = measure_kinds(parts, host_kinds | store.host_kinds() | {"host_staging", "nvme_buffers"},
                               store.disk_kinds())
        g = self.gauges
        report["reduce_buffers"] = g.reduce_buffers.now
        report["reduce_buffers_peak"] = g.reduce_buffers.peak
        report["device_bytes"] += g.reduce_buffers.now + g.gather_buffers.now
        self.storage.memory_extras(report)
        return report

    @property
    def parameter_offload(self):
        """Stage 3's runtime, DeepSpeed's `optimizer.parameter_offload`: its `module`,
        `forward_hooks`, `backward_hooks` and `_register_hooks_recursively` (which TRL's
        unwrap_model_for_generation uses to remove and restore the hooks)."""
        runtime = getattr(self.storage, "runtime", None)
        if runtime is None:
            raise AttributeError("parameter_offload: only a stage-3 optimizer has one")
        return runtime

    def grad_divisor(self, reduced: bool) -> float:
        """What a gradient piece is divided by to give the mean gradient the step applies (before
        clipping); see [Note: one divisor]. An unreduced piece was not predivided."""
        divisor = self.storage.summed / self.options.predivide * self.options.accumulation * self.loss_scaler.scale
        return divisor if reduced else divisor * self.options.predivide

    # -- the step -----------------------------------------------------------------------------

    def check_hyperparameters(self) -> None:
        """Every group's lr and betas are usable, checked before the step changes anything (a
        scheduler or the user may have set them since the last step)."""
        check_param_groups(self.param_groups, "It was set by the lr scheduler or by code that edits "
                                              "optimizer.param_groups; nothing was updated.")

    def _grad_norm(self, slots: list[Slot]) -> float:
        """The 2-norm of the reduced gradient (before unscaling), over all slots and ranks.

        [Note: norm without overflow]
        Squares are summed in fp64, so gradients up to fp32's largest value give a finite norm (an
        fp32 sum of squares overflows from 1.8e19). A slot whose own fp32 norm overflows is
        measured again scaled by its largest element; only inf/NaN gradients make the norm
        non-finite."""
        device = slots[0].grad.device if slots else torch.device("cpu")  # where the gradients are
        norms = [torch.linalg.vector_norm(s.grad, dtype=torch.float32) for s in slots]
        total = self._sum_squares(norms, device)
        self._sum_over_ranks(total)
        norm_sq = total.item()  # the step's one host synchronisation for the norm
        if math.isfinite(norm_sq):
            return math.sqrt(norm_sq)
        # rare: some slot's fp32 norm overflowed (or a gradient is inf/NaN); every rank sees the
        # reduced total non-finite, so every rank measures again, scaled by each slot's largest element
        rescaled = []
        for g, n in zip((s.grad for s in slots), norms):
            if not torch.isfinite(n):
                top = g.abs().amax().float()
                n = top.double() * torch.linalg.vector_norm(g / top, dtype=torch.float32).double() \
                    if torch.isfinite(top) else top.double()
            rescaled.append(n)
        total = self._sum_squares(rescaled, device)
        self._sum_over_ranks(total)
        return math.sqrt(total.item())

    def _sum_over_ranks(self, total: torch.Tensor) -> None:
        """This rank's sum of squares -> the whole model's (over data shards, and with a
        ModelParallelNorm over pipeline stages and tensor slices too)."""
        if self.model_parallel is not None:
            self.model_parallel.reduce(self.storage, total)
        elif self.storage.norm_is_partitioned():
            self.comm.all_reduce(total, "sum")

    @staticmethod
    def _sum_squares(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        if norms:
            total += torch.stack([n.double() for n in norms]).square().sum()
        return total

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Reduce, check, clip and apply each param group's update rule to this rank's shards, then
        publish them.

        A step whose gradient holds inf or NaN (on any rank) is skipped on every rank and logged:
        parameters, master weights and optimizer state stay as they were, and the gradients are
        dropped. With fp16 this is the loss scale's overflow rule; in fp32 and bf16 it keeps one
        bad batch from turning every parameter into NaN.

        Returns:
            False if the step was skipped because a gradient was not finite, True otherwise.
        """
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step does not take a closure")
        self.check_hyperparameters()  # before anything changes
        self.storage.adopt_edits()
        with record_function("zero::reduce_gradients"):
            self.reduce_gradients()
        slots = self.slots()
        divisor = self.grad_divisor(reduced=True)

        with record_function("zero::grad_norm"):
            norm = self._grad_norm(slots)
        if not math.isfinite(norm):
            self._skip(norm)
            return False
        norm /= divisor
        self.global_grad_norm = norm
        clip_coef = 1.0
        if self.options.clipping > 0:  # as torch.nn.utils.clip_grad_norm_
            clip_coef = min(1.0, self.options.clipping / (norm + 1e-6))

        self.step_count += 1
        grad_scale = divisor / clip_coef
        if grad_scale > 1e30:  # a norm beyond fp32's range, clipped: the kernels take the divisor in fp32
            for slot in slots:
                slot.grad.div_(grad_scale / 1e30)
            grad_scale = 1e30
        self._update(slots, grad_scale)
        with record_function("zero::publish_params"):
            self.publish()
        self.loss_scaler.update(overflow=False)
        self.zero_grad()
        return True

    def _update(self, slots: list[Slot], grad_scale: float) -> None:
        """Apply each slot's update rule (see [Note: declared state] in zero/optim/rules.py): Muon
        to whole matrices, a client optimizer or Adam to the rest. With optimizer offload the
        masters and states are in host memory and the update runs there, on the gradients HostAdam
        copied over (see [Note: offload data path] in zero/offload/host.py)."""
        host = self._host_adam() if self.offload.on_host else None
        by_rule: dict[int, tuple[UpdateRule, list[Slot]]] = {}
        for slot in slots:
            rule = self.rules[slot.group]
            by_rule.setdefault(id(rule), (rule, []))[1].append(slot)
        for rule, members in sorted(by_rule.values(), key=lambda item: item[0].elementwise):  # whole-tensor rules first
            with record_function(f"zero::{rule.name.lower()}"):
                rule.update(self, members, grad_scale, host)

    def _skip(self, norm: float) -> None:
        """Skip this step: its gradient is inf or NaN on some rank (the engine logs it)."""
        before = self.loss_scaler.scale
        self.loss_scaler.update(overflow=True)
        self.skipped = (norm, before, self.loss_scaler.scale)
        self.global_grad_norm = None
        self.zero_grad()


def check_param_groups(groups: list[dict], source: str) -> None:
    """Raise ValueError naming the group whose lr is not a finite number in [0, fp32 max] or whose
    betas are not two numbers in [0, 1); `source` says where the value came from."""
    for i, g in enumerate(groups):
        lr, betas = g["lr"], tuple(g.get("betas", (0.9, 0.999)))
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and 0 <= lr <= _FP32_MAX):
            raise ValueError(f"param group {i} has lr={lr!r}: the learning rate must be a finite number >= 0 "
                             f"(and at most {_FP32_MAX:.3g}, the kernels compute in fp32). {source}")
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"param group {i} has betas={betas!r}: expected two numbers in [0, 1). {source}")
        if "eps" in g and not (isinstance(g["eps"], (int, float)) and math.isfinite(g["eps"]) and g["eps"] >= 0):
            raise ValueError(f"param group {i} has eps={g['eps']!r}: expected a finite number >= 0. {source}")

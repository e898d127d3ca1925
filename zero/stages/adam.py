"""The optimizer step every stage shares: norm, overflow check, clipping and Adam on this rank's shards.

[Note: one divisor]
Gradients reach the shard as sums over ranks (and micro-batches, each already divided by the
accumulation steps in `Engine.backward`), multiplied by the loss scale. The mean gradient is
`sum / (world_size / predivide) / loss_scale`, and clipping multiplies it by `clip_coef`. All of
that is one number, `grad_scale = world_size / predivide * loss_scale / clip_coef`, which the
Adam kernel divides by in the same pass that updates the weights: no separate unscale, average
or clip pass over the gradients. The norm is computed from the shard in one pass per slot and one
all-reduce; an inf or NaN anywhere makes the norm non-finite, which is also the overflow test
(see [Note: norm without overflow]).
"""
from __future__ import annotations

import abc
import functools
import math
import warnings
from typing import Any

import torch
from torch.autograd.profiler import record_function

from zero.comm import Comm
from zero.memory_report import Gauges, measure_kinds
from zero.offload import HostAdam, HostMemory
from zero.precision import LossScaler
from zero.stages.policies import Precision, StepOptions

_FP32_MAX = float(torch.finfo(torch.float32).max)
ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True, adamw_mode=True)

Slot = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class ShardedAdam(torch.optim.Optimizer, abc.ABC):
    """Adam/AdamW over this rank's shards: the step shared by every stage.

    Behaves as a torch optimizer for schedulers and user code (`param_groups` with `lr`, `betas`,
    ... per group), but `step()` is meant to be called by the engine at the accumulation
    boundary. Subclasses say where the shards are (`slots`), how gradients reach them
    (`reduce_gradients`), and how updated 16-bit shards reach the model (`publish`).

    Args:
        param_groups: torch-style groups of trainable parameters with Adam hyperparameters.
        comm: the data-parallel group.
        precision: the run's dtypes.
        step: clipping, predivide, overflow checks and optimizer offload (see StepOptions).
    """

    offload_param = False  # stage 3 with parameter offload says otherwise

    def __init__(self, param_groups, *, comm: Comm, precision: Precision, step: StepOptions,
                 loss_scaler: LossScaler | None = None):
        super().__init__(param_groups, dict(ADAM_DEFAULTS))
        self.comm = comm
        self.precision = precision
        self.options = step
        self.offload = step.offload
        self.loss_scaler = loss_scaler or LossScaler.disabled()
        self.at_boundary = True  # the engine says whether the coming backward ends an accumulation
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.step_count = 0
        self.global_grad_norm: float | None = None
        self.skipped: tuple[float, float, float] | None = None  # the last skipped step: (norm, scale before, after)
        self.host_memory = HostMemory(self)
        self.gauges = Gauges()  # communication and gathered buffers, measured as they come and go
        self._host: HostAdam | None = None
        self._warned_fallback = False
        self.client_class: type | None = None  # a non-Adam client optimizer (see [Note: other optimizers on shards])
        self.client_defaults: dict = {}
        self._client = None
        self.model_parallel = None  # a ModelParallelNorm when the model is split over stages or slices (zero/mesh.py)

    # -- where optimizer state lives -------------------------------------------------------------

    def new_state(self, like: torch.Tensor, compute_device: torch.device) -> torch.Tensor:
        """A zero fp32 optimizer-state tensor shaped like `like`: in host memory when offloaded
        (page-locked if asked), else on the compute device."""
        if self.offload is not None:
            t = self.host_memory.empty(like.shape, torch.float32, self.offload.pin_memory)
            return t.zero_()
        return torch.zeros(like.shape, dtype=torch.float32, device=compute_device)

    def grad_final(self, grad: torch.Tensor) -> None:
        """Reducers call this when a gradient shard holds its final value for the step; with
        offload its copy to the host starts now, overlapping the rest of backward."""
        if self.offload is not None and self.at_boundary:
            self._host_adam().grad_ready(grad)

    @property
    def host_adam(self) -> HostAdam | None:
        """The host side of optimizer offload, once it exists (None without offload)."""
        return self._host

    def _host_adam(self) -> HostAdam:
        if self._host is None:
            self._host = HostAdam(self.slots(), self.offload, self.host_memory)
        return self._host

    def out16_on_host(self) -> list[bool]:
        """Per slot: does its 16-bit output live in host memory (stage 3 with offload_param)?"""
        return [False] * len(self.slots())

    # -- this rank's optimizer state, wherever it lives -------------------------------------------

    def shard_state(self) -> list[dict[str, Any]]:
        """This rank's optimizer state, slot by slot, as host fp32 tensors: {"group", "master",
        "exp_avg", "exp_avg_sq"} plus the step count. The layout is the same whether the state lives
        on the device or (offloaded) on the host, so the state moves between the two."""
        return [{"group": g, "step": self.step_count, "master": m.detach().to("cpu", copy=True),
                 "exp_avg": ea.detach().to("cpu", copy=True), "exp_avg_sq": eas.detach().to("cpu", copy=True)}
                for g, m, _, ea, eas, _ in self.slots()]

    @torch.no_grad()
    def load_shard_state(self, state: list[dict[str, Any]]) -> None:
        """Load what `shard_state` returned (from this or an offloaded/non-offloaded twin) and
        refresh the model's 16-bit parameters from the loaded master."""
        slots = self.slots()
        if len(state) != len(slots):
            raise ValueError(f"shard state has {len(state)} slots, this optimizer has {len(slots)}")
        tensors = ("master", "exp_avg", "exp_avg_sq")
        for i, ((g, master, _, _, _, _), saved) in enumerate(zip(slots, state)):  # all checked before any is loaded
            absent = [k for k in ("group", "step", *tensors) if not isinstance(saved, dict) or k not in saved]
            if absent:
                raise ValueError(f"shard state slot {i} lacks {', '.join(map(repr, absent))}; load_shard_state takes "
                                 f"what shard_state() returned: per slot a dict with 'group', 'step', "
                                 f"{', '.join(map(repr, tensors))}")
            for key in tensors:
                value = saved[key]
                if not isinstance(value, torch.Tensor) or saved["group"] != g or value.shape != master.shape:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"shard state slot {i}: {key!r} of group {saved['group']} / shape {shape} "
                                     f"does not match group {g} / shape {tuple(master.shape)}")
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"shard state slot {i}: {key!r} holds non-finite values (inf or NaN); "
                                     f"refusing to load them into the optimizer")
        for (_, master, _, ea, eas, out16), saved in zip(slots, state):
            master.copy_(saved["master"])
            ea.copy_(saved["exp_avg"])
            eas.copy_(saved["exp_avg_sq"])
            if out16 is not None:
                out16.copy_(master)
        self.step_count = state[0]["step"] if state else 0
        self.publish()

    # -- model.load_state_dict after initialize ---------------------------------------------------

    # -- in-place edits of parameters between steps ------------------------------------------------

    def watch_edits(self, params: list[torch.nn.Parameter]) -> None:
        """[Note: in-place edits]
        A parameter changed in place between steps (`with torch.no_grad(): p.mul_(0.5)`, an
        init function) changes only the model's copy: in 16-bit training the next step would
        overwrite it from the fp32 master, and under stage 3 a released parameter has no values
        to change. Every in-place op bumps the parameter's autograd version counter (zero's own
        writes go through the buffers the parameters view, which leaves it alone), so at each step
        `adopt_edits` finds the parameters whose version moved: the optimizer takes their new
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
        for p in getattr(self, "_watched", ()):
            if p._version != p._zero_version:
                self.adopt_edit(p)
                p._zero_version = p._version

    def adopt_edit(self, param: torch.nn.Parameter) -> None:
        """Take `param`'s current (edited) values into the optimizer's copies."""

    def hook_state_dict_loads(self, module: torch.nn.Module) -> None:
        """[Note: load_state_dict after initialize]
        `model.load_state_dict(sd)` after `zero.initialize` writes the model's (16-bit, or under
        stage 3 released and empty) parameters; left alone, the next step would overwrite them
        from the stale fp32 master. A pre-hook on every module with parameters of its own hands
        each incoming value to `load_param` first, which puts it where this optimizer keeps it
        (the master's exact fp32 values, stage 3's shard), then lets torch finish."""
        for m in module.modules():  # bound methods, not lambdas: the model stays picklable
            own = list(m.named_parameters(recurse=False))
            if own:
                m.register_load_state_dict_pre_hook(functools.partial(self._before_load, own))
                m.register_load_state_dict_post_hook(functools.partial(self._after_load, own))

    def _after_load(self, own: list, module, incompatible_keys) -> None:
        self.edits_seen(p for _, p in own)

    @torch.no_grad()
    def _before_load(self, own: list, module, state_dict: dict, prefix: str, local_metadata: dict, strict, missing,
                     unexpected, errors: list[str]) -> None:
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

    def load_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor | None:
        """Take `value` (the full, correctly shaped new value of `param`) into the optimizer's own
        copies; return what torch should copy into `param.data` instead of `value`, if anything."""
        return None

    # -- checkpoints (see [Note: checkpoint chunks] in zero/checkpoint/chunks.py) -----------------

    @abc.abstractmethod
    def param_chunks(self, param: torch.nn.Parameter, saving: bool) -> list[tuple[str, int, torch.Tensor]]:
        """(kind, offset, local 1-D view) of `param`'s global tensors this rank writes (`saving`)
        or reads: kind "model" (the parameter in the training dtype), and for a trainable
        parameter "master", "exp_avg" and "exp_avg_sq" (fp32)."""

    def rank_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state that belongs to this rank alone, not to any parameter's shard (1-bit
        Adam's error buffers); saved per rank by save_checkpoint. None here."""
        return {}

    def reset_rank_state(self) -> None:
        """Start `rank_state` afresh (a checkpoint's does not fit this run)."""
        for t in self.rank_state().values():
            t.zero_()

    @abc.abstractmethod
    def grad_piece(self, param: torch.nn.Parameter) -> tuple[int, torch.Tensor, bool]:
        """Where `param`'s gradient is on this rank: (offset into the flattened parameter, 1-D
        view, reduced). A reduced piece (stages 2 and 3, once its reduction finished) is this
        rank's part of the sum over ranks; an unreduced one (stages 0 and 1 until the step reduces
        the flat gradient) is this rank's own gradient, whole."""

    def grad_divisor(self, reduced: bool) -> float:
        """What a gradient piece is divided by to give the mean gradient the step applies (before
        clipping); see [Note: one divisor]."""
        divisor = self.comm.world_size / self.options.predivide * self.loss_scaler.scale
        return divisor if reduced else divisor * self.options.predivide

    def after_checkpoint_load(self) -> None:
        """Make the loaded values visible to the model (16-bit copies, gathered units)."""
        self.publish()

    # -- what subclasses provide --------------------------------------------------------------

    @abc.abstractmethod
    def slots(self) -> list[Slot]:
        """(group index, fp32 master, gradient shard, exp_avg, exp_avg_sq, 16-bit output or None)."""

    def reduce_gradients(self) -> None:
        """Finish any gradient reduction still owed at the accumulation boundary."""

    def norm_is_partitioned(self) -> bool:
        """True when each rank holds a different part of the gradient (so norms are summed)."""
        return self.comm.world_size > 1

    def publish(self) -> None:
        """Make the updated 16-bit shards visible to the model (e.g. all-gather them)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (subclasses also clear their shards)."""
        if self._host is not None:
            self._host.discard()
        for p in self.params:
            p.grad = None

    @abc.abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind, and its communication buffers."""

    def _measure(self, parts: dict[str, list[torch.Tensor]], host_kinds: set[str]) -> dict[str, int]:
        """`parts` measured by storage (see zero/memory_report.py), plus the host staging of
        offload, the reduce buffers alive now and at most, and the device/host split."""
        parts["host_staging"] = self._host.host_tensors() if self._host is not None else []
        if self.offload is not None:
            host_kinds = host_kinds | {"fp32_master", "optimizer_states"}
        report = measure_kinds(parts, host_kinds | {"host_staging"})
        g = self.gauges
        report["reduce_buffers"] = g.reduce_buffers.now
        report["reduce_buffers_peak"] = g.reduce_buffers.peak
        report["device_bytes"] += g.reduce_buffers.now + g.gather_buffers.now
        return report

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
        device = slots[0][2].device if slots else torch.device("cpu")  # where the gradients are
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for _, _, g, _, _, _ in slots]
        total = self._sum_squares(norms, device)
        self._sum_over_ranks(total)
        norm_sq = total.item()  # the step's one host synchronisation for the norm
        if math.isfinite(norm_sq):
            return math.sqrt(norm_sq)
        # rare: some slot's fp32 norm overflowed (or a gradient is inf/NaN); every rank sees the
        # reduced total non-finite, so every rank measures again, scaled by each slot's largest element
        rescaled = []
        for (_, _, g, _, _, _), n in zip(slots, norms):
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
            self.model_parallel.reduce(self, total)
        elif self.norm_is_partitioned():
            self.comm.all_reduce(total, "sum")

    def owned_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The part of `param`'s reduced gradient in this rank's slots (for the norm), or None."""
        return None

    @staticmethod
    def _sum_squares(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        if norms:
            total += torch.stack([n.double() for n in norms]).square().sum()
        return total

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Reduce, check, clip and apply Adam to this rank's shards, then publish them.

        A step whose gradient holds inf or NaN (on any rank) is skipped on every rank and logged:
        parameters, master weights and Adam state stay as they were, and the gradients are
        dropped. With fp16 this is the loss scale's overflow rule; in fp32 and bf16 it keeps one
        bad batch from turning every parameter into NaN.

        Returns:
            False if the step was skipped because a gradient was not finite, True otherwise.
        """
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step does not take a closure")
        self.check_hyperparameters()
        self.adopt_edits()
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
            for _, _, grad, _, _, _ in slots:
                grad.div_(grad_scale / 1e30)
            grad_scale = 1e30
        with record_function("zero::adam"):
            if self.client_class is not None:
                self._client_step(slots, grad_scale)
            elif self.offload is not None:
                threads = self.offload.num_threads
                self._host_adam().step(
                    slots, lambda g, *t: self._adam(self.param_groups[g], *t[:4], grad_scale, t[4], threads),
                    self.out16_on_host())
            else:
                for group_index, master, grad, exp_avg, exp_avg_sq, out16 in slots:
                    self._adam(self.param_groups[group_index], master, grad, exp_avg, exp_avg_sq, grad_scale, out16)
        with record_function("zero::publish_params"):
            self.publish()
        self.loss_scaler.update(overflow=False)
        self.zero_grad()
        return True

    @torch.no_grad()
    def _client_step(self, slots: list[Slot], grad_scale: float) -> None:
        """See [Note: other optimizers on shards] in zero/stages/choice.py: the client optimizer's class
        steps on the fp32 master pieces (as parameters sharing their storage), with its state
        sized like the shards."""
        if self._client is None:
            by_group: dict[int, list] = {}
            self._client_params = []
            for gi, master, *_ in slots:
                p = torch.nn.Parameter(master, requires_grad=False)  # shares the master's storage
                by_group.setdefault(gi, []).append(p)
                self._client_params.append(p)
            self._client_groups = list(by_group)
            groups = [{**self._hyper(gi), "params": ps} for gi, ps in by_group.items()]
            self._client = self.client_class(groups, **self.client_defaults)  # torch optimizers' defaults are their
            # constructor's keyword arguments
        for group, gi in zip(self._client.param_groups, self._client_groups):  # the scheduler's lr, etc.
            group.update(self._hyper(gi))
        for p, (_, _, grad, _, _, _) in zip(self._client_params, slots):
            p.grad = grad.float() / grad_scale
        self._client.step()
        for p, (_, master, _, _, _, out16) in zip(self._client_params, slots):
            p.grad = None
            if out16 is not None:
                out16.copy_(master)

    def _hyper(self, gi: int) -> dict:
        """Group `gi`'s hyperparameters for the client optimizer: without the Adam keys every group
        carries (unless the client optimizer has them too)."""
        return {k: v for k, v in self.param_groups[gi].items()
                if k != "params" and (k not in ADAM_DEFAULTS or k in self.client_defaults)}

    def _skip(self, norm: float) -> None:
        """Skip this step: its gradient is inf or NaN on some rank (the engine logs it)."""
        before = self.loss_scaler.scale
        self.loss_scaler.update(overflow=True)
        self.skipped = (norm, before, self.loss_scaler.scale)
        self.global_grad_norm = None
        self.zero_grad()

    def _adam(self, group, master, grad, exp_avg, exp_avg_sq, grad_scale: float, out16, num_threads=None) -> None:
        if out16 is not None and out16.dtype == torch.float32:  # fp32 model copy kept apart from the master
            self._adam(group, master, grad, exp_avg, exp_avg_sq, grad_scale, None, num_threads)
            out16.copy_(master)
            return
        if out16 is not None and out16.device != master.device:  # e.g. device master, host shard
            staged = torch.empty_like(out16, device=master.device)
            self._adam(group, master, grad, exp_avg, exp_avg_sq, grad_scale, staged, num_threads)
            out16.copy_(staged)
            return
        kwargs = dict(step=self.step_count, lr=float(group["lr"]), betas=tuple(group["betas"]), eps=group["eps"],
                      weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                      bias_correction=group["bias_correction"], grad_scale=grad_scale)
        from zero.ops.builder import OpUnavailable

        try:
            if master.device.type == "cuda":
                from zero.ops.fused_adam import fused_adam_step_unchecked

                fused_adam_step_unchecked([master], [grad], [exp_avg], [exp_avg_sq],
                                          out16=None if out16 is None else [out16], **kwargs)
            else:
                from zero.ops.cpu_adam import cpu_adam_step_unchecked

                cpu_adam_step_unchecked(master, grad, exp_avg, exp_avg_sq, out16=out16, num_threads=num_threads, **kwargs)
            return
        except OpUnavailable as exc:  # no compiler, no nvcc: tried once (see zero/ops/builder.py)
            reason = exc
        if not self._warned_fallback:
            warnings.warn(f"zero: native Adam unavailable ({reason}); using the slower torch implementation",
                          stacklevel=3)
            self._warned_fallback = True
        torch_adam_step(master, grad, exp_avg, exp_avg_sq, out16=out16, **kwargs)


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


def torch_adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay, adamw_mode,
                    bias_correction, grad_scale, out16=None) -> None:
    """Adam/AdamW on flat tensors with torch ops: the fallback when no native kernel can be built.
    Same formula as the kernels (see [Note: adam math] in csrc/adam/)."""
    beta1, beta2 = betas
    g = grad.float() / grad_scale
    if adamw_mode:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay:
        g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if out16 is not None:
        out16.copy_(param)

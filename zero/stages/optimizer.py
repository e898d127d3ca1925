"""The partitioned optimizer of stages 0-2: flat 16-bit params, fp32 master shard, Adam, all-gather.

[Note: flat parameters]
At construction every trainable parameter's storage moves into one flat buffer of the training
dtype (see [Note: bucket layout] in zero/partition/layout.py) and `param.data` becomes a view into
it, so the module, the user's references and autograd all keep working on the same objects.
After each update the owners' slices are all-gathered back into that buffer, bucket by bucket.

Per bucket this rank keeps: the fp32 master of its slice (a view into the flat buffer itself when
training in fp32, so fp32 training holds no second copy), Adam's exp_avg and exp_avg_sq, and the
gradient shard from zero/stages/grads.py. The master is initialised from the model's original
fp32 values, not from their 16-bit rounding.

[Note: one divisor]
Gradients reach the shard as sums over ranks (and micro-batches, each already divided by the
accumulation steps in `Engine.backward`), multiplied by the loss scale. The mean gradient is
`sum / (world_size / predivide) / loss_scale`, and clipping multiplies it by `clip_coef`. All of
that is one number, `grad_scale = world_size / predivide * loss_scale / clip_coef`, which the
Adam kernel divides by in the same pass that updates the weights: no separate unscale, average
or clip pass over the gradients. The norm is computed from the shard in one fused pass and one
all-reduce; an inf or NaN anywhere makes the norm non-finite, which is also the overflow test.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.profiler import record_function

from zero.comm import Comm
from zero.offload import HostAdam, OffloadOptions
from zero.partition.layout import ShardLayout
from zero.precision import LossScaler
from zero.stages.grads import GradReducer

ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True, adamw_mode=True)


class ShardedAdam(torch.optim.Optimizer):
    """Adam/AdamW over this rank's shards: the step shared by every stage.

    Behaves as a torch optimizer for schedulers and user code (`param_groups` with `lr`, `betas`,
    ... per group), but `step()` is meant to be called by the engine at the accumulation
    boundary. Subclasses say where the shards are (`slots`), how gradients reach them
    (`reduce_gradients`), and how updated 16-bit shards reach the model (`publish`).

    Args:
        param_groups: torch-style groups of trainable parameters with Adam hyperparameters.
        comm: the data-parallel group.
        dtype: training dtype of the parameters (fp32, bf16 or fp16).
        gradient_clipping: clip the global gradient norm to this; 0 = off.
        loss_scaler: fp16 loss scaling (default: none).
        check_overflow: skip steps whose gradients hold inf/NaN (always on with fp16).
        predivide: gradients were divided by this before the reduction.
        offload: keep fp32 master and Adam states in host memory and update them there (see
            [Note: offload data path] in zero/offload.py); None keeps them with the model.
    """

    def __init__(self, param_groups, *, comm: Comm, dtype: torch.dtype, gradient_clipping: float = 0.0,
                 loss_scaler: LossScaler | None = None, check_overflow: bool = False, predivide: float = 1.0,
                 offload: OffloadOptions | None = None):
        super().__init__(param_groups, dict(ADAM_DEFAULTS))
        self.offload = offload
        self._host: HostAdam | None = None
        self.at_boundary = True  # the engine says whether the coming backward ends an accumulation
        self.comm = comm
        self.dtype = dtype
        self.gradient_clipping = gradient_clipping
        self.loss_scaler = loss_scaler or LossScaler.disabled()
        self.check_overflow = check_overflow or self.loss_scaler.dynamic
        self.world_size = comm.world_size
        self.predivide = predivide
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.step_count = 0
        self.global_grad_norm: float | None = None
        self._warned_fallback = False

    # -- where optimizer state lives -------------------------------------------------------------

    def state_device(self, compute_device: torch.device) -> torch.device:
        """Where fp32 master and Adam moments live: the host when offloaded, else with the model."""
        return torch.device("cpu") if self.offload is not None else compute_device

    def new_state(self, like: torch.Tensor, compute_device: torch.device, values: torch.Tensor | None = None) -> torch.Tensor:
        """An fp32 optimizer-state tensor shaped like `like` (zeros, or a copy of `values`)."""
        t = torch.zeros(like.shape, dtype=torch.float32, device=self.state_device(compute_device))
        if self.offload is not None and self.offload.pin_memory and torch.cuda.is_available():
            t = t.pin_memory()
        if values is not None:
            t.copy_(values)
        return t

    def grad_final(self, grad: torch.Tensor) -> None:
        """Reducers call this when a gradient shard holds its final value for the step; with
        offload its copy to the host starts now, overlapping the rest of backward."""
        if self.offload is not None and self.at_boundary:
            self._host_adam().grad_ready(grad)

    def _host_adam(self) -> HostAdam:
        if self._host is None:
            self._host = HostAdam(self.slots(), self.offload)
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
        for i, ((g, master, _, ea, eas, out16), saved) in enumerate(zip(slots, state)):
            if saved["group"] != g or saved["master"].shape != master.shape:
                raise ValueError(f"shard state slot {i}: group {saved['group']} / shape {tuple(saved['master'].shape)} "
                                 f"does not match group {g} / shape {tuple(master.shape)}")
        for (g, master, _, ea, eas, out16), saved in zip(slots, state):
            master.copy_(saved["master"])
            ea.copy_(saved["exp_avg"])
            eas.copy_(saved["exp_avg_sq"])
            if out16 is not None:
                out16.copy_(master)
        self.step_count = state[0]["step"] if state else 0
        self.publish()

    # -- what subclasses provide --------------------------------------------------------------

    def slots(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(group index, fp32 master, gradient shard, exp_avg, exp_avg_sq, 16-bit output or None)."""
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        """Finish any gradient reduction still owed at the accumulation boundary."""

    def norm_is_partitioned(self) -> bool:
        """True when each rank holds a different part of the gradient (so norms are summed)."""
        return self.world_size > 1

    def publish(self) -> None:
        """Make the updated 16-bit shards visible to the model (e.g. all-gather them)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Reduce, check, clip and apply Adam to this rank's shards, then publish them.

        Returns:
            False if the step was skipped because a gradient overflowed, True otherwise.
        """
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step does not take a closure")
        with record_function("zero::reduce_gradients"):
            self.reduce_gradients()
        slots = self.slots()
        divisor = self.world_size / self.predivide * self.loss_scaler.scale

        with record_function("zero::grad_norm"):
            device = slots[0][1].device if slots else torch.device("cpu")
            norm_sq = torch.zeros(1, dtype=torch.float32, device=device)
            for _, _, g, _, _, _ in slots:
                norm_sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
            if self.norm_is_partitioned():
                self.comm.all_reduce(norm_sq, "sum")
            norm_sq = norm_sq.item()
        if self.check_overflow and not math.isfinite(norm_sq):
            self.loss_scaler.update(overflow=True)
            self.global_grad_norm = None
            self.zero_grad()
            return False
        norm = math.sqrt(norm_sq) / divisor
        self.global_grad_norm = norm
        clip_coef = 1.0
        if self.gradient_clipping > 0:
            clip_coef = min(1.0, self.gradient_clipping / (norm + 1e-6))

        self.step_count += 1
        grad_scale = divisor / clip_coef
        with record_function("zero::adam"):
            if self.offload is not None:
                threads = self.offload.num_threads
                self._host_adam().step(
                    slots, lambda g, *tensors: self._adam(self.param_groups[g], *tensors[:4], grad_scale, tensors[4], threads),
                    self.out16_on_host())
            else:
                for group_index, master, grad, exp_avg, exp_avg_sq, out16 in slots:
                    self._adam(self.param_groups[group_index], master, grad, exp_avg, exp_avg_sq, grad_scale, out16)
        with record_function("zero::publish_params"):
            self.publish()
        self.loss_scaler.update(overflow=False)
        self.zero_grad()
        return True

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
        try:
            if master.device.type == "cuda":
                from zero.ops.fused_adam import fused_adam_step

                fused_adam_step([master], [grad], [exp_avg], [exp_avg_sq], out16=None if out16 is None else [out16], **kwargs)
            else:
                from zero.ops.cpu_adam import cpu_adam_step

                cpu_adam_step(master, grad, exp_avg, exp_avg_sq, out16=out16, num_threads=num_threads, **kwargs)
            return
        except ImportError as exc:
            reason = exc
        except RuntimeError as exc:  # OpUnavailable: no compiler, no nvcc
            if type(exc).__name__ != "OpUnavailable":
                raise
            reason = exc
        if not self._warned_fallback:
            warnings.warn(f"zero: native Adam unavailable ({reason}); using the slower torch implementation")
            self._warned_fallback = True
        torch_adam_step(master, grad, exp_avg, exp_avg_sq, out16=out16, **kwargs)


class ZeroOptimizer(ShardedAdam):
    """The partitioned optimizer of stages 0, 1 and 2 over one flat parameter buffer.

    Args:
        param_groups, comm, dtype, gradient_clipping, loss_scaler, check_overflow, predivide:
            see ShardedAdam.
        stage: 0, 1 or 2.
        master_values: the original fp32 value of each parameter (default: its current value).
        bucket_size: elements per bucket (see ShardLayout).
        comm_dtype: dtype of gradient reduction (default: `dtype`).
        accumulation_steps: micro-batches per step (decides the gradient accumulation dtype).
        overlap_comm, reduce_scatter: see GradReducer.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        stage: int,
        comm: Comm,
        dtype: torch.dtype = torch.float32,
        master_values: dict[torch.nn.Parameter, torch.Tensor] | None = None,
        bucket_size: int = 500_000_000,
        comm_dtype: torch.dtype | None = None,
        accumulation_steps: int = 1,
        gradient_clipping: float = 0.0,
        loss_scaler: LossScaler | None = None,
        check_overflow: bool = False,
        overlap_comm: bool = False,
        reduce_scatter: bool = True,
        predivide: float = 1.0,
        offload: OffloadOptions | None = None,
    ):
        super().__init__(param_groups, comm=comm, dtype=dtype, gradient_clipping=gradient_clipping,
                         loss_scaler=loss_scaler, check_overflow=check_overflow, predivide=predivide, offload=offload)
        self.stage = stage
        groups = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        partitions = 1 if stage == 0 else comm.world_size
        self.rank = comm.rank if partitions > 1 else 0
        self.layout = ShardLayout([p.numel() for p in self.params], groups, partitions, bucket_size)
        device = self.params[0].device
        master_values = master_values or {}

        with torch.no_grad():
            self.flat = torch.zeros(self.layout.numel, dtype=dtype, device=device)
            for p, off in zip(self.params, self.layout.offsets):
                view = self.flat[off : off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
            self.master, self.exp_avg, self.exp_avg_sq = [], [], []
            for bucket in self.layout.buckets:
                lo, hi = self._own(bucket)
                if dtype == torch.float32 and offload is None:
                    master = self.flat[lo:hi]  # fp32 training: the parameters are their own master
                else:
                    master = self.new_state(self.flat[lo:hi], device, self.flat[lo:hi])
                    for i in bucket.params:  # overwrite with the exact fp32 originals where known
                        src = master_values.get(self.params[i])
                        a, b = max(lo, self.layout.offsets[i]), min(hi, self.layout.offsets[i] + self.layout.numels[i])
                        if src is not None and a < b:
                            start = self.layout.offsets[i]
                            master[a - lo : b - lo].copy_(src.reshape(-1)[a - start : b - start])
                self.master.append(master)
                self.exp_avg.append(self.new_state(master, device))
                self.exp_avg_sq.append(self.new_state(master, device))

        self.reducer = GradReducer(
            self.params,
            self.layout,
            stage,
            comm,
            comm_dtype or dtype,
            accumulate_fp32=accumulation_steps > 1 or dtype == torch.float32,
            overlap_comm=overlap_comm,
            reduce_scatter=reduce_scatter,
            predivide=predivide,
            on_final=self.grad_final,
        )

    def _own(self, bucket) -> tuple[int, int]:
        return bucket.slice_range(self.rank) if self.layout.partitions > 1 else (bucket.start, bucket.start + bucket.numel)

    def slots(self):
        out = []
        for bucket in self.layout.buckets:
            b = bucket.index
            lo, hi = self._own(bucket)
            aliased = self.master[b].data_ptr() == self.flat[lo:hi].data_ptr()
            out16 = None if aliased else self.flat[lo:hi]
            out.append((bucket.group, self.master[b], self.reducer.shards[b], self.exp_avg[b], self.exp_avg_sq[b], out16))
        return out

    def reduce_gradients(self) -> None:
        self.reducer.reduce_at_boundary()

    def norm_is_partitioned(self) -> bool:
        return self.layout.partitions > 1

    def publish(self) -> None:
        if self.layout.partitions > 1:
            works = [self.comm.all_gather(self.flat[bk.start : bk.start + bk.numel], self.flat[slice(*self._own(bk))],
                                          async_op=True) for bk in self.layout.buckets]
            for w in works:
                w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine does this after every step)."""
        self.reducer.zero()
        for p in self.params:
            p.grad = None

    # -- reports ----------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind."""
        aliased = self.dtype == torch.float32 and self.offload is None
        report = {
            "params": nbytes([self.flat]),
            "grads": self.reducer.grad_bytes(),
            "fp32_master": 0 if aliased else nbytes(self.master),
            "optimizer_states": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq),
            "comm_buffers": getattr(self.reducer, "peak_staging_bytes", 0),
        }
        return split_by_place(report, host_kinds={"fp32_master", "optimizer_states"} if self.offload else set(),
                              host_extra=self._host.host_bytes() if self._host is not None else 0)


def nbytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def split_by_place(report: dict[str, int], host_kinds: set[str], host_extra: int = 0) -> dict[str, int]:
    """Add `device_bytes` and `host_bytes`: where the model-state kinds of `report` live."""
    kinds = ("params", "grads", "fp32_master", "optimizer_states", "comm_buffers")
    report["host_bytes"] = sum(report[k] for k in kinds if k in host_kinds) + host_extra
    report["device_bytes"] = sum(report[k] for k in kinds if k not in host_kinds)
    report["host_staging"] = host_extra
    return report


def torch_adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay, adamw_mode,
                    bias_correction, grad_scale, out16=None) -> None:
    """Adam/AdamW on flat tensors with torch ops: the fallback when no native kernel can be built."""
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

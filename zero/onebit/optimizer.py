"""1-bit Adam on ZeRO stages 0, 1 and 2.

[Note: 1-bit Adam on shards]
For its first `freeze_step` steps the optimizer is the stage's own Adam, exactly: gradients are
reduced uncompressed and both moments are updated. From then on Adam's variance is frozen (its
bias correction too, at its value of step `freeze_step`) and each bucket's gradient exchange is the
compressed one of [Note: compressed exchange]. With the variance frozen Adam's update is linear in
the gradient, so compressing the gradient with error feedback and updating the owner's momentum
shard from the mean gives, in expectation, what compressing each rank's momentum would (the
published algorithm), while every rank keeps only its shard of the optimizer state, as ZeRO
requires. The price of compression is the worker error buffer: one fp32 copy of the trainable
parameters per rank (the server's is 1/N of that, and only at stage 0).

A step skipped for a non-finite gradient also resets the error buffers (they would carry the inf).

[Note: 1-bit Adam in checkpoints]
The phase follows from the step count, which checkpoints hold. The error buffers are each rank's
own (a worker's error is what its own messages lost), so save_checkpoint writes them per rank
(`optimizer/rank<r>.safetensors`), and a run resumed on the same ranks with the same buckets
continues bitwise as if it had not stopped. On another world size, or another bucket layout, the
chunks the errors belong to no longer exist: the buffers start from zero (load_checkpoint warns).
What is dropped is the part of the last messages not yet delivered, at most one step's
compression error per element, so training goes on as after any step, only not bitwise the same.
"""
from __future__ import annotations

import torch

from zero.onebit.exchange import CompressedExchange, gather_changes
from zero.optim.loss_scale import LossScaler
from zero.optim.rules import AdamRule
from zero.optim.step import ShardedOptimizer
from zero.stages.buckets import FlatParams


class OneBitParams(FlatParams):
    """The flat storage of stages 0-2 whose bucket reductions (and, with `compress_param_gather`,
    parameter all-gathers) are compressed after `freeze_step` (see [Note: 1-bit Adam on shards]).
    Arguments as FlatParams, plus:

    Args:
        freeze_step: steps of exact Adam before compression starts.
        loss_scaler: the fp16 loss scale, which the error buffers follow.
    """

    def __init__(self, *args, freeze_step: int, loss_scaler: LossScaler, **kwargs):
        super().__init__(*args, **kwargs)
        self.freeze_step = freeze_step
        self.loss_scaler = loss_scaler
        self.before: list[torch.Tensor] | None = None  # owned slices before this step (compressed gather)
        numels = [b.numel for b in self.layout.buckets] if self.comm.world_size > 1 else []  # one rank: no exchange
        self.exchange = CompressedExchange(self.comm, numels, full_result=self.stage == 0, device=self.flat.device)
        # the loss scale the error buffers are in (fp16), kept with them in checkpoints
        self.error_scale = torch.tensor([self.loss_scaler.scale], dtype=torch.float64)

    @property
    def compressing(self) -> bool:
        """The gradients being reduced now are for a step after `freeze_step`."""
        return self.step_number() > self.freeze_step and self.comm.world_size > 1

    def reduce_bucket(self, bucket, buf: torch.Tensor, async_op: bool, replicas: bool = True):
        if not self.compressing:
            return super().reduce_bucket(bucket, buf, async_op, replicas)
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        if self.loss_scaler.scale != self.error_scale.item():  # fp16: the errors follow the gradients' scale
            for t in self.exchange.tensors().values():
                t.mul_(self.loss_scaler.scale / self.error_scale.item())
            self.error_scale.fill_(self.loss_scaler.scale)
        lo, hi = self.own(bucket)
        self.exchange.reduce(bucket.index, buf, (lo - bucket.start, hi - bucket.start))
        return None

    def keep_owned_slices(self) -> None:
        """Before a compressed step: this rank's slices as they are, whose change the compressed
        gather sends (see [Note: compressed parameter gather])."""
        if self.compressing and self.partitions > 1:
            self.before = [self.flat[slice(*self.own(b))].clone() for b in self.layout.buckets]
            self.gauges.gather_buffers.add(sum(t.untyped_storage().nbytes() for t in self.before))

    def drop_owned_slices(self) -> None:
        if self.before is not None:
            self.gauges.gather_buffers.sub(sum(t.untyped_storage().nbytes() for t in self.before))
            self.before = None

    def publish(self) -> None:
        if self.before is None:  # before the freeze, and every publish outside a step (loads): exact
            return super().publish()
        for bucket, before in zip(self.layout.buckets, self.before):
            gather_changes(self.comm, self.flat[bucket.start : bucket.start + bucket.numel], before, self.rank)

    def memory_extras(self, report: dict[str, int]) -> None:
        """`compression_errors`: the error buffers (on the device, beside the model states: a full
        fp32 copy of the trainable parameters per rank, 1/N more at stage 0)."""
        errors = sum(t.untyped_storage().nbytes() for t in self.exchange.tensors().values())
        report["compression_errors"] = errors
        report["device_bytes"] += errors


class OneBitAdam(ShardedOptimizer):
    """ZeRO stages 0-2 with 1-bit compressed gradient exchange after `freeze_step` (see
    [Note: 1-bit Adam on shards]). Arguments as ShardedOptimizer (its storage a OneBitParams), plus:

    Args:
        freeze_step: steps of exact Adam before the variance freezes and compression starts.
        compress_param_gather: stages 1 and 2, after the freeze: all-gather each owner's parameter
            change 1-bit compressed (see [Note: compressed parameter gather]).
    """

    def __init__(self, *args, freeze_step: int, compress_param_gather: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.freeze_step = freeze_step
        self.compress_param_gather = compress_param_gather

    def step(self, closure=None) -> bool:
        if self.compress_param_gather:
            self.storage.keep_owned_slices()
        try:
            return super().step(closure)
        finally:
            self.storage.drop_owned_slices()

    def rank_state(self) -> dict[str, torch.Tensor]:
        """The error buffers and the loss scale they are in (see [Note: 1-bit Adam in checkpoints])."""
        return {**self.storage.exchange.tensors(), "error_loss_scale": self.storage.error_scale}

    def reset_rank_state(self) -> None:
        self.storage.exchange.reset()
        self.storage.error_scale.fill_(self.loss_scaler.scale)

    def memory_report(self) -> dict:
        """As ShardedOptimizer's, plus `compression_errors` (see OneBitParams.memory_extras) and, with the
        compressed gather, its buffers' peak."""
        report = super().memory_report()
        if self.compress_param_gather:
            report["gather_buffers_peak"] = self.gauges.gather_buffers.peak
        return report

    def _skip(self, norm: float) -> None:
        super()._skip(norm)
        self.storage.exchange.reset()


class FrozenVarianceAdam(AdamRule):
    """Adam until `freeze_step`, then Adam with its variance frozen (see [Note: 1-bit Adam on shards]).

    Args:
        fmt: the state format (fp32: 1-bit Adam keeps fp32 states).
        freeze_step: steps of exact Adam before the variance freezes.
    """

    name = "OneBitAdam"

    def __init__(self, fmt, freeze_step: int):
        super().__init__(fmt)
        self.freeze_step = freeze_step

    def hyperparameters(self, optimizer, group: dict) -> dict:
        step = optimizer.step_count
        if step <= self.freeze_step:
            return super().hyperparameters(optimizer, group)
        # Frozen variance on the stage's own (native) Adam step: beta2 = 1 leaves v as it is
        # (v * 1 + 0 * g^2), and the frozen bias corrections move into lr and eps:
        #   lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) = lr' * m / (sqrt(v) + eps'),
        #   lr' = lr * sqrt(bc2) / bc1,  eps' = eps * sqrt(bc2),
        # with AdamW's decay rescaled so that lr' * wd' = lr * wd.
        lr, (beta1, _), eps, wd = float(group["lr"]), tuple(group["betas"]), group["eps"], group["weight_decay"]
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bc2 = 1 - group["betas"][1] ** self.freeze_step if group["bias_correction"] else 1.0
        lr_frozen = lr * bc2**0.5 / bc1
        decay = wd * lr / lr_frozen if group["adamw_mode"] and lr_frozen > 0 else (wd if not group["adamw_mode"] else 0.0)
        return dict(step=step, lr=float(lr_frozen), betas=(beta1, 1.0), eps=eps * bc2**0.5, weight_decay=decay,
                    adamw_mode=group["adamw_mode"], bias_correction=False)

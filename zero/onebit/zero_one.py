"""0/1 Adam on ZeRO stage 0.

[Note: 0/1 Adam]
0/1 Adam (Lu et al., 2022) replaces most of Adam's gradient all-reduces by local steps and 1-bit
syncs. With t the step:
- **Variance updates.** Until `var_freeze_step`, at steps t that are multiples of an interval
  which starts at 1 and doubles after every `var_update_scaler` updates, the gradient is
  all-reduced exactly and both moments are updated, as in Adam; every rank then takes the same
  step. After `var_freeze_step` the variance never changes again.
- **Local steps.** At every other step each rank updates its own momentum from its own gradient
  and moves its own parameters with it, and adds the lr-weighted momentum c_t m_t (c_t = lr_t /
  bc1_t) to an accumulator u. Nothing is sent.
- **Syncs.** Before `var_freeze_step` every local step is also a sync; afterwards a sync comes
  when a local interval has passed, the interval doubling every `local_step_scaler` steps up to
  `local_step_clipper`. At a sync the ranks average u with the compressed exchange of
  [Note: compressed exchange] (stage 0 form: every rank receives the same mean), and every rank
  sets its parameters to anchor * D - mean(u) / (sqrt(v / bc2) + eps) and its momentum to
  mean(u) / sum(c_t), where the anchor is the parameters at the last sync and D the product of
  AdamW's decay factors since then. All ranks compute that from the same numbers, so after every
  sync they hold the same bits again.
Local steps need every rank to update every parameter, so 0/1 Adam runs at stage 0 only: under
ZeRO-1/2 a rank holds the optimizer state of its own shard alone.

Per rank it keeps, beside Adam's state, u and the anchor (two fp32 copies of the trainable
parameters) and the compression error buffers. Checkpoints hold them per rank, with the rank's own
parameters and momentum (between syncs they differ from rank 0's), so a resume is bitwise.
"""
from __future__ import annotations

import torch

from zero.onebit.exchange import CompressedExchange
from zero.optim.rules import AdamRule
from zero.optim.step import ShardedOptimizer
from zero.stages.buckets import FlatParams


class ZeroOneParams(FlatParams):
    """The flat storage of stage 0 with 0/1 Adam's per-rank state beside each bucket's: the local
    accumulator u, the anchor (the parameters at the last sync), the accumulators since the sync,
    and the compression error buffers (see [Note: 0/1 Adam]). Arguments as FlatParams."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        n = self.comm.world_size
        numels = [b.numel for b in self.layout.buckets] if n > 1 else []
        self.exchange = CompressedExchange(self.comm, numels, full_result=True, device=self.flat.device)
        self.u = [torch.zeros_like(m) for m in self.master]
        self.anchor = [m.detach().clone() for m in self.master]
        # per slot: [sum of c_t since the sync, product of decay factors since the sync]
        self.since_sync = [torch.tensor([0.0, 1.0], dtype=torch.float64) for _ in self.master]
        self.slot_of = {id(m): b for b, m in enumerate(self.master)}  # by object: offload_states moves storages
        self.watch_edits(self.params)  # fp32 too: an edit must move the anchor (see rebase)

    def rebase(self, param, value: torch.Tensor | None = None) -> None:
        """A parameter set from outside (load_state_dict, an in-place edit) takes its new value as
        its anchor, and its local progress since the sync is dropped: the next sync keeps it."""
        i = self._index.get(param)
        if i is None:
            return
        bucket = self.layout.buckets[self.layout.bucket_of[i]]
        lo, _ = self.own(bucket)
        a = self.layout.offsets[i] - lo
        n = self.layout.numels[i]
        b = bucket.index
        with torch.no_grad():
            new = value.detach().reshape(-1).to(self.anchor[b].device, torch.float32) if value is not None \
                else self.master[b][a : a + n]
            self.anchor[b][a : a + n].copy_(new)
            self.u[b][a : a + n].zero_()

    def load_param(self, param, value: torch.Tensor) -> None:
        super().load_param(param, value)
        self.rebase(param, value)

    def adopt_edit(self, param) -> None:
        super().adopt_edit(param)
        self.rebase(param)

    def after_checkpoint_load(self) -> None:
        """The 16-bit parameters follow this rank's master (restored with its own state)."""
        for b, bucket in enumerate(self.layout.buckets):
            lo, hi = self.own(bucket)
            if self.master[b].data_ptr() != self.flat[lo:hi].data_ptr():
                self.flat[lo:hi].copy_(self.master[b])
        super().after_checkpoint_load()

    def memory_extras(self, report: dict[str, int]) -> None:
        """`compression_errors` (the error buffers) and `local_step_state` (u and the anchor: two fp32
        copies of the trainable parameters), both on the device."""
        errors = sum(t.untyped_storage().nbytes() for t in self.exchange.tensors().values())
        local = sum(t.untyped_storage().nbytes() for t in (*self.u, *self.anchor))
        report.update(compression_errors=errors, local_step_state=local)
        report["device_bytes"] += errors + local


class ZeroOneAdam(ShardedOptimizer):
    """ZeRO stage 0 with 0/1 Adam's variance freezing, local steps and 1-bit syncs (see
    [Note: 0/1 Adam]). Arguments as ShardedOptimizer (its storage a ZeroOneParams), plus the
    schedule's four numbers."""

    def __init__(self, *args, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                 local_step_clipper: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        # the schedule: var_interval, var_counter, var_updates, local_interval, local_counter, steps since
        # sync, and the step count it belongs to (a function of the step count: replayed when they differ)
        self.schedule = torch.tensor([1, 0, 0, 1, 0, 0, 0], dtype=torch.int64)
        self._plan: tuple[bool, bool] = (True, True)

    # -- the schedule --------------------------------------------------------------------------

    def _next(self) -> tuple[bool, bool]:
        """(variance update, sync) for the coming step."""
        if int(self.schedule[6]) != self.step_count:  # a checkpoint from another run: replay the schedule
            self.schedule.copy_(torch.tensor([1, 0, 0, 1, 0, 0, 0]))
            steps, self.step_count = self.step_count, 0
            for _ in range(steps):
                plan = self._next()
                self.step_count += 1
                self._advance(*plan)
        t = self.step_count + 1
        var_interval, _, _, local_interval, _, since, _ = self.schedule.tolist()
        var_update = t <= self.var_freeze_step and t % var_interval == 0
        sync = var_update or t <= self.var_freeze_step or since + 1 >= local_interval
        return var_update, sync

    def _advance(self, var_update: bool, sync: bool) -> None:
        s = self.schedule
        t = self.step_count
        if var_update:
            s[2] += 1
            s[1] += 1
            if s[1] >= self.var_update_scaler:
                s[1], s[0] = 0, s[0] * 2
        s[5] = 0 if sync else s[5] + 1
        s[6] = t
        if t > self.var_freeze_step:
            s[4] += 1
            if s[4] >= self.local_step_scaler:
                s[4], s[3] = 0, min(self.local_step_clipper, s[3] * 2)

    # -- the step ------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        self._plan = self._next()
        self.storage.reduce_gradients(communicate=self._plan[0])  # a variance update: the exact all-reduce

    def grad_divisor(self, reduced: bool) -> float:
        if not reduced or self._plan[0]:  # safe_get_full_grad's sum over ranks, or a variance update
            return super().grad_divisor(reduced)
        return self.options.accumulation * self.loss_scaler.scale  # this rank's own gradient: no sum over ranks,
        # no predivide

    def _grad_norm(self, slots) -> float:
        norm = super()._grad_norm(slots)
        if not self._plan[0] and self.comm.world_size > 1:  # every rank skips, or none
            bad = torch.tensor([0.0 if norm == norm and norm != float("inf") else 1.0], dtype=torch.float64)
            self.comm.all_reduce(bad, "max")
            if bad.item():
                return float("inf")
        return norm

    def step(self, closure=None) -> bool:
        applied = super().step(closure)
        if applied:
            self._advance(*self._plan)
        return applied

    # -- state ---------------------------------------------------------------------------------

    def rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state (see [Note: 0/1 Adam]): error buffers, u, anchor, the accumulators,
        the schedule, and its own parameters and momentum."""
        s = self.storage
        out = dict(s.exchange.tensors())
        for b in range(len(s.master)):
            out.update({f"u.{b}": s.u[b], f"anchor.{b}": s.anchor[b], f"since_sync.{b}": s.since_sync[b],
                        f"master.{b}": s.master[b], f"exp_avg.{b}": s.ranges[b][0].state["exp_avg"]})
        out["schedule"] = self.schedule
        return out

    def reset_rank_state(self) -> None:
        """A checkpoint from another world size: start a sync interval from the loaded values."""
        s = self.storage
        s.exchange.reset()
        for b, m in enumerate(s.master):
            s.u[b].zero_()
            s.anchor[b].copy_(m)
            s.since_sync[b].copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
        self.schedule[6] = -1  # replayed from the step count at the next step


class ZeroOneRule(AdamRule):
    """0/1 Adam's update of one slot: an exact Adam step at a variance update, else a local step
    and, at a sync, the compressed average of the local progress (see [Note: 0/1 Adam])."""

    name = "ZeroOneAdam"

    @torch.no_grad()
    def apply(self, optimizer, group: dict, slot, grad_scale: float, out16, num_threads=None) -> None:
        s = optimizer.storage  # its states are fp32: no scales, no rounding counter
        master, grad, exp_avg, exp_avg_sq = slot.master, slot.grad, slot.state["exp_avg"], slot.state["exp_avg_sq"]
        b = s.slot_of[id(master)]
        var_update, sync = optimizer._plan
        t = optimizer.step_count
        lr, (beta1, beta2), eps, wd = float(group["lr"]), tuple(group["betas"]), group["eps"], group["weight_decay"]
        adamw = group["adamw_mode"]
        g = grad.float() / grad_scale
        decay = 1 - lr * wd if adamw else 1.0
        if not adamw and wd:
            g = g.add(master, alpha=wd)
        bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
        exp_avg.lerp_(g, 1 - beta1)
        if var_update:
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        updates = int(optimizer.schedule[2].item()) + (1 if var_update else 0)
        bc2 = 1 - beta2**updates if group["bias_correction"] else 1.0
        denom = (exp_avg_sq.sqrt() / bc2**0.5).add_(eps)
        c = lr / bc1
        master.mul_(decay).addcdiv_(exp_avg, denom, value=-c)
        if var_update:  # every rank took the same step: a sync point
            s.anchor[b].copy_(master)
            s.u[b].zero_()
            s.since_sync[b].copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
        else:
            s.u[b].add_(exp_avg, alpha=c)
            acc = s.since_sync[b]
            acc[0] += c
            acc[1] *= decay
            if sync:
                mean = s.u[b].clone()
                if optimizer.comm.world_size > 1:
                    lo, hi = s.own(s.layout.buckets[b])
                    s.exchange.reduce(b, mean, (0, hi - lo))
                    mean.div_(optimizer.comm.world_size)
                torch.addcdiv(s.anchor[b] * float(acc[1]), mean, denom, value=-1.0, out=master)
                if acc[0] > 0:  # lr 0 since the sync: the momentum stays as it is
                    exp_avg.copy_(mean / float(acc[0]))
                s.anchor[b].copy_(master)
                s.u[b].zero_()
                acc.copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
        if out16 is not None:
            out16.copy_(master)

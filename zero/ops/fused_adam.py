"""Adam/AdamW on the GPU: the fused multi-tensor kernel (csrc/adam/fused_adam.cu).

* `launch` / `launch_fmt`: the kernel calls behind `zero.ops.adam.adam_step` on CUDA tensors (the
  one entry point, with its argument checks): the plain layout over lists of tensors in one
  launch (a few when the list mixes devices or dtypes), a low-precision format over one flat
  buffer, bit for bit what the CPU kernel computes.
* `FusedAdam`: a `torch.optim.Optimizer` for fp32 CUDA parameters, a drop-in for
  `torch.optim.AdamW` (or `torch.optim.Adam` with `adamw_mode=False`). Its `state_dict()` has
  torch's Adam layout, so state moves between the two both ways.

The op is compiled at first use, so importing this module works on a machine without CUDA.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.ops.adam import AdamArgs
from zero.ops.adam_common import (
    AdamOptimizerBase,
    bump_versions,
    check_tensor,
)
from zero.ops.adam_formats import KERNEL_CODES
from zero.ops.builder import load


def _op():
    return load("fused_adam")


# ----------------------------------------------------------------------------- launches (zero.ops.adam.adam_step)


def launch(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
           exp_avg_sqs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor | None], args) -> None:
    """The plain step over lists of checked CUDA tensors: one call of the op per (device, grad
    dtype, out16 dtype), the batches built in lockstep so the binding always gets lists of equal
    length and one grad dtype and one out16 dtype per call (it checks neither)."""
    batches: dict[tuple, tuple[list, ...]] = {}
    for p, g, m, v, o in zip(params, grads, exp_avgs, exp_avg_sqs, outs):
        if p.numel() == 0:
            continue
        key = (p.device, g.dtype, None if o is None else o.dtype)
        batch = batches.setdefault(key, ([], [], [], [], []))
        for lst, t in zip(batch, (p, g, m, v, o)):
            lst.append(t)
    if not batches:
        return
    op = _op()
    for (_, _, out_dtype), (ps, gs, ms, vs, os_) in batches.items():
        op.adam_step(ps, gs, ms, vs, [] if out_dtype is None else os_, *args.numbers())
        for tensors in (ps, ms, vs, os_):
            bump_versions(tensors)


def launch_fmt(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               m_scale: torch.Tensor | None, v_scale: torch.Tensor | None, out16: torch.Tensor | None, index: int,
               args) -> None:
    """The step of a low-precision format over one flat CUDA buffer (bit for bit the CPU kernel's:
    the kernels share zero_adam_fmt_element), in one launch on the current stream."""
    fmt = args.fmt
    _op().adam_step_fmt(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16, *args.numbers(),
                        KERNEL_CODES[fmt.master], KERNEL_CODES[fmt.state], bool(fmt.stochastic), int(fmt.seed),
                        int(index))
    bump_versions((param, exp_avg, exp_avg_sq, m_scale, v_scale, out16))


def _check_device(t: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    """Raise ValueError unless `t` is a CUDA tensor (on `device`, when given)."""
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} must be a CUDA tensor, got device {t.device} "
            f"(FusedAdam runs on the GPU; use zero.ops.CPUAdam for CPU tensors)"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but its param is on {device}")


# ----------------------------------------------------------------------------- optimizer


class FusedAdam(AdamOptimizerBase):
    """Adam/AdamW for float32 CUDA parameters: one fused kernel launch per parameter group per step.

    With the default `adamw_mode=True` it computes what `torch.optim.AdamW` computes (to fp32
    round-off); with `adamw_mode=False`, what `torch.optim.Adam` computes. `state_dict()` uses
    torch's Adam layout (per parameter: "step" as a float32 scalar tensor, "exp_avg",
    "exp_avg_sq"), so a state dict saved by either optimizer loads into the other.

    Args:
        params: float32 CUDA parameters (contiguous), or dicts of parameter groups.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True: decoupled weight decay like torch.optim.AdamW; False: L2 like torch.optim.Adam.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        amsgrad: must be False; AMSGrad is not implemented.
    """

    def _check_param(self, p: Any, name: str) -> None:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
        if p.dtype != torch.float32:
            raise ValueError(
                f"{name} is a {p.dtype} tensor; FusedAdam updates float32 parameters only "
                f"(keep an fp32 master copy and pass the 16-bit one as out16)"
            )
        if not p.is_contiguous():
            raise ValueError(f"{name} is not contiguous; FusedAdam needs contiguous parameters")
        _check_device(p, name)

    def _check_tensor(
        self, t: Any, name: str, dtypes: tuple[torch.dtype, ...], param: torch.Tensor, *, contiguous: bool = True
    ) -> None:
        check_tensor(t, name, dtypes, param.numel(), contiguous=contiguous)
        _check_device(t, name, param.device)

    def _update(self, work: list[tuple[dict, list]]) -> None:
        if work:
            _op()  # build or load the op before any state changes, so a failed build changes nothing
        for group, items in work:
            # Parameters of a group usually share their step count; those that skipped steps
            # (no grad) or came from another checkpoint may not, and take their own launch.
            by_step: dict[int, list] = {}
            for p, target in items:
                by_step.setdefault(self._next_step(p), []).append((p, target))
            for step, pairs in by_step.items():
                ps = [p for p, _ in pairs]
                args = AdamArgs(step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                                bias_correction=group["bias_correction"])
                launch(ps, [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps],
                       [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps],
                       [t for _, t in pairs], args)

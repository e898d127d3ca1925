"""Adam/AdamW on the GPU with the fused multi-tensor kernel (csrc/adam/fused_adam.cu).

The GPU twin of `zero.ops.cpu_adam`, with the same names and behaviour. Two ways in:

* `fused_adam_step(...)`: one step over lists of CUDA tensors in one kernel launch (a few when
  the list is long or mixes devices or grad dtypes). This is what the engine calls on each
  rank's fp32 master shard, optionally unscaling the gradient and writing the updated
  parameters to 16-bit buffers in the same pass.
* `fused_adam_step_fmt_unchecked(...)`: one step over one flat CUDA buffer whose master and
  moments are stored in a low-precision `AdamFormat` (bf16 master, bf16 or 8-bit moments; see
  zero.ops.adam_formats), bit for bit what `zero.ops.cpu_adam.cpu_adam_step_fmt_unchecked`
  computes on the CPU.
* `FusedAdam`: a `torch.optim.Optimizer` for fp32 CUDA parameters, a drop-in for
  `torch.optim.AdamW` (or `torch.optim.Adam` with `adamw_mode=False`). Its `state_dict()` has
  torch's Adam layout, so state moves between the two both ways.

Every argument is checked, with a ValueError naming the offending one, before anything is
launched; scalars and dtypes are checked before devices, so those checks need no GPU.
`fused_adam_step_unchecked` skips those checks, for callers (the engine's hot path) whose
arguments are valid by construction. The op is compiled at first use, so importing this module
works on a machine without CUDA.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.ops.adam_common import (
    GRAD_DTYPES,
    OUT16_DTYPES,
    AdamOptimizerBase,
    bump_versions,
    check_adam_hyperparameters,
    check_grad_scale,
    check_step_number,
    check_tensor,
)
from zero.ops.adam_formats import KERNEL_CODES, AdamFormat
from zero.ops.builder import load


def _op():
    return load("fused_adam")


# ----------------------------------------------------------------------------- argument checks


def _check_device(t: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    """Raise ValueError unless `t` is a CUDA tensor (on `device`, when given)."""
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} must be a CUDA tensor, got device {t.device} "
            f"(FusedAdam runs on the GPU; use zero.ops.CPUAdam for CPU tensors)"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but its param is on {device}")


def _as_list(xs: Any, name: str, n: int | None = None) -> list:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise ValueError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if n is not None and len(xs) != n:
        raise ValueError(f"{name} has {len(xs)} entries but params has {n}")
    return list(xs)


# ----------------------------------------------------------------------------- functional step


def fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """One Adam/AdamW step in place over lists of CUDA tensors, in one fused launch.

    Computes, elementwise, what torch.optim.AdamW / Adam compute, bit for bit what
    `zero.ops.cpu_adam_step` computes on the CPU (see [Note: adam math] in csrc/adam/adam_math.h):
    `g = grad / grad_scale`; AdamW: `param *= 1 - lr*weight_decay`, Adam: `g += weight_decay*param`;
    `m += (1-beta1)*(g - m)`; `v = beta2*v + (1-beta2)*g*g`;
    `param -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` with `bc = 1 - beta**step` (or 1).
    The launch goes on the current CUDA stream of the params' device.

    Args:
        params: float32 CUDA master parameters, contiguous; updated in place.
        grads: one gradient per param, float32, bfloat16 or float16 (may differ between
            entries), contiguous, same number of elements and device; read only.
        exp_avgs: float32 first moments, one per param, same size and device; updated in place.
        exp_avg_sqs: float32 second moments, one per param, same size and device; updated in place.
        step: the 1-based number of this step, shared by every tensor in the call.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True for torch.optim.AdamW's decoupled decay, False for torch.optim.Adam's L2.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        grad_scale: every gradient is divided by this first (loss-scale unscaling and clipping in
            the same pass); 1.0 = none.
        out16: optional list with one entry per param: None, or a contiguous bfloat16/float16
            CUDA tensor with the param's number of elements that receives the updated param
            rounded to nearest even, bit-identical to `param.to(dtype)`.

    Raises:
        ValueError: an argument is invalid; nothing has been launched.
    """
    check_adam_hyperparameters(lr, betas, eps, weight_decay)
    check_step_number(step)
    check_grad_scale(grad_scale)
    params = _as_list(params, "params")
    n = len(params)
    grads = _as_list(grads, "grads", n)
    exp_avgs = _as_list(exp_avgs, "exp_avgs", n)
    exp_avg_sqs = _as_list(exp_avg_sqs, "exp_avg_sqs", n)
    outs = [None] * n if out16 is None else _as_list(out16, "out16", n)
    for i in range(n):
        check_tensor(params[i], f"params[{i}]", (torch.float32,))
        size = params[i].numel()
        check_tensor(grads[i], f"grads[{i}]", GRAD_DTYPES, size)
        check_tensor(exp_avgs[i], f"exp_avgs[{i}]", (torch.float32,), size)
        check_tensor(exp_avg_sqs[i], f"exp_avg_sqs[{i}]", (torch.float32,), size)
        if outs[i] is not None:
            check_tensor(outs[i], f"out16[{i}]", OUT16_DTYPES, size)
    for i in range(n):
        _check_device(params[i], f"params[{i}]")
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i]),
                        ("out16", outs[i])):  # fmt: skip
            if t is not None:
                _check_device(t, f"{name}[{i}]", params[i].device)
    _launch(params, grads, exp_avgs, exp_avg_sqs, outs, step=step, lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
            grad_scale=grad_scale)  # fmt: skip


def fused_adam_step_unchecked(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """`fused_adam_step` without its argument checks, for a hot path whose arguments are valid by
    construction (the engine's optimizer step).

    Same arguments and effect as `fused_adam_step`, which documents what valid means. Nothing here
    checks tensors: a wrong dtype, device, size or layout is undefined behaviour (memory the
    kernel should not touch may be read or written). Only the kernel's own last-line checks
    remain: a bad hyperparameter raises RuntimeError before anything is launched.

    Raises:
        OpUnavailable: the op cannot be built here (tried once per process, see zero.ops.builder).
    """
    n = len(params)
    _launch(params, grads, exp_avgs, exp_avg_sqs, [None] * n if out16 is None else out16, step=step, lr=lr,
            betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
            bias_correction=bias_correction, grad_scale=grad_scale)  # fmt: skip


def _launch(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor | None],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float,
) -> None:
    """Call the op once per (device, grad dtype, out16 dtype) over already checked tensors.

    The batches are built here, in lockstep, so the binding always gets lists of equal length and
    one grad dtype and one out16 dtype per call (it checks neither)."""
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
        op.adam_step(
            ps, gs, ms, vs, [] if out_dtype is None else os_,
            float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale),
            int(step), bool(adamw_mode), bool(bias_correction),
        )  # fmt: skip
        for tensors in (ps, ms, vs, os_):
            bump_versions(tensors)


def fused_adam_step_fmt_unchecked(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    fmt: AdamFormat,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    m_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out16: torch.Tensor | None = None,
    index: int = 0,
) -> None:
    """One Adam/AdamW step in place over one flat CUDA buffer whose master and moments are stored
    in the formats `fmt` names (see zero.ops.adam_formats and [Note: state formats] in
    csrc/adam/adam_formats.h), in one launch on the current CUDA stream of param's device.

    Bit for bit what `zero.ops.cpu_adam.cpu_adam_step_fmt_unchecked` computes with the same
    arguments (the kernels share zero_adam_fmt_element). Nothing here checks tensors: a wrong
    dtype, device, size or layout is undefined behaviour (memory the kernel should not touch may
    be read or written). Only the kernel's own last-line checks remain: a bad hyperparameter
    raises RuntimeError before anything is launched.

    Args:
        param: the master, a contiguous CUDA tensor of fmt.master_dtype (float32 or bfloat16);
            updated in place.
        grad: gradient, float32, bfloat16 or float16, same number of elements; read only.
        exp_avg, exp_avg_sq: the moments, fmt.state_dtype (float32, bfloat16, or uint8 codes);
            updated in place.
        m_scale, v_scale: 8-bit states only: float32, one per 256-element block from element 0
            (`zero.ops.adam_formats.new_scales`); read and rewritten. None otherwise.
        out16: None, or a bfloat16/float16 buffer with param's number of elements that receives
            the stored master rounded to nearest even (for a bf16 master, a bf16 copy has exactly
            the master's bits).
        index: the global index of element 0 in [0, 2^64) (the stochastic-rounding counter;
            buffers that are pieces of one model take their position in it, so the rounding does
            not depend on how the model is split).
        The others: as `fused_adam_step`.

    Raises:
        OpUnavailable: the op cannot be built here (tried once per process, see zero.ops.builder).
    """
    _op().adam_step_fmt(
        param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16,
        float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale),
        int(step), bool(adamw_mode), bool(bias_correction), KERNEL_CODES[fmt.master], KERNEL_CODES[fmt.state],
        bool(fmt.stochastic), int(fmt.seed), int(index),
    )  # fmt: skip
    bump_versions((param, exp_avg, exp_avg_sq, m_scale, v_scale, out16))


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
                _launch(
                    ps,
                    [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps],
                    [self.state[p]["exp_avg"] for p in ps],
                    [self.state[p]["exp_avg_sq"] for p in ps],
                    [t for _, t in pairs],
                    step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                    bias_correction=group["bias_correction"], grad_scale=1.0,
                )  # fmt: skip

"""Lion and Adagrad on the CPU with a native kernel (csrc/optim/cpu_optim.c): the host update of
optimizer offload for the two element-wise optimizers DeepSpeed also offloads natively.

`lion_step` and `adagrad_step` take flat contiguous CPU tensors: the fp32 master, the gradient
(fp32, bf16 or fp16, divided by `grad_scale` in the same pass: zero's one divisor) and the fp32
state, and optionally write the updated parameters to a 16-bit buffer. Every argument is checked,
with a ValueError naming it, before anything is written. Without a C compiler the torch reference
of the same arithmetic runs instead (see [Note: native-op fallback] in zero/ops/fallback.py).
"""
from __future__ import annotations

import math

import torch

from zero.ops import simd as _simd
from zero.ops.adam_common import GRAD_DTYPES, OUT16_DTYPES, check_tensor
from zero.ops.builder import load
from zero.ops.fallback import run_native

_OP = "cpu_optim"


def _check(param, grad, state, state_name: str, out16, grad_scale: float, **values: float) -> None:
    n = param.numel() if isinstance(param, torch.Tensor) else None
    check_tensor(param, "param", (torch.float32,), None, device_type="cpu")
    check_tensor(grad, "grad", GRAD_DTYPES, n, device_type="cpu")
    check_tensor(state, state_name, (torch.float32,), n, device_type="cpu")
    if out16 is not None:
        check_tensor(out16, "out16", OUT16_DTYPES, n, device_type="cpu")
    if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale!r}")
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@torch.no_grad()
def torch_lion_step(param, grad, exp_avg, *, lr, betas, weight_decay, grad_scale, out16=None) -> None:
    """Lion with torch ops (zero.optim.lion.Lion's arithmetic): the kernel's reference and fallback."""
    beta1, beta2 = betas
    g = grad.float() / grad_scale
    param.mul_(1 - lr * weight_decay)
    param.add_(exp_avg.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-lr)
    exp_avg.mul_(beta2).add_(g, alpha=1 - beta2)
    if out16 is not None:
        out16.copy_(param)


@torch.no_grad()
def torch_adagrad_step(param, grad, state_sum, *, clr, eps, weight_decay, grad_scale, out16=None) -> None:
    """Adagrad with torch ops (torch.optim.Adagrad's single-tensor arithmetic, lr already decayed)."""
    g = grad.float() / grad_scale
    if weight_decay:
        g = g.add(param, alpha=weight_decay)
    state_sum.addcmul_(g, g, value=1)
    param.addcdiv_(g, state_sum.sqrt().add_(eps), value=-clr)
    if out16 is not None:
        out16.copy_(param)


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              betas: tuple[float, float], weight_decay: float = 0.0, grad_scale: float = 1.0,
              out16: torch.Tensor | None = None, num_threads: int | None = None) -> None:
    """One Lion step in place on `param` and `exp_avg` (see torch_lion_step for the arithmetic)."""
    _check(param, grad, exp_avg, "exp_avg", out16, grad_scale, lr=lr, weight_decay=weight_decay)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    threads = _simd.num_threads(num_threads)
    run_native(_OP, lambda: load(_OP).lion_step(param, grad, exp_avg, out16, lr, betas[0], betas[1], weight_decay,
                                               grad_scale, threads),
               lambda: torch_lion_step(param, grad, exp_avg, lr=lr, betas=betas, weight_decay=weight_decay,
                                       grad_scale=grad_scale, out16=out16), what="the host Lion step")


def adagrad_step(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, *, clr: float, eps: float,
                 weight_decay: float = 0.0, grad_scale: float = 1.0, out16: torch.Tensor | None = None,
                 num_threads: int | None = None) -> None:
    """One Adagrad step in place on `param` and `state_sum`, `clr` the decayed learning rate
    lr / (1 + (step - 1) * lr_decay) (see torch_adagrad_step for the arithmetic)."""
    _check(param, grad, state_sum, "state_sum", out16, grad_scale, clr=clr, eps=eps, weight_decay=weight_decay)
    threads = _simd.num_threads(num_threads)
    run_native(_OP, lambda: load(_OP).adagrad_step(param, grad, state_sum, out16, clr, eps, weight_decay, grad_scale,
                                                  threads),
               lambda: torch_adagrad_step(param, grad, state_sum, clr=clr, eps=eps, weight_decay=weight_decay,
                                          grad_scale=grad_scale, out16=out16), what="the host Adagrad step")

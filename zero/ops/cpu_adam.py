"""Adam/AdamW on the CPU with the native kernel (csrc/adam/cpu_adam.c).

Two ways in:

* `cpu_adam_step(...)`: one step over flat contiguous CPU tensors. This is what the engine calls
  on each rank's fp32 master shard (ZeRO-Offload), optionally unscaling the gradient and writing
  the updated parameters to a 16-bit buffer in the same pass.
* `CPUAdam`: a `torch.optim.Optimizer` for fp32 CPU parameters, a drop-in for
  `torch.optim.AdamW` (or `torch.optim.Adam` with `adamw_mode=False`). Its `state_dict()` has
  torch's Adam layout, so state moves between the two both ways.

Every argument is checked, with a ValueError naming the offending one, before any buffer is
written. `cpu_adam_step_unchecked` skips those checks, for callers (the engine's hot path) whose
arguments are valid by construction. The kernel picks AVX-512, AVX2 or portable C at run time;
`simd_levels()` lists what this CPU runs and `simd=` forces one (every level computes the same
bits; the tests run each against torch). zero.ops.simd reads `simd=` and `num_threads=` for
every CPU op.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero.ops import simd as _simd
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
from zero.ops.adam_formats import KERNEL_CODES, Q8_BLOCK, AdamFormat, q8_blocks
from zero.ops.builder import load

_OP = "cpu_adam"


def _op():
    return load(_OP)


def simd_levels() -> list[str]:
    """SIMD levels the kernel can run on this CPU, best first (e.g. ["avx512", "avx2", "scalar"])."""
    return _simd.simd_levels(_OP)


def _check_tensor(
    t: Any, name: str, dtypes: tuple[torch.dtype, ...], numel: int | None = None, *, contiguous: bool = True
) -> None:
    """Raise ValueError unless `t` is a (contiguous) dense CPU tensor of one of `dtypes` (and `numel`)."""
    check_tensor(t, name, dtypes, numel, contiguous=contiguous, device_type="cpu")


# ----------------------------------------------------------------------------- functional step


def cpu_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    simd: str | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam/AdamW step in place on contiguous CPU buffers, in a single pass over memory.

    Computes, elementwise, what torch.optim.AdamW / Adam compute (see [Note: adam math] in
    csrc/adam/adam_math.h): `g = grad / grad_scale`; AdamW: `param *= 1 - lr*weight_decay`,
    Adam: `g += weight_decay*param`; `m += (1-beta1)*(g - m)`; `v = beta2*v + (1-beta2)*g*g`;
    `param -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` with `bc = 1 - beta**step` (or 1).

    Args:
        param: float32 master parameters; updated in place. Any shape, contiguous.
        grad: gradient, float32, bfloat16 or float16, same number of elements; read only.
        exp_avg: float32 first moment, same number of elements; updated in place.
        exp_avg_sq: float32 second moment, same number of elements; updated in place.
        step: the 1-based number of this step (1 on the first call for these buffers).
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True for torch.optim.AdamW's decoupled decay, False for torch.optim.Adam's L2.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        grad_scale: the gradient is divided by this first (loss-scale unscaling and clipping in
            the same pass); 1.0 = none.
        out16: optional bfloat16/float16 buffer with param's number of elements; receives the
            updated param rounded to nearest even, bit-identical to `param.to(out16.dtype)`
            for every non-NaN value (a NaN is written as a canonical quiet NaN).
        simd: "avx512", "avx2" or "scalar" to force a code path; None = best available.
        num_threads: OpenMP threads; None = torch.get_num_threads(), <= 0 = OpenMP's default.

    Raises:
        ValueError: an argument is invalid; nothing has been written.
    """
    _check_tensor(param, "param", (torch.float32,))
    n = param.numel()
    _check_tensor(grad, "grad", GRAD_DTYPES, n)
    _check_tensor(exp_avg, "exp_avg", (torch.float32,), n)
    _check_tensor(exp_avg_sq, "exp_avg_sq", (torch.float32,), n)
    if out16 is not None:
        _check_tensor(out16, "out16", OUT16_DTYPES, n)
    check_step_number(step)
    check_adam_hyperparameters(lr, betas, eps, weight_decay)
    check_grad_scale(grad_scale)
    _simd.simd_code(simd, _OP)
    _simd.num_threads(num_threads)
    cpu_adam_step_unchecked(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale, out16=out16, simd=simd,
        num_threads=num_threads,
    )  # fmt: skip


def cpu_adam_step_unchecked(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    simd: str | None = None,
    num_threads: int | None = None,
) -> None:
    """`cpu_adam_step` without its argument checks, for a hot path whose arguments are valid by
    construction (the engine calls it once per offloaded tile).

    Same arguments and effect as `cpu_adam_step`, which documents what valid means. Nothing here
    checks tensors: a wrong dtype, device, size or layout is undefined behaviour (memory the
    kernel should not touch may be read or written). Only the kernel's own last-line checks
    remain: a bad hyperparameter or an unavailable `simd` level raises RuntimeError before
    anything is written.

    Raises:
        OpUnavailable: the op cannot be built here (tried once per process, see zero.ops.builder).
    """
    _op().adam_step(
        param, grad, exp_avg, exp_avg_sq, out16,
        float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale),
        int(step), bool(adamw_mode), bool(bias_correction), _simd.SIMD_CODES[simd],
        torch.get_num_threads() if num_threads is None else num_threads,
    )  # fmt: skip
    bump_versions((param, exp_avg, exp_avg_sq, out16))


# ----------------------------------------------------------------------------- low-precision formats


def cpu_adam_step_fmt(
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
    simd: str | None = None,
    num_threads: int | None = None,
) -> None:
    """`cpu_adam_step` with the master and moments stored in the formats `fmt` names (see
    zero.ops.adam_formats and [Note: state formats] in csrc/adam/adam_formats.h).

    Args:
        param: the master, fmt.master_dtype (float32 or bfloat16); updated in place.
        exp_avg, exp_avg_sq: the moments, fmt.state_dtype (float32, bfloat16, or uint8 codes).
        m_scale, v_scale: 8-bit states only: float32, one per 256-element block.
        index: the global index of element 0 (the stochastic-rounding counter; buffers that are
            pieces of one model take their position in it, so the rounding does not depend on
            how the model is split).
        The others: as cpu_adam_step.

    Raises:
        ValueError: an argument is invalid; nothing has been written.
    """
    _check_tensor(param, "param", (fmt.master_dtype,))
    n = param.numel()
    _check_tensor(grad, "grad", GRAD_DTYPES, n)
    _check_tensor(exp_avg, "exp_avg", (fmt.state_dtype,), n)
    _check_tensor(exp_avg_sq, "exp_avg_sq", (fmt.state_dtype,), n)
    if fmt.quantized:
        for name, t in (("m_scale", m_scale), ("v_scale", v_scale)):
            if t is None:
                raise ValueError(f"{name} is required with 8-bit states (one float32 per {Q8_BLOCK}-element block)")
            _check_tensor(t, name, (torch.float32,), q8_blocks(n))
    if out16 is not None:
        _check_tensor(out16, "out16", OUT16_DTYPES, n)
    if not (isinstance(index, int) and 0 <= index < 2**64):
        raise ValueError(f"index must be an int in [0, 2^64), got {index!r}")
    check_step_number(step)
    check_adam_hyperparameters(lr, betas, eps, weight_decay)
    check_grad_scale(grad_scale)
    _simd.simd_code(simd, _OP)
    _simd.num_threads(num_threads)
    cpu_adam_step_fmt_unchecked(
        param, grad, exp_avg, exp_avg_sq, fmt=fmt, step=step, lr=lr, betas=betas, eps=eps,
        weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale,
        m_scale=m_scale, v_scale=v_scale, out16=out16, index=index, simd=simd, num_threads=num_threads,
    )  # fmt: skip


def cpu_adam_step_fmt_unchecked(param, grad, exp_avg, exp_avg_sq, *, fmt: AdamFormat, step, lr, betas, eps,
                                weight_decay, adamw_mode=True, bias_correction=True, grad_scale=1.0, m_scale=None,
                                v_scale=None, out16=None, index=0, simd=None, num_threads=None) -> None:
    """`cpu_adam_step_fmt` without its argument checks (see cpu_adam_step_unchecked)."""
    _op().adam_step_fmt(
        param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16,
        float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale),
        int(step), bool(adamw_mode), bool(bias_correction), KERNEL_CODES[fmt.master], KERNEL_CODES[fmt.state],
        bool(fmt.stochastic), int(fmt.seed), int(index), _simd.SIMD_CODES[simd],
        torch.get_num_threads() if num_threads is None else num_threads,
    )  # fmt: skip
    bump_versions((param, exp_avg, exp_avg_sq, m_scale, v_scale, out16))


# ----------------------------------------------------------------------------- optimizer


class CPUAdam(AdamOptimizerBase):
    """Adam/AdamW for float32 CPU parameters, one native pass per parameter per step.

    With the default `adamw_mode=True` it computes what `torch.optim.AdamW` computes (to fp32
    round-off); with `adamw_mode=False`, what `torch.optim.Adam` computes. `state_dict()` uses
    torch's Adam layout (per parameter: "step" as a float32 scalar tensor, "exp_avg",
    "exp_avg_sq"), so a state dict saved by either optimizer loads into the other.

    Args:
        params: float32 CPU parameters (contiguous), or dicts of parameter groups.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`. The default
            is 0 (as in torch.optim.Adam and DeepSpeed), not torch.optim.AdamW's 0.01.
        adamw_mode: True: decoupled weight decay like torch.optim.AdamW; False: L2 like torch.optim.Adam.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        amsgrad: must be False; AMSGrad is not implemented.
        num_threads: OpenMP threads per step; None = torch.get_num_threads().
        simd: "avx512", "avx2" or "scalar" to force a code path; None = best available.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        *,
        num_threads: int | None = None,
        simd: str | None = None,
    ) -> None:
        self.num_threads = num_threads
        self.simd = simd
        super().__init__(params, lr, betas, eps, weight_decay, adamw_mode, bias_correction, amsgrad)

    def _check_options(self) -> None:
        self._simd_code = _simd.simd_code(self.simd, _OP)
        _simd.num_threads(self.num_threads)  # validate now, resolve at each step (torch's thread count may change)

    def _check_param(self, p: Any, name: str) -> None:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(
                f"{name} is a {p.dtype} tensor on {p.device}; CPUAdam updates float32 CPU parameters only "
                f"(keep an fp32 CPU master copy, or use zero.ops.FusedAdam for GPU parameters)"
            )
        if not p.is_contiguous():
            raise ValueError(f"{name} is not contiguous; CPUAdam needs contiguous parameters")

    def _check_tensor(
        self, t: Any, name: str, dtypes: tuple[torch.dtype, ...], param: torch.Tensor, *, contiguous: bool = True
    ) -> None:
        _check_tensor(t, name, dtypes, param.numel(), contiguous=contiguous)

    def _update(self, work: list[tuple[dict, list]]) -> None:
        threads = _simd.num_threads(self.num_threads)
        op = _op() if work else None  # built (or found missing) before any state changes
        for group, items in work:
            for p, target in items:
                step = self._next_step(p)
                state = self.state[p]
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                op.adam_step(
                    p, grad, state["exp_avg"], state["exp_avg_sq"], target,
                    float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                    float(group["weight_decay"]), 1.0, step, bool(group["adamw_mode"]),
                    bool(group["bias_correction"]), self._simd_code, threads,
                )  # fmt: skip
                bump_versions((p, target))

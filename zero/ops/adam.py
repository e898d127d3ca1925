"""zero's Adam step: one entry point for every device and state format, and its torch reference.

    args = AdamArgs(step=3, lr=1e-3, weight_decay=0.01)            # + fmt=AdamFormat(...) for bf16/8-bit
    adam_step(master, grad, exp_avg, exp_avg_sq, args, out16=param16)   # CPU or CUDA, by the tensors
    torch_adam_step(master, grad, exp_avg, exp_avg_sq, args)            # the same step in torch

`adam_step` runs the native kernel of the tensors' device: csrc/adam/cpu_adam.c (AVX-512/AVX2/
portable C, OpenMP) on the CPU, csrc/adam/fused_adam.cu on CUDA, for the plain layout (fp32 master
and moments) and for the low-precision formats (see zero.ops.adam_formats). Every argument is
checked first, with a ValueError naming the offending one, before any buffer is written;
`checked=False` skips the checks for a hot path whose arguments are valid by construction (the
engine's), where a wrong dtype, device, size or layout is undefined behaviour. The plain layout
also takes lists of tensors: on CUDA updated in one launch (a few when the list mixes devices or
dtypes), on the CPU one after the other. `torch_adam_step` is the reference: the fallback when no native op can be built (see
[Note: native-op fallback] in zero/ops/fallback.py) and an independent check of the kernels.

The step, elementwise (see [Note: adam math] in csrc/adam/adam_math.h): `g = grad / grad_scale`;
AdamW: `param *= 1 - lr*weight_decay`, Adam: `g += weight_decay*param`; `m += (1-beta1)*(g - m)`;
`v = beta2*v + (1-beta2)*g*g`; `param -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` with `bc = 1 -
beta**step` (or 1 without bias correction).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zero.ops import simd as _simd
from zero.ops.adam_common import (
    GRAD_DTYPES,
    OUT16_DTYPES,
    bump_versions,
    check_adam_hyperparameters,
    check_grad_scale,
    check_step_number,
    check_tensor,
)
from zero.ops.adam_formats import (
    KERNEL_CODES,
    PLAIN,
    Q8_BLOCK,
    AdamFormat,
    decode_moment,
    encode_moment,
    q8_blocks,
    sr_key,
    sr_words,
    to_bf16_stochastic,
)
from zero.ops.builder import load

Tensors = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class AdamArgs:
    """One Adam/AdamW step's numbers and the state format.

    Args:
        step: the 1-based number of this step (1 on the first call for these buffers).
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True for torch.optim.AdamW's decoupled decay, False for torch.optim.Adam's L2.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        grad_scale: the gradient is divided by this first (loss-scale unscaling, averaging and
            clipping in the same pass; see [Note: one divisor] in zero/optim/step.py); 1.0 = none.
        fmt: how the master and moments are stored (zero.ops.adam_formats.AdamFormat; PLAIN:
            fp32 master and moments).
    """

    step: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    bias_correction: bool = True
    grad_scale: float = 1.0
    fmt: AdamFormat = PLAIN

    def check(self) -> None:
        """Raise ValueError naming the first bad number."""
        check_step_number(self.step)
        check_adam_hyperparameters(self.lr, self.betas, self.eps, self.weight_decay)
        check_grad_scale(self.grad_scale)

    def numbers(self) -> tuple:
        """The kernels' scalar arguments: lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw, bias."""
        return (float(self.lr), float(self.betas[0]), float(self.betas[1]), float(self.eps),
                float(self.weight_decay), float(self.grad_scale), int(self.step), bool(self.adamw_mode),
                bool(self.bias_correction))


def adam_step(param: Tensors, grad: Tensors, exp_avg: Tensors, exp_avg_sq: Tensors, args: AdamArgs, *,
              m_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              out16: Tensors | None = None, index: int = 0, checked: bool = True, simd: str | None = None,
              num_threads: int | None = None) -> None:
    """One Adam/AdamW step in place, in a single pass over memory, on the tensors' device.

    Args:
        param: the master, contiguous, `args.fmt.master_dtype` (fp32, or bf16); updated in place.
            With the plain format, a list of them (on CUDA, one launch).
        grad: the gradient, fp32, bf16 or fp16, as many elements; read only.
        exp_avg, exp_avg_sq: the moments, `args.fmt.state_dtype` (fp32, bf16 or uint8 codes).
        args: the step's numbers and the format.
        m_scale, v_scale: 8-bit moments only: fp32, one per Q8_BLOCK-element block.
        out16: None, or a bf16/fp16 buffer of as many elements that receives the updated master
            rounded to nearest even (bit-identical to `param.to(out16.dtype)` for every non-NaN
            value); a list, with a list of params.
        index: the global index of element 0 in [0, 2^64): the stochastic-rounding counter (pieces
            of one model take their position in it, so the rounding does not depend on the split).
        checked: check every argument first (False: the caller guarantees them).
        simd: CPU only: "avx512", "avx2" or "scalar" to force a code path; None = the best.
        num_threads: CPU only: OpenMP threads; None = torch.get_num_threads().

    Raises:
        ValueError: an argument is invalid (checked); nothing has been written.
        OpUnavailable: the op cannot be built here (tried once per process, see zero.ops.builder).
    """
    many = isinstance(param, (list, tuple))
    if checked and not many:
        for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out16", out16)):
            if isinstance(t, (list, tuple)):
                raise ValueError(f"{name} is a list but param is a {type(param).__name__}: params must be a list "
                                 f"of tensors too (or pass one tensor each)")
    first = param[0] if many and param else param
    cuda = isinstance(first, torch.Tensor) and first.device.type == "cuda"
    if checked:
        if many:
            _check_lists(param, grad, exp_avg, exp_avg_sq, out16, args)
        else:
            _check_one(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16, index, args, "cuda" if cuda else "cpu")
        if not cuda:
            _simd.simd_code(simd, "cpu_adam")
            _simd.num_threads(num_threads)
    if cuda:
        _cuda_step(param, grad, exp_avg, exp_avg_sq, args, m_scale, v_scale, out16, index, many)
        return
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if many:
        outs = out16 if out16 is not None else [None] * len(param)
        for p, g, m, v, o in zip(param, grad, exp_avg, exp_avg_sq, outs):
            _cpu_step(p, g, m, v, args, None, None, o, index, simd, threads)
        return
    _cpu_step(param, grad, exp_avg, exp_avg_sq, args, m_scale, v_scale, out16, index, simd, threads)


def _cpu_step(param, grad, exp_avg, exp_avg_sq, args: AdamArgs, m_scale, v_scale, out16, index: int, simd,
              threads: int) -> None:
    op, fmt = load("cpu_adam"), args.fmt
    if fmt.plain:
        op.adam_step(param, grad, exp_avg, exp_avg_sq, out16, *args.numbers(), _simd.SIMD_CODES[simd], threads)
    else:
        op.adam_step_fmt(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16, *args.numbers(),
                         KERNEL_CODES[fmt.master], KERNEL_CODES[fmt.state], bool(fmt.stochastic), int(fmt.seed),
                         int(index), _simd.SIMD_CODES[simd], threads)
    bump_versions((param, exp_avg, exp_avg_sq, m_scale, v_scale, out16))


def _cuda_step(param, grad, exp_avg, exp_avg_sq, args: AdamArgs, m_scale, v_scale, out16, index: int,
               many: bool) -> None:
    from zero.ops.fused_adam import launch, launch_fmt

    if args.fmt.plain:
        if not many:
            param, grad, exp_avg, exp_avg_sq = [param], [grad], [exp_avg], [exp_avg_sq]
            out16 = None if out16 is None else [out16]
        launch(param, grad, exp_avg, exp_avg_sq, [None] * len(param) if out16 is None else out16, args)
        return
    launch_fmt(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16, index, args)


# ----------------------------------------------------------------------------- argument checks


def _check_one(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16, index, args: AdamArgs, device: str) -> None:
    """One set of tensors on one device: tensors first (each named), then the numbers."""
    fmt = args.fmt
    check_tensor(param, "param", (fmt.master_dtype,), device_type=device)
    n = param.numel()
    check_tensor(grad, "grad", GRAD_DTYPES, n, device_type=device)
    check_tensor(exp_avg, "exp_avg", (fmt.state_dtype,), n, device_type=device)
    check_tensor(exp_avg_sq, "exp_avg_sq", (fmt.state_dtype,), n, device_type=device)
    if fmt.quantized:
        for name, t in (("m_scale", m_scale), ("v_scale", v_scale)):
            if t is None:
                raise ValueError(f"{name} is required with 8-bit states (one float32 per {Q8_BLOCK}-element block)")
            check_tensor(t, name, (torch.float32,), q8_blocks(n), device_type=device)
    if out16 is not None:
        check_tensor(out16, "out16", OUT16_DTYPES, n, device_type=device)
    if device == "cuda":
        for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out16", out16),
                        ("m_scale", m_scale), ("v_scale", v_scale)):
            if t is not None and t.device != param.device:
                raise ValueError(f"{name} is on {t.device} but its param is on {param.device}")
    if not (isinstance(index, int) and 0 <= index < 2**64):
        raise ValueError(f"index must be an int in [0, 2^64), got {index!r}")
    args.check()


def _check_same_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but its param is on {device}")


def _as_list(xs, name: str, n: int | None = None) -> list:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise ValueError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if n is not None and len(xs) != n:
        raise ValueError(f"{name} has {len(xs)} entries but params has {n}")
    return list(xs)


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, out16, args: AdamArgs) -> None:
    """Lists of tensors: the numbers first, then every dtype and size, then devices (each tensor on
    its param's; CUDA lists go in one launch, CPU lists one tensor at a time)."""
    args.check()
    if not args.fmt.plain:
        raise ValueError("lists of tensors take the plain format (fp32 master and moments); step each tensor of a "
                         "low-precision format on its own")
    params = _as_list(params, "params")
    n = len(params)
    grads, exp_avgs = _as_list(grads, "grads", n), _as_list(exp_avgs, "exp_avgs", n)
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
        if params[i].device.type not in ("cpu", "cuda"):
            raise ValueError(f"params[{i}] must be a CPU or CUDA tensor, got device {params[i].device}")
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i]),
                        ("out16", outs[i])):
            if t is not None:
                _check_same_device(t, f"{name}[{i}]", params[i].device)


# ----------------------------------------------------------------------------- the reference in torch


def torch_adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    args: AdamArgs, *, m_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out16: torch.Tensor | None = None, index: int = 0) -> None:
    """`adam_step` with torch ops, in place, on flat tensors of any device: the update is torch's
    Adam formula (equal to the kernels' to fp32 round-off); for a low-precision format, widening,
    rounding and codes are the kernels' exactly."""
    if args.fmt.plain:
        _torch_update(param, grad, exp_avg, exp_avg_sq, args)
        if out16 is not None:
            out16.copy_(param)
        return
    fmt = args.fmt
    p = param.float()
    m = decode_moment(exp_avg, m_scale, "exp_avg")
    v = decode_moment(exp_avg_sq, v_scale, "exp_avg_sq")
    _torch_update(p, grad, m, v, args)
    sr = fmt.stochastic
    words = sr_words(sr_key(fmt.seed, args.step), index, param.numel(), p.device) if sr else None
    if param.dtype == torch.bfloat16:
        param.copy_(to_bf16_stochastic(p, words) if sr else p.to(torch.bfloat16))
    else:
        param.copy_(p)
    if out16 is not None:
        out16.copy_(param)
    if exp_avg.dtype == torch.uint8:
        for t, s, new, which in ((exp_avg, m_scale, m, "exp_avg"), (exp_avg_sq, v_scale, v, "exp_avg_sq")):
            codes, scales = encode_moment(new, which)
            t.copy_(codes)
            s.copy_(scales)
    elif exp_avg.dtype == torch.bfloat16 and sr:
        exp_avg.copy_(to_bf16_stochastic(m, words >> 16))
        k2 = sr_key(fmt.seed, args.step)[1]
        exp_avg_sq.copy_(to_bf16_stochastic(v, (((words ^ k2) * 0x9E3779B9) & 0xFFFFFFFF) >> 16))
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


def _torch_update(param, grad, exp_avg, exp_avg_sq, args: AdamArgs) -> None:
    """The update on fp32 tensors (see the module's docstring)."""
    beta1, beta2 = args.betas
    g = grad.float() / args.grad_scale
    if args.adamw_mode:
        param.mul_(1 - args.lr * args.weight_decay)
    elif args.weight_decay:
        g = g.add(param, alpha=args.weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**args.step if args.bias_correction else 1.0
    bc2 = 1 - beta2**args.step if args.bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(args.eps)
    param.addcdiv_(exp_avg, denom, value=-args.lr / bc1)

"""The GPU step over the low-precision state formats gives the CPU kernel's bits.

Both kernels run zero_adam_fmt_element ([Note: state formats] in csrc/adam/adam_formats.h); the
GPU finds an 8-bit block's largest magnitudes with a block-wide max, which is exact, so every
stored byte (master, moments, block scales, 16-bit copy) must match. The numerical tests need a
GPU and are skipped without one; csrc/dev/adam_check.cu checks the same without Python.
"""
import inspect

import pytest
import torch

from zero.ops.adam import adam_step
from zero.ops.adam_formats import AdamFormat, new_moment, new_scales
from zero.testing.adam import keyword_step

cpu_adam_step_fmt_unchecked = keyword_step(checked=False)
fused_adam_step_fmt_unchecked = keyword_step(checked=False)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N = 3 * 256 + 77  # three full 8-bit blocks and a partial one
INDEX = 2**32 - 100  # the generator's counter crosses 2^32 inside the buffer
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def test_one_entry_point_steps_both_devices():
    """The CPU and the CUDA step are one function (zero.ops.adam.adam_step), chosen by the tensors."""
    assert "simd" in inspect.signature(adam_step).parameters and "index" in inspect.signature(adam_step).parameters


def _state(fmt: AdamFormat, device: str) -> list[torch.Tensor | None]:
    """param, exp_avg, exp_avg_sq, m_scale, v_scale, out16 of an N-element buffer in `fmt`."""
    param = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(fmt.master_dtype)
    return [param.to(device), new_moment(N, fmt, device=device), new_moment(N, fmt, device=device),
            new_scales(N, fmt, device=device), new_scales(N, fmt, device=device),
            torch.zeros(N, dtype=torch.bfloat16, device=device)]  # fmt: skip


def _grad(step: int) -> torch.Tensor:
    """Magnitudes spread over 2^0 .. 2^-20, so 8-bit codes reach their small range; fp32 on odd
    steps, bf16 on even ones."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(100 + step)) * torch.logspace(0, -20, N, base=2.0)
    return g if step % 2 else g.to(torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("master", ["fp32", "bf16"])
@pytest.mark.parametrize("state", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_every_format_gives_the_cpu_kernels_bits(master, state, stochastic):
    fmt = AdamFormat(master=master, state=state, stochastic=stochastic, seed=1234)
    cpu, cuda = _state(fmt, "cpu"), _state(fmt, "cuda")
    for step in range(1, 6):
        kw = dict(fmt=fmt, step=step, index=INDEX, **HP)
        p, m, v, ms, vs, out = cpu
        cpu_adam_step_fmt_unchecked(p, _grad(step), m, v, m_scale=ms, v_scale=vs, out16=out, simd="scalar", **kw)
        p, m, v, ms, vs, out = cuda
        fused_adam_step_fmt_unchecked(p, _grad(step).cuda(), m, v, m_scale=ms, v_scale=vs, out16=out, **kw)
    names = ("param", "exp_avg", "exp_avg_sq", "m_scale", "v_scale", "out16")
    for name, a, b in zip(names, cpu, cuda):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), f"{name} differs from the CPU kernel's"

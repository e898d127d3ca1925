"""1-bit compression with error feedback: a tensor becomes its signs (one bit each) and a few scales.

[Note: 1-bit compression]
To send x, a rank adds its error buffer e (what earlier compressions lost) and sends the signs of
y = x + e, packed 8 to a byte (bit i of byte j is element 8j + i; 1 means y >= 0), with one fp32
scale per block of BLOCK elements, s = ||y_block||_2 / sqrt(len(block)), so that s * sign(y) has
the block's root-mean-square. (A bucket mixes layers whose gradients differ by orders of
magnitude: one scale for all would drown the small ones; measured on the demo GPT, blocks of 1024
bring 1-bit Adam's final loss within 2% of Adam's.) It keeps e = y - s * sign(y) for the next
time, so nothing is lost, only delayed: the sum of what was sent over k steps differs from the sum
of the inputs by the current e alone. A receiver of k such messages for the same part takes the
mean of s_r * sign_r. Per element that is 1 + 32/1024 bits. `pack_reference` and
`unpack_mean_reference` define it in torch; `pack` and `unpack_mean` use the native kernels
(csrc/onebit/onebit.c, AVX-512 / AVX2 / portable, and csrc/onebit/onebit.cu), which the tests hold
to the references (bitwise for the bits, 1e-6 for the scales, errors and means), and fall back to
the references where the kernels cannot be built (see [Note: native-op fallback] in
zero/ops/fallback.py).
"""
from __future__ import annotations

import torch

from zero.ops.fallback import run_native

_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def packed_bytes(n: int) -> int:
    """Bytes holding the signs of `n` elements."""
    return (n + 7) // 8


BLOCK = 1024  # elements per scale: gradients of different layers differ by orders of magnitude


def scale_count(n: int, block: int = BLOCK) -> int:
    """Scales sent with `n` elements."""
    return max(1, -(-n // block))


_OPS = {"cpu": "onebit", "cuda": "onebit_cuda"}  # the native op for tensors on each device type


@torch.no_grad()
def pack(x: torch.Tensor, error: torch.Tensor, out: torch.Tensor | None = None,
         block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """As `pack_reference`, by the native kernel for CPU and CUDA tensors; by `pack_reference`
    itself where that kernel cannot be built (warned once) or for other devices and layouts."""
    op = _OPS.get(x.device.type)
    if op is None or not error.is_contiguous() or (out is not None and not out.is_contiguous()):
        return pack_reference(x, error, out, block)

    def native() -> tuple[torch.Tensor, torch.Tensor]:
        from zero.ops.onebit import pack_into, pack_into_cuda

        n = x.numel()
        bits = out if out is not None else torch.empty(packed_bytes(n), dtype=torch.uint8, device=x.device)
        scales = torch.empty(scale_count(n, block), dtype=torch.float32, device=x.device)
        (pack_into_cuda if x.is_cuda else pack_into)(x.float().contiguous(), error, bits, scales, block)
        return bits, scales

    return run_native(op, native, lambda: pack_reference(x, error, out, block), what="1-bit pack")


@torch.no_grad()
def unpack_mean(bits: torch.Tensor, scales: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """As `unpack_mean_reference`, by the native kernel for CPU and CUDA tensors; by
    `unpack_mean_reference` itself where that kernel cannot be built (warned once) or for other
    devices."""
    op = _OPS.get(bits.device.type)
    if op is None:
        return unpack_mean_reference(bits, scales, n, block)

    def native() -> torch.Tensor:
        from zero.ops.onebit import unpack_mean_into, unpack_mean_into_cuda

        out = torch.empty(n, dtype=torch.float32, device=bits.device)
        (unpack_mean_into_cuda if bits.is_cuda else unpack_mean_into)(
            bits.contiguous(), scales.reshape(bits.shape[0], -1).contiguous(), out, block)
        return out

    return run_native(op, native, lambda: unpack_mean_reference(bits, scales, n, block), what="1-bit unpack-mean")


@torch.no_grad()
def pack_reference(x: torch.Tensor, error: torch.Tensor, out: torch.Tensor | None = None,
                   block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress `x` (1-D) with error feedback: returns (bits, scales) and updates `error` in place.

    Args:
        x: the values to send (any float dtype; computed in fp32).
        error: fp32 buffer of x's size, the error carried from earlier calls.
        out: optional uint8 buffer of `packed_bytes(x.numel())` bytes for the bits.
        block: elements per scale (the last block may be shorter).
    """
    n = x.numel()
    y = error.add_(x.float())  # the error buffer becomes y, then the new error
    k = scale_count(n, block)
    padded = torch.zeros(k * block, dtype=torch.float32, device=x.device)
    padded[:n] = y
    counts = torch.full((k,), float(block), device=x.device)
    counts[-1] = n - (k - 1) * block if n else 1.0
    scales = (padded.view(k, block).square().sum(1) / counts).sqrt()
    positive = y >= 0
    per_element = scales.repeat_interleave(block)[:n]
    y.sub_(torch.where(positive, per_element, -per_element))
    bits = torch.zeros(packed_bytes(n) * 8, dtype=torch.uint8, device=x.device)
    bits[:n] = positive
    packed = (bits.view(-1, 8) * _WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)
    if out is not None:
        out.copy_(packed)
        packed = out
    return packed, scales


@torch.no_grad()
def unpack_mean_reference(bits: torch.Tensor, scales: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """The mean over k messages of scale * sign: `bits` is (k, packed_bytes(n)) uint8, `scales`
    (k, scale_count(n)) fp32. Returns n fp32 values."""
    k = bits.shape[0]
    signs = ((bits.unsqueeze(-1) & _WEIGHTS.to(bits.device)) != 0).reshape(k, -1)[:, :n]
    per_element = scales.view(k, -1).repeat_interleave(block, dim=1)[:, :n]
    return torch.where(signs, per_element, -per_element).mean(0)

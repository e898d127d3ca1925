"""The native 1-bit pack and unpack-mean kernels (csrc/onebit/onebit.c) for CPU tensors.

They compute what zero.onebit.compress's torch reference computes ([Note: 1-bit compression]),
with the same bits; zero.onebit.compress uses them for CPU tensors when the op builds.
"""
from __future__ import annotations

import torch

from zero.ops.adam_common import check_tensor
from zero.ops.builder import load
from zero.ops.simd import num_threads as _threads
from zero.ops.simd import simd_code


def _check_pack(x, error, bits, scales, block: int, device_type: str) -> None:
    n = x.numel() if isinstance(x, torch.Tensor) else 0
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 32:
        raise ValueError(f"block must be a positive multiple of 32, got {block!r}")
    check_tensor(x, "x", (torch.float32,), None, contiguous=True, device_type=device_type)
    check_tensor(error, "error", (torch.float32,), n, contiguous=True, device_type=device_type)
    check_tensor(bits, "bits", (torch.uint8,), (n + 7) // 8, contiguous=True, device_type=device_type)
    check_tensor(scales, "scales", (torch.float32,), max(1, -(-n // block)), contiguous=True, device_type=device_type)


def _check_unpack(bits, scales, out, block: int, device_type: str) -> None:
    n = out.numel() if isinstance(out, torch.Tensor) else 0
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 32:
        raise ValueError(f"block must be a positive multiple of 32, got {block!r}")
    check_tensor(out, "out", (torch.float32,), None, contiguous=True, device_type=device_type)
    if not isinstance(bits, torch.Tensor) or bits.dim() != 2 or bits.shape[1] != (n + 7) // 8 or bits.shape[0] < 1:
        raise ValueError(f"bits must be (k >= 1, {(n + 7) // 8}) uint8 for {n} elements, got "
                         f"{tuple(bits.shape) if isinstance(bits, torch.Tensor) else type(bits).__name__}")
    check_tensor(bits, "bits", (torch.uint8,), None, contiguous=True, device_type=device_type)
    check_tensor(scales, "scales", (torch.float32,), bits.shape[0] * max(1, -(-n // block)), contiguous=True,
                 device_type=device_type)


def pack_into(x: torch.Tensor, error: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, block: int,
              simd: str | None = None, num_threads: int | None = None) -> None:
    """x, error: contiguous fp32 CPU tensors of n elements (error updated); bits: ceil(n/8) uint8;
    scales: ceil(n/block) fp32; simd, num_threads: as for zero.ops.simd. Raises OpUnavailable,
    before anything is written, if the op cannot be built."""
    _check_pack(x, error, bits, scales, block, "cpu")
    op = load("onebit")
    op.pack(x, error, bits, scales, block, simd_code(simd, "onebit"), _threads(num_threads))


def unpack_mean_into(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int,
                     simd: str | None = None, num_threads: int | None = None) -> None:
    """bits: (k, ceil(n/8)) uint8; scales: (k, ceil(n/block)) fp32; out: n fp32 (all contiguous, CPU).
    Raises OpUnavailable, before anything is written, if the op cannot be built."""
    _check_unpack(bits, scales, out, block, "cpu")
    op = load("onebit")
    op.unpack_mean(bits, scales, out, block, simd_code(simd, "onebit"), _threads(num_threads))


def pack_into_cuda(x: torch.Tensor, error: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """As `pack_into`, for contiguous tensors on one CUDA device (on its current stream)."""
    _check_pack(x, error, bits, scales, block, "cuda")
    load("onebit_cuda").pack(x, error, bits, scales, block)


def unpack_mean_into_cuda(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """As `unpack_mean_into`, for contiguous tensors on one CUDA device."""
    _check_unpack(bits, scales, out, block, "cuda")
    load("onebit_cuda").unpack_mean(bits, scales, out, block)

"""The native 1-bit pack and unpack-mean kernels (csrc/onebit/onebit.c) for CPU tensors.

They compute what zero.onebit.compress's torch reference computes ([Note: 1-bit compression]),
with the same bits; zero.onebit.compress uses them for CPU tensors when the op builds.
"""
from __future__ import annotations

import torch

from zero.ops.builder import load
from zero.ops.cpu_adam import _num_threads, _simd_code


def pack_into(x: torch.Tensor, error: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, block: int,
              simd: str | None = None, num_threads: int | None = None) -> None:
    """x, error: contiguous fp32 CPU tensors of n elements (error updated); bits: ceil(n/8) uint8;
    scales: ceil(n/block) fp32. Raises OpUnavailable if the op cannot be built."""
    load("onebit").pack(x, error, bits, scales, block, _simd_code(simd), _num_threads(num_threads))


def unpack_mean_into(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int,
                     simd: str | None = None, num_threads: int | None = None) -> None:
    """bits: (k, ceil(n/8)) uint8; scales: (k, ceil(n/block)) fp32; out: n fp32 (all contiguous, CPU)."""
    load("onebit").unpack_mean(bits, scales, out, block, _simd_code(simd), _num_threads(num_threads))


def pack_into_cuda(x: torch.Tensor, error: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """As `pack_into`, for contiguous tensors on one CUDA device (on its current stream)."""
    load("onebit_cuda").pack(x, error, bits, scales, block)


def unpack_mean_into_cuda(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """As `unpack_mean_into`, for contiguous tensors on one CUDA device."""
    load("onebit_cuda").unpack_mean(bits, scales, out, block)

"""The native kernels of qwZ's int8 weight blocks (csrc/quant): quantize and dequantize CPU and
CUDA tensors. They compute what zero.zeropp.blocks' torch reference computes, with the same bits
(see [Note: int8 weight blocks] there); zero.zeropp.blocks calls them when the op builds."""
from __future__ import annotations

import torch

from zero.ops.adam_common import check_tensor
from zero.ops.builder import load
from zero.ops.native import dtype_code
from zero.ops.simd import num_threads as _threads

BLOCK = 256  # ZERO_QW_BLOCK
VALUES = (torch.float32, torch.float16, torch.bfloat16)


def message_bytes(n: int) -> int:
    """Bytes of the message of n elements: n codes padded to 4 bytes, one fp32 scale per block."""
    return -(-n // 4) * 4 + 4 * -(-n // BLOCK)


def _check(x, msg, device_type: str) -> None:
    check_tensor(x, "x", VALUES, None, contiguous=True, device_type=device_type)
    check_tensor(msg, "msg", (torch.uint8,), message_bytes(x.numel()), contiguous=True, device_type=device_type)


def _check_out(msgs, n: int, out, device_type: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(msgs, torch.Tensor) or msgs.dim() != 2 or msgs.shape[1] != message_bytes(n):
        raise ValueError(f"msgs must be (k, {message_bytes(n)}) uint8 for messages of {n} elements, got "
                         f"{tuple(msgs.shape) if isinstance(msgs, torch.Tensor) else type(msgs).__name__}")
    check_tensor(msgs, "msgs", (torch.uint8,), None, contiguous=True, device_type=device_type)
    check_tensor(out, "out", VALUES, msgs.shape[0] * n, contiguous=True, device_type=device_type)


def quantize_into(x: torch.Tensor, msg: torch.Tensor, num_threads: int | None = None) -> None:
    """x: n elements (fp32/fp16/bf16, contiguous, CPU); msg: message_bytes(n) uint8. Raises
    OpUnavailable, before anything is written, if the op cannot be built."""
    _check(x, msg, "cpu")
    load("quant").quantize(x, msg, _threads(num_threads))


def dequantize_into(msgs: torch.Tensor, n: int, out: torch.Tensor, num_threads: int | None = None) -> None:
    """msgs: (k, message_bytes(n)) uint8; out: k * n elements (fp32/fp16/bf16), message r into
    out[r * n:]; all contiguous CPU tensors."""
    _check_out(msgs, n, out, "cpu")
    load("quant").dequantize(msgs, n, out, _threads(num_threads))


def quantize_into_cuda(x: torch.Tensor, msg: torch.Tensor) -> None:
    """As `quantize_into`, for tensors on one CUDA device (on its current stream)."""
    _check(x, msg, "cuda")
    load("quant_cuda").quantize(x, dtype_code(x), msg)


def dequantize_into_cuda(msgs: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """As `dequantize_into`, for tensors on one CUDA device."""
    _check_out(msgs, n, out, "cuda")
    load("quant_cuda").dequantize(msgs, n, out, dtype_code(out))

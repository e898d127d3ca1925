"""qwZ's int8 weight blocks: the torch reference, and the native kernels' dispatch.

[Note: int8 weight blocks]
ZeRO++'s qwZ sends stage 3's all-gather as int8 codes with one scale per block (DeepSpeed's
`zero_quantized_weights`). A rank's message of its n-element shard is
    n int8 codes, padded with zeros to a multiple of 4 bytes | one fp32 scale per block of 256
(the blocks of the 8-bit optimizer states, zero/ops/adam_formats.py; the codes here are linear,
not logarithmic: a block of weights needs even steps across its range, a moment's magnitudes do
not). scale = amax / 127 over the block; code = round-half-even(x / scale) clamped to +-127,
0 where the scale is 0 or not finite; decoded, code * scale in fp32, rounded to the parameters'
dtype. A NaN or inf in a block makes the whole block NaN after decoding, so a broken weight is
seen, not hidden. Each step is one IEEE operation, so the C kernel (csrc/quant/quant.c), the CUDA
kernel (quant.cu) and this file's reference give the same bits for every finite block; the tests
hold them to it. (A block with a NaN or inf decodes to NaN on every path, but the NaN's sign and
payload bits may differ between CPU and GPU; every rank decodes the same message on one device.)

The message is 1 + 4/256 bytes per element against 2 (bf16) or 4 (fp32): 0.51x or 0.25x of
the exact gather's bytes. The error per element is at most half a step, amax / 254 of its block.
Masters, optimizer states and gradient reductions stay exact: only what forward and backward
compute with is rounded.
"""
from __future__ import annotations

import contextlib

import torch

from zero.ops.fallback import run_native
from zero.ops.quant import BLOCK, message_bytes

__all__ = ["BLOCK", "message_bytes", "quantize", "dequantize", "quantize_reference", "dequantize_reference"]

_OPS = {"cpu": "quant", "cuda": "quant_cuda"}  # the native op for tensors on each device type
_VALUES = (torch.float32, torch.float16, torch.bfloat16)


class Held:
    """The bytes of a collective's temporaries on a gauge (a BufferGauge with add and sub, or
    None): `hold` as they are made, `drop` as they go, `done` for the rest at the end."""

    def __init__(self, gauge) -> None:
        self.gauge, self.bytes = gauge, 0

    def hold(self, *tensors: torch.Tensor, of: torch.Tensor | None = None) -> None:
        """Count `tensors`; with `of`, only those that are not views of it (a reorder or a cast
        that changed nothing made no new memory)."""
        if of is not None:
            tensors = tuple(t for t in tensors if t.untyped_storage().data_ptr() != of.untyped_storage().data_ptr())
        self._add(sum(t.numel() * t.element_size() for t in tensors))

    def drop(self, *tensors: torch.Tensor) -> None:
        self._add(-sum(t.numel() * t.element_size() for t in tensors))

    def _add(self, nbytes: int) -> None:
        if self.gauge is not None:
            self.bytes += nbytes
            self.gauge.add(nbytes) if nbytes >= 0 else self.gauge.sub(-nbytes)

    def done(self) -> None:
        if self.gauge is not None:
            self.gauge.sub(self.bytes)
            self.bytes = 0

    @contextlib.contextmanager
    def on_error(self):
        """All given back if the block raises (a collective that did not start, memory that ran out)."""
        try:
            yield
        except BaseException:
            self.done()
            raise


def _codes_bytes(n: int) -> int:
    return -(-n // 4) * 4


@torch.no_grad()
def quantize_reference(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The message of `x` (any shape, flattened; fp32/fp16/bf16), see [Note: int8 weight blocks]."""
    flat = x.detach().reshape(-1).float()
    n, blocks = flat.numel(), -(-flat.numel() // BLOCK)
    msg = out if out is not None else torch.empty(message_bytes(n), dtype=torch.uint8, device=x.device)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    rows = padded.view(blocks, BLOCK)
    top = rows.abs().amax(dim=1) if blocks else torch.zeros(0, device=x.device)  # NaN stays NaN
    scale = top / torch.full_like(top, 127.0)  # a true division (by a scalar, CUDA multiplies by 1/127)
    ok = (scale > 0) & torch.isfinite(scale)
    safe = torch.where(ok, scale, torch.ones_like(scale))
    codes = torch.where(ok[:, None], torch.clamp(torch.round(rows / safe[:, None]), -127, 127), torch.zeros_like(rows))
    cb = _codes_bytes(n)
    msg[:cb].zero_()
    msg[:n].copy_(codes.reshape(-1)[:n].to(torch.int8).view(torch.uint8))
    msg[cb:].copy_(scale.view(torch.uint8))
    return msg


@torch.no_grad()
def dequantize_reference(msgs: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """k messages of n elements each ((k, message_bytes(n)) uint8) into `out` (k * n elements of
    its dtype), message r into out[r * n:]."""
    k, cb, blocks = msgs.shape[0], _codes_bytes(n), -(-n // BLOCK)
    if n == 0 or k == 0:
        return out
    codes = msgs[:, :n].contiguous().view(torch.int8).float()
    scales = msgs[:, cb:].contiguous().view(torch.float32).view(k, blocks)
    values = codes * scales.repeat_interleave(BLOCK, dim=1)[:, :n]
    out.view(-1).copy_(values.reshape(-1))  # rounded to out's dtype
    return out


def _native_ok(*tensors: torch.Tensor) -> str | None:
    """The native op for these tensors, or None when only the reference takes them."""
    device = tensors[0].device.type
    if device not in _OPS or any(not t.is_contiguous() or t.device.type != device for t in tensors):
        return None
    return _OPS[device]


@torch.no_grad()
def quantize(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """As `quantize_reference`, by the native kernel for contiguous CPU and CUDA tensors (the
    reference where it cannot be built, warned once)."""
    if x.dtype not in _VALUES:
        raise TypeError(f"qwZ quantizes fp32, fp16 or bf16 weights, got {x.dtype}")
    flat = x.detach().reshape(-1)
    msg = out if out is not None else torch.empty(message_bytes(flat.numel()), dtype=torch.uint8, device=x.device)
    op = _native_ok(flat, msg)
    if op is None:
        return quantize_reference(flat, msg)

    def native() -> torch.Tensor:
        from zero.ops.quant import quantize_into, quantize_into_cuda

        (quantize_into_cuda if flat.is_cuda else quantize_into)(flat, msg)
        return msg

    return run_native(op, native, lambda: quantize_reference(flat, msg), what="qwZ weight quantization")


@torch.no_grad()
def dequantize(msgs: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """As `dequantize_reference`, by the native kernel for contiguous CPU and CUDA tensors."""
    op = _native_ok(msgs, out)
    if op is None:
        return dequantize_reference(msgs, n, out)

    def native() -> torch.Tensor:
        from zero.ops.quant import dequantize_into, dequantize_into_cuda

        (dequantize_into_cuda if out.is_cuda else dequantize_into)(msgs, n, out)
        return out

    return run_native(op, native, lambda: dequantize_reference(msgs, n, out), what="qwZ weight dequantization")

"""Low-precision formats of Adam's state: names, buffers and the torch reference of one step.

See [Note: state formats], [Note: stochastic rounding] and [Note: 8-bit moment codes] in
csrc/adam/adam_formats.h. In short: the master weights are stored as fp32 or bf16, the moments as
fp32, bf16 or 8-bit codes (one byte per element, one fp32 power-of-two scale per block of 256
elements); each step widens them to fp32, applies the Adam update and rounds them back in one pass.

`AdamFormat` names a combination; `new_moment` / `new_scales` allocate the buffers a format
stores; `decode_moment` / `encode_moment` convert between a stored moment and fp32 (checkpoint
conversions, tests); `sr_words` / `to_bf16_stochastic` are the kernels' stochastic rounding in
torch. The step itself, native and in torch, is zero.ops.adam's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Q8_BLOCK = 256  # elements per 8-bit block (ZERO_Q8_BLOCK)
MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
KERNEL_CODES = {"fp32": 0, "bf16": 2, "int8": 8}  # ZERO_F32, ZERO_BF16, ZERO_Q8
_M_EBITS, _V_EBITS = 4, 5
DEFAULT_SEED = 0x5EED


@dataclass(frozen=True)
class AdamFormat:
    """How the optimizer stores its master weights and moments.

    Args:
        master: "fp32" or "bf16".
        state: "fp32", "bf16" or "int8" (8-bit codes with block scales).
        stochastic: round a bf16 master and bf16 moments stochastically (unbiased); False rounds
            them to nearest even, as DeepSpeed does. 8-bit codes always round to nearest (see
            [Note: 8-bit moment codes]).
        seed: the stochastic-rounding generator's seed.
    """

    master: str = "fp32"
    state: str = "fp32"
    stochastic: bool = True
    seed: int = DEFAULT_SEED

    def __post_init__(self):
        if self.master not in MASTER_DTYPES:
            raise ValueError(f"master format {self.master!r}: expected one of {sorted(MASTER_DTYPES)}")
        if self.state not in STATE_DTYPES:
            raise ValueError(f"state format {self.state!r}: expected one of {sorted(STATE_DTYPES)}")

    @property
    def plain(self) -> bool:
        """fp32 master and fp32 moments: the classic layout."""
        return self.master == "fp32" and self.state == "fp32"

    @property
    def master_dtype(self) -> torch.dtype:
        return MASTER_DTYPES[self.master]

    @property
    def state_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.state]

    @property
    def quantized(self) -> bool:
        return self.state == "int8"

    def state_bytes_per_element(self) -> float:
        """Bytes of m + v per element, scales included."""
        if self.quantized:
            return 2 + 2 * 4 / Q8_BLOCK
        return 2 * self.state_dtype.itemsize

    def describe(self) -> str:
        rounding = "stochastic" if self.stochastic else "nearest"
        return f"master {self.master}, moments {self.state}" + (
            f" ({rounding} rounding)" if "bf16" in (self.master, self.state) else "")


PLAIN = AdamFormat()


def q8_blocks(n: int) -> int:
    return -(-n // Q8_BLOCK)


def new_moment(n: int, fmt: AdamFormat, *, device, allocate=None) -> torch.Tensor:
    """A zero moment of n elements in `fmt`'s state format (`allocate(shape, dtype)`: where)."""
    dtype = fmt.state_dtype
    t = allocate((n,), dtype) if allocate is not None else torch.empty(n, dtype=dtype, device=device)
    return t.zero_()


def new_scales(n: int, fmt: AdamFormat, *, device, allocate=None) -> torch.Tensor | None:
    """The per-block scales of an n-element 8-bit moment (None for other formats)."""
    if not fmt.quantized:
        return None
    t = allocate((q8_blocks(n),), torch.float32) if allocate is not None else \
        torch.empty(q8_blocks(n), dtype=torch.float32, device=device)
    return t.zero_()


# ----------------------------------------------------------------------------- 8-bit codes in torch


def _bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> its bit pattern as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(u: torch.Tensor) -> torch.Tensor:
    u = u & 0xFFFFFFFF
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def _pow2(e: int) -> float:
    return math.ldexp(1.0, e)


def _decode_mag(c: torch.Tensor, ebits: int) -> torch.Tensor:
    fmax = (1 << ebits) - 1
    normal = _from_bits((c + ((127 - fmax) << 3)) << 20)
    sub = c.to(torch.float32) * _pow2(-fmax - 2)
    return torch.where(c >= 8, normal, sub)


def _encode_mag(r: torch.Tensor, ebits: int) -> torch.Tensor:
    fmax = (1 << ebits) - 1
    u = _bits(r)
    normal = ((u + 0x80000) >> 20) - ((127 - fmax) << 3)
    t = r * _pow2(fmax + 2)
    sub = (t + 0.5).to(torch.int64)  # toward zero, as the kernels' truncation (t >= 0)
    c = torch.where((u >> 23) >= 128 - fmax, normal, sub)
    return c.clamp(0, (fmax << 3) | 7)


def _block_exponent(top: torch.Tensor) -> torch.Tensor:
    e = ((_bits(top) + 0x80000) >> 23).clamp(1, 253)
    return torch.where(top > 0, e, torch.zeros_like(e))


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """x (1-D fp32) padded with zeros to whole blocks, as (blocks, Q8_BLOCK)."""
    pad = q8_blocks(x.numel()) * Q8_BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, Q8_BLOCK)


def decode_moment(codes: torch.Tensor, scales: torch.Tensor | None, which: str) -> torch.Tensor:
    """A stored moment as fp32: 8-bit codes (`which` "exp_avg" is signed, "exp_avg_sq" not) with
    their block scales, or a bf16/fp32 tensor widened."""
    if codes.dtype != torch.uint8:
        return codes.float()
    c = codes.to(torch.int64)
    n = c.numel()
    scale = scales.float().repeat_interleave(Q8_BLOCK)[:n]
    if which == "exp_avg":
        mag = _decode_mag(c & 0x7F, _M_EBITS) * scale
        return torch.where((c & 0x80) != 0, -mag, mag)
    return _decode_mag(c, _V_EBITS) * scale


def encode_moment(x: torch.Tensor, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 moment -> (8-bit codes, block scales), rounded to nearest (the kernels' codes)."""
    x = x.float().reshape(-1)
    n = x.numel()
    signed = which == "exp_avg"
    mag = x.abs() if signed else x
    e = _block_exponent(_blocked(mag).amax(dim=1))
    scales = torch.where(e > 0, _from_bits(e << 23), torch.zeros((), dtype=torch.float32))
    inv = torch.where(e > 0, _from_bits((254 - e) << 23), torch.zeros((), dtype=torch.float32))
    r = mag * inv.repeat_interleave(Q8_BLOCK)[:n]
    c = _encode_mag(r, _M_EBITS if signed else _V_EBITS)
    if signed:
        c = c | ((_bits(x) >> 24) & 0x80)
    return c.to(torch.uint8), scales


# ----------------------------------------------------------------------------- stochastic rounding in torch

_M32 = 0xFFFFFFFF


def _mix64(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def sr_key(seed: int, step: int) -> tuple[int, int]:
    """(k0, k2) of zero_sr_key_of."""
    a = _mix64(_mix64(seed & ((1 << 64) - 1)) ^ (step & ((1 << 64) - 1)))
    return a & _M32, _mix64(a) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sr_words(key: tuple[int, int], index: int, n: int, device=None) -> torch.Tensor:
    """zero_sr_word for global indices index .. index + n - 1 (int64 tensor of 32-bit words)."""
    i = torch.arange(n, dtype=torch.int64, device=device) + index
    lo, hi = i & _M32, (i >> 32) & _M32
    return _hash32(lo ^ ((key[0] + hi * 0x9E3779B9) & _M32))


def to_bf16_stochastic(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounded up with probability equal to the discarded fraction (16 random bits)."""
    u = _bits(x)
    h = ((u + (words & 0xFFFF)) >> 16) & 0xFFFF
    h = torch.where(torch.isnan(x), torch.full_like(h, 0x7FC0), h)
    return (torch.where(h >= 2**15, h - 2**16, h)).to(torch.int16).view(torch.bfloat16)

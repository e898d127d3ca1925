"""The native block-sparse attention kernels (csrc/sparse_attention/): argument checks and calls.

`BlockSparseIndex.from_layout` compresses a (heads, blocks, blocks) 0/1 layout into what the
kernels read: per layout head and block row the list of key blocks (row_ptr/col_idx), and the
transposed lists (col_ptr/row_idx) that the backward's per-column tasks walk. `forward` and
`backward` check every tensor (a ValueError names the offending one) and call the C kernel for
CPU tensors or the CUDA kernel for GPU tensors. zero.sparse_attention builds the autograd
Function, padding and masks on top of these.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from zero.ops import simd as _simd
from zero.ops.builder import load

DTYPES_CPU = (torch.float32, torch.bfloat16, torch.float16)
DTYPES_CUDA = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 128  # ZERO_SPARSE_MAX_HEAD_DIM in sparse_attention.h


def _index_problem(index) -> str | None:
    """What is wrong with a BlockSparseIndex's fields, or None."""
    if isinstance(index.block, bool) or index.block not in BLOCK_SIZES:
        return f"block must be one of {BLOCK_SIZES}, got {index.block!r}"
    n = index.num_blocks
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"num_blocks must be a positive integer, got {n!r}"
    for ptr_name, idx_name in (("row_ptr", "col_idx"), ("col_ptr", "row_idx")):
        ptr, idx = getattr(index, ptr_name), getattr(index, idx_name)
        if not isinstance(ptr, torch.Tensor) or not isinstance(idx, torch.Tensor) or \
                ptr.dtype != torch.int32 or idx.dtype != torch.int32:
            return f"{ptr_name} and {idx_name} must be int32 tensors"
        if not ptr.is_contiguous() or not idx.is_contiguous() or ptr.device != index.row_ptr.device or \
                idx.device != index.row_ptr.device:
            return "row_ptr, col_idx, col_ptr and row_idx must be contiguous and on one device"
        if ptr.dim() != 2 or ptr.shape[1] != n + 1 or idx.dim() != 1:
            return (f"{ptr_name} must be (layout heads, num_blocks + 1 = {n + 1}) and {idx_name} one-dimensional, "
                    f"got {tuple(ptr.shape)} and {tuple(idx.shape)}")
        ptr, idx = ptr.cpu().long(), idx.cpu()
        if (ptr[:, 1:] < ptr[:, :-1]).any() or ptr[0, 0].item() != 0 or \
                (ptr[1:, 0] != ptr[:-1, -1]).any() or ptr[-1, -1].item() != idx.numel():
            return f"{ptr_name} must rise from 0 to the length of {idx_name} ({idx.numel()}), head after head"
        if idx.numel() and (idx.min().item() < 0 or idx.max().item() >= n):
            return f"{idx_name} must hold block numbers in [0, {n})"
    if index.row_ptr.shape[0] != index.col_ptr.shape[0] or index.col_idx.numel() != index.row_idx.numel():
        return "the row index (row_ptr, col_idx) and its transpose (col_ptr, row_idx) hold different blocks"
    if isinstance(index.heads, bool) or not isinstance(index.heads, int) or index.heads < 1 or \
            index.row_ptr.shape[0] not in (1, index.heads):
        return f"heads must be a positive integer that the {index.row_ptr.shape[0]} layout heads are 1 of or equal"
    return None


@dataclass(frozen=True)
class BlockSparseIndex:
    """A block layout in the kernels' compressed form (see csrc/sparse_attention/sparse_attention.h).

    Args:
        block: the block size (16, 32, 64 or 128).
        num_blocks: block rows (= block columns) of the layout; the sequence is num_blocks * block.
        causal: built for causal attention: blocks above the diagonal were dropped.
        heads: heads of the layout it was made from (1 = one layout for every head).
        row_ptr: (layout_heads, num_blocks + 1) int32 offsets into col_idx.
        col_idx: int32 key block of every kept block, row by row, head by head.
        col_ptr: (layout_heads, num_blocks + 1) int32 offsets into row_idx (the transpose).
        row_idx: int32 query block row of every kept block, column by column, head by head.
    """

    block: int
    num_blocks: int
    causal: bool
    heads: int
    row_ptr: torch.Tensor
    col_idx: torch.Tensor
    col_ptr: torch.Tensor
    row_idx: torch.Tensor

    def __post_init__(self):
        """Check what the kernels index with, so a hand-made index is an error, not a wild read."""
        problem = _index_problem(self)
        if problem:
            raise ValueError(f"BlockSparseIndex: {problem} (make it with BlockSparseIndex.from_layout)")

    @property
    def layout_heads(self) -> int:
        """1 when every head shares the layout, else the number of heads."""
        return self.row_ptr.shape[0]

    @property
    def nnz(self) -> int:
        """Kept blocks, summed over the layout heads."""
        return self.col_idx.numel()

    @property
    def density(self) -> float:
        """Kept blocks / all blocks (of the full square, also for a causal layout)."""
        return self.nnz / max(1, self.layout_heads * self.num_blocks**2)

    def to(self, device: torch.device | str) -> BlockSparseIndex:
        """The same index on `device` (checked once, where it was made: no host round trip here)."""
        moved = object.__new__(BlockSparseIndex)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            object.__setattr__(moved, f.name, value.to(device).contiguous() if isinstance(value, torch.Tensor) else value)
        return moved

    @classmethod
    def from_layout(cls, layout: torch.Tensor, block: int, causal: bool) -> BlockSparseIndex:
        """Compress a (heads, blocks, blocks) layout of 0/1 (or bool) values.

        Identical head layouts are stored once (layout_heads 1); `heads` remembers the count. With `causal`, blocks above the diagonal are
        dropped (the kernels would mask them entirely).

        Raises:
            ValueError: `layout` is not a 3-D square 0/1 tensor, `block` is not a supported size,
                or a block row has no block (after dropping the upper triangle when causal): its
                queries would attend to nothing.
        """
        if isinstance(block, bool) or block not in BLOCK_SIZES:
            raise ValueError(f"block must be one of {BLOCK_SIZES}, got {block!r}")
        if not isinstance(layout, torch.Tensor) or layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
            shape = tuple(layout.shape) if isinstance(layout, torch.Tensor) else type(layout).__name__
            raise ValueError(f"layout must be a (heads, blocks, blocks) tensor, got {shape}")
        if layout.shape[0] < 1 or layout.shape[1] < 1:
            raise ValueError(f"layout must have at least one head and one block, got shape {tuple(layout.shape)}")
        kept = layout.detach().cpu()
        if kept.is_floating_point() or kept.is_complex() or ((kept != 0) & (kept != 1)).any():
            raise ValueError("layout must hold only 0 and 1 (integer or bool)")
        kept = kept.bool()
        if causal:
            kept = torch.tril(kept)
        empty = (~kept.any(dim=2)).nonzero()
        if empty.numel():
            h, r = empty[0].tolist()
            why = " (blocks above the diagonal do not count in causal attention)" if causal else ""
            raise ValueError(f"layout head {h}, block row {r} has no block{why}: its queries would attend to nothing; "
                             f"{empty.shape[0]} such row(s) in all")
        heads = kept.shape[0]
        if heads > 1 and bool((kept == kept[:1]).all()):
            kept = kept[:1]
        if kept.sum() >= 2**31:
            raise ValueError("layout has too many blocks for int32 indices")
        row_ptr, col_idx = _compress(kept)
        col_ptr, row_idx = _compress(kept.transpose(1, 2))
        return cls(block, kept.shape[1], bool(causal), heads, row_ptr, col_idx, col_ptr, row_idx)


def _compress(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ptr, idx) of a bool (heads, n, n) tensor: ptr[h][r] .. ptr[h][r+1] index idx for row r."""
    heads, n, _ = kept.shape
    counts = kept.sum(dim=2).reshape(-1)
    offsets = torch.zeros(heads * n + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    ptr = torch.stack([offsets[h * n : h * n + n + 1] for h in range(heads)])
    idx = kept.nonzero()[:, 2]  # nonzero() is in (head, row, column) order
    return ptr.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()


# ----------------------------------------------------------------------------- checks


def _describe(t: Any) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_inputs(q, k, v, index: BlockSparseIndex, scale: float, key_bias, attn_bias) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (batch, heads, seq, head_dim) tensor, got {_describe(t)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have one shape (self-attention), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must be a CPU or CUDA tensor, got device {q.device}")
    dtypes = DTYPES_CUDA if q.device.type == "cuda" else DTYPES_CPU
    if q.dtype not in dtypes:
        raise ValueError(f"q, k and v must be {' or '.join(str(d).replace('torch.', '') for d in dtypes)} on "
                         f"{q.device.type}, got {q.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")
    batch, heads, seq, head_dim = q.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[3]) must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if not isinstance(index, BlockSparseIndex):
        raise ValueError(f"index must be a BlockSparseIndex, got {type(index).__name__}")
    if seq != index.num_blocks * index.block:
        raise ValueError(f"q has {seq} positions but the layout covers {index.num_blocks} blocks of {index.block} = "
                         f"{index.num_blocks * index.block}; pad the sequence to a multiple of the block size")
    if index.heads not in (1, heads):
        raise ValueError(f"the layout has {index.heads} heads but q has {heads}")
    if index.row_ptr.device != q.device:
        raise ValueError(f"index is on {index.row_ptr.device} but q is on {q.device} (use index.to(q.device))")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if key_bias is not None:
        if (not isinstance(key_bias, torch.Tensor) or tuple(key_bias.shape) != (batch, seq)
                or key_bias.dtype != torch.float32 or key_bias.device != q.device or not key_bias.is_contiguous()):
            raise ValueError(f"key_bias must be a contiguous ({batch}, {seq}) float32 tensor on {q.device}, got "
                             f"{_describe(key_bias)}")
    if attn_bias is not None:
        if (not isinstance(attn_bias, torch.Tensor) or attn_bias.dim() != 2 or attn_bias.shape[0] != attn_bias.shape[1]
                or not 1 <= attn_bias.shape[0] <= seq or attn_bias.dtype != torch.float32
                or attn_bias.device != q.device or not attn_bias.is_contiguous()):
            raise ValueError(f"attn_bias must be a contiguous square (L, L) float32 tensor on {q.device} with "
                             f"1 <= L <= {seq}, got {_describe(attn_bias)}")


def op_for(device: torch.device) -> str:
    """The native op that computes for tensors on `device`: "sparse_attention" (CPU) or
    "sparse_attention_cuda"."""
    return "sparse_attention_cuda" if device.type == "cuda" else "sparse_attention"


def _threads(simd: str | None, num_threads: int | None) -> tuple[int, int]:
    return _simd.simd_code(simd, "sparse_attention"), _simd.num_threads(num_threads)


# ----------------------------------------------------------------------------- calls


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockSparseIndex, *, scale: float,
            key_bias: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None, simd: str | None = None,
            num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of contiguous (batch, heads, seq, head_dim) q, k, v.

    Args:
        q, k, v: one shape, dtype (float32, bfloat16, float16) and device; seq = index's length.
        index: the compressed layout (on q's device).
        scale: the factor of q . k (usually head_dim ** -0.5).
        key_bias: optional (batch, seq) float32, added to every query's score of each key
            (-inf masks a key: padding).
        attn_bias: optional (L, L) float32 with L <= seq, added to score (i, j) for i, j < L.
        simd, num_threads: CPU only: force a SIMD level ("scalar", "avx2", "avx512"), threads.

    Returns:
        (out like q, lse: (batch, heads, seq) float32, the log-sum-exp of each query's scores).

    Raises:
        ValueError: an argument is invalid (the message names it).
        OpUnavailable: the op for q's device (`op_for`) cannot be built here; nothing was computed.
    """
    _check_inputs(q, k, v, index, scale, key_bias, attn_bias)
    op = load(op_for(q.device))
    if q.device.type == "cuda":
        return tuple(op.forward(q, k, v, index.row_ptr, index.col_idx, index.block, index.causal, float(scale),
                                key_bias, attn_bias))
    simd_code, threads = _threads(simd, num_threads)
    return tuple(op.forward(q, k, v, index.row_ptr, index.col_idx, index.block, index.causal, float(scale), key_bias,
                            attn_bias, simd_code, threads))


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
             lse: torch.Tensor, index: BlockSparseIndex, *, scale: float, key_bias: torch.Tensor | None = None,
             attn_bias: torch.Tensor | None = None, simd: str | None = None,
             num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of `forward` for the output gradient `dout`; `out` and `lse` are what
    `forward` returned for the same arguments (P is recomputed from them, never stored)."""
    _check_inputs(q, k, v, index, scale, key_bias, attn_bias)
    for name, t in (("out", out), ("dout", dout)):
        if (not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device
                or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous tensor like q ({tuple(q.shape)} {q.dtype} on {q.device}), "
                             f"got {_describe(t)}")
    if (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != torch.float32
            or lse.device != q.device or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous {tuple(q.shape[:3])} float32 tensor on {q.device}, got {_describe(lse)}")
    op = load(op_for(q.device))
    if q.device.type == "cuda":
        return tuple(op.backward(q, k, v, out, dout, lse, index.row_ptr, index.col_idx, index.col_ptr, index.row_idx,
                                 index.block, index.causal, float(scale), key_bias, attn_bias))
    simd_code, threads = _threads(simd, num_threads)
    return tuple(op.backward(q, k, v, out, dout, lse, index.col_ptr, index.row_idx, index.block, index.causal,
                             float(scale), key_bias, attn_bias, simd_code, threads))

"""Block-sparse self-attention: the autograd Function over the native kernels, a functional form,
and `SparseSelfAttention`, DeepSpeed's module of the same name.

[Note: padding and masks]
The kernels need a sequence that is a whole number of blocks. A sequence of T tokens is padded
with zeros to Tp = ceil(T / block) * block; the padded keys get a key bias of -inf (so no query
attends to them) and the padded query rows are computed and dropped. Masks become two additive
fp32 biases the kernels read only at the blocks they visit: a key bias (batch, Tp) for key
padding and an attention bias (T, T), both constants (no gradient flows into them). A query whose
every key is masked gets a zero output and zero gradients (dense softmax would give NaN).

[Note: sparse attention memory]
Autograd keeps q, k, v (padded copies only when T is not a whole number of blocks or an input
was not contiguous), the output and the per-row log-sum-exp: O(seq * head_dim) per head. The
backward recomputes the attention probabilities block by block from q, k and the log-sum-exp,
so nothing of size seq^2 (or even nnz_blocks * block^2) is ever kept.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from zero.ops import sparse_attention as ops
from zero.ops.fallback import run_native
from zero.ops.sparse_attention import BLOCK_SIZES, BlockSparseIndex
from zero.sparse_attention.sparsity_config import SparsityConfig

MASK_MODES = ("add", "mul")


class BlockSparseAttentionFunction(torch.autograd.Function):
    """out = softmax(scale q k^T + biases, restricted to the index's blocks) v; see the Notes above."""

    @staticmethod
    def forward(ctx, q, k, v, index: BlockSparseIndex, scale: float, key_bias, attn_bias, simd, num_threads):
        seq, padded = q.shape[2], index.num_blocks * index.block
        qp, kp, vp = (_pad_rows(x, padded) for x in (q, k, v))
        # no torch fallback: a dense one would form the seq^2 scores this exists to avoid
        out, lse = run_native(ops.op_for(q.device), lambda: ops.forward(
            qp, kp, vp, index, scale=scale, key_bias=key_bias, attn_bias=attn_bias, simd=simd,
            num_threads=num_threads), what="block-sparse attention (forward)")
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.args = (index, scale, key_bias, attn_bias, simd, num_threads, seq)
        return out if padded == seq else out[:, :, :seq].contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qp, kp, vp, out, lse = ctx.saved_tensors
        index, scale, key_bias, attn_bias, simd, num_threads, seq = ctx.args
        doutp = _pad_rows(dout.to(out.dtype), out.shape[2])
        dq, dk, dv = run_native(ops.op_for(out.device), lambda: ops.backward(
            qp, kp, vp, out, doutp, lse, index, scale=scale, key_bias=key_bias, attn_bias=attn_bias, simd=simd,
            num_threads=num_threads), what="block-sparse attention (backward)")
        if out.shape[2] != seq:
            dq, dk, dv = (g[:, :, :seq] for g in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) as a contiguous tensor with `rows` rows, zero-padded."""
    x = x.contiguous()
    return x if x.shape[2] == rows else F.pad(x, (0, 0, 0, rows - x.shape[2]))


def padded_key_bias(key_bias: torch.Tensor | None, batch: int, seq: int, padded: int,
                    device: torch.device) -> torch.Tensor | None:
    """The kernels' (batch, padded) fp32 key bias: `key_bias` (batch, seq) or 0, and -inf on padding."""
    if key_bias is None and padded == seq:
        return None
    bias = torch.zeros(batch, padded, dtype=torch.float32, device=device)
    if key_bias is not None:
        bias[:, :seq] = key_bias
    bias[:, seq:] = float("-inf")
    return bias


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor | BlockSparseIndex, *,
                     block: int | None = None, causal: bool = False, key_bias: torch.Tensor | None = None,
                     attn_bias: torch.Tensor | None = None, scale: float | None = None, simd: str | None = None,
                     num_threads: int | None = None) -> torch.Tensor:
    """Block-sparse attention of (batch, heads, seq, head_dim) q, k, v, differentiable in q, k, v.

    Args:
        q, k, v: one shape, dtype (float32 or bfloat16; float16 too) and device.
        layout: (heads or 1, blocks, blocks) 0/1 tensor with blocks = ceil(seq / block), or a
            BlockSparseIndex made from one (reuse it across calls to skip the compression).
        block: the block size, 16, 32, 64 or 128 (not needed with a BlockSparseIndex).
        causal: mask keys after each query (and drop blocks above the diagonal).
        key_bias: optional (batch, seq) additive bias per key (-inf masks a key).
        attn_bias: optional (seq, seq) additive bias per (query, key).
        scale: factor of q . k; default head_dim ** -0.5.
        simd, num_threads: CPU only: force a SIMD level, set the thread count.

    Returns:
        The attention output, shaped like q.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a (batch, heads, seq, head_dim) tensor, got {ops._describe(q)}")
    batch, _, seq, head_dim = q.shape
    if isinstance(layout, BlockSparseIndex):
        index = layout if layout.row_ptr.device == q.device else layout.to(q.device)
        if block is not None and block != index.block:
            raise ValueError(f"block={block} but the BlockSparseIndex has block {index.block}")
    else:
        if block is None:
            raise ValueError("block must be given with a layout tensor (16, 32, 64 or 128)")
        index = BlockSparseIndex.from_layout(layout, block, causal).to(q.device)
    if index.causal != bool(causal):
        raise ValueError(f"causal={causal} but the BlockSparseIndex was built with causal={index.causal}")
    padded = index.num_blocks * index.block
    if not padded - index.block < seq <= padded:
        raise ValueError(f"the layout has {index.num_blocks} blocks of {index.block} but the sequence has {seq} "
                         f"tokens; it needs ceil({seq} / {index.block}) = {-(-seq // index.block)} blocks")
    if key_bias is not None and (not isinstance(key_bias, torch.Tensor) or tuple(key_bias.shape) != (batch, seq)):
        raise ValueError(f"key_bias must be a ({batch}, {seq}) tensor, got {ops._describe(key_bias)}")
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor) or tuple(attn_bias.shape) != (seq, seq):
            raise ValueError(f"attn_bias must be a ({seq}, {seq}) tensor, got {ops._describe(attn_bias)}")
        attn_bias = attn_bias.to(device=q.device, dtype=torch.float32).contiguous()
    kb = padded_key_bias(None if key_bias is None else key_bias.to(q.device, torch.float32), batch, seq, padded,
                         q.device)
    scale = head_dim**-0.5 if scale is None else scale
    return BlockSparseAttentionFunction.apply(q, k, v, index, scale, kb, attn_bias, simd, num_threads)


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention over a SparsityConfig's layout (DeepSpeed's SparseSelfAttention).

    Args:
        sparsity_config: the layout (FixedSparsityConfig, BigBirdSparsityConfig, ...).
        key_padding_mask_mode: "add": key_padding_mask is an additive float bias; "mul": it is a
            keep-mask (nonzero or True = attend, 0 or False = masked).
        attn_mask_mode: the same choice for attn_mask.
        max_seq_length: the layout is made once for this many tokens (rounded up to blocks) and
            its top-left corner is used for shorter sequences, as in DeepSpeed. A longer sequence
            remakes it at that length, except with random blocks (BigBird, Variable with
            num_random_blocks), where it is an error: their blocks would change.
        causal: mask future keys; default: the config's attention is "unidirectional".
    """

    def __init__(self, sparsity_config: SparsityConfig, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, *, causal: bool | None = None):
        super().__init__()
        if not isinstance(sparsity_config, SparsityConfig):
            raise ValueError(f"sparsity_config must be a SparsityConfig, got {type(sparsity_config).__name__}")
        if sparsity_config.block not in BLOCK_SIZES:
            raise ValueError(f"sparsity_config.block must be one of {BLOCK_SIZES} for the kernels, "
                             f"got {sparsity_config.block}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
            raise ValueError(f"max_seq_length must be a positive integer, got {max_seq_length!r}")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.causal = (getattr(sparsity_config, "attention", "bidirectional") == "unidirectional") if causal is None \
            else bool(causal)
        self._master: torch.Tensor | None = None
        self._indices: dict[tuple[int, torch.device], BlockSparseIndex] = {}

    def extra_repr(self) -> str:
        return f"{self.sparsity_config!r}, causal={self.causal}"

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The (num_heads, blocks, blocks) layout used for `seq_len` tokens (blocks = ceil(seq_len / block))."""
        corner = self._corner(seq_len)
        return corner.expand(self.sparsity_config.num_heads, -1, -1).long()

    def _corner(self, seq_len: int) -> torch.Tensor:
        """The layout of `seq_len` tokens as kept: bool, one head when all heads share it."""
        block = self.sparsity_config.block
        blocks = -(-seq_len // block)
        if getattr(self.sparsity_config, "num_random_blocks", 0) and blocks > -(-self.max_seq_length // block):
            # see [Note: random blocks]: a layout drawn at another length has other random blocks
            raise ValueError(f"a sequence of {seq_len} tokens is longer than max_seq_length ({self.max_seq_length}): "
                             f"{type(self.sparsity_config).__name__}'s random blocks are drawn once, for the "
                             f"max_seq_length layout, so that every sequence (and every rank) attends to the same "
                             f"blocks; a longer layout would draw them anew. Give SparseSelfAttention("
                             f"max_seq_length=...) the longest sequence")
        if self._master is None or self._master.shape[1] < blocks:
            length = max(blocks, -(-self.max_seq_length // block)) * block
            self._master = self.sparsity_config.compact_layout(length)
            self._indices.clear()
        return self._master[:, :blocks, :blocks]

    def _index(self, seq_len: int, device: torch.device) -> BlockSparseIndex:
        blocks = -(-seq_len // self.sparsity_config.block)
        layout = self._corner(seq_len)  # first: a remade master clears the cache
        key = (blocks, device)
        if key not in self._indices:
            self._indices[key] = BlockSparseIndex.from_layout(layout, self.sparsity_config.block, self.causal).to(device)
        return self._indices[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None, *,
                scale: float | None = None) -> torch.Tensor:
        """Attention of (batch, heads, seq, head_dim) query, key, value (one shape: self-attention).

        Args:
            query, key, value: float32 or bfloat16 (float16 too) tensors of one shape and device.
            rpe: relative position embeddings: not supported (must be None).
            key_padding_mask: optional (batch, seq), read per key_padding_mask_mode.
            attn_mask: optional (seq, seq), read per attn_mask_mode. Its seq x seq fp32 bias is
                the one O(seq^2) tensor of a call (the layout and key_padding_mask cost O(seq)).
            scale: factor of query . key; default head_dim ** -0.5.

        Returns:
            The output, shaped like query.
        """
        if rpe is not None:
            raise NotImplementedError("SparseSelfAttention does not support relative position embeddings (rpe)")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a (batch, heads, seq, head_dim) tensor, got {ops._describe(t)}")
        if not (query.shape == key.shape == value.shape):
            raise ValueError(f"query, key and value must have one shape (self-attention only), got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        batch, heads, seq, _ = query.shape
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"query has {heads} heads but sparsity_config.num_heads is {self.sparsity_config.num_heads}")
        key_bias = _as_bias(key_padding_mask, self.key_padding_mask_mode, (batch, seq), "key_padding_mask")
        attn_bias = _as_bias(attn_mask, self.attn_mask_mode, (seq, seq), "attn_mask")
        return sparse_attention(query, key, value, self._index(seq, query.device), causal=self.causal,
                                key_bias=key_bias, attn_bias=attn_bias, scale=scale)


def _as_bias(mask: torch.Tensor | None, mode: str, shape: tuple[int, int], name: str) -> torch.Tensor | None:
    """An additive fp32 bias from a mask in `mode` ("add": already a bias; "mul": a keep-mask)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
        raise ValueError(f"{name} must be a {shape} tensor, got {ops._describe(mask)}")
    if mode == "add":
        if not mask.is_floating_point():
            raise ValueError(f"{name} is {mask.dtype} but its mode is 'add' (an additive float bias); pass a float "
                             f"bias, or use mode 'mul' for a keep-mask")
        return mask.float()
    return torch.zeros(shape, dtype=torch.float32, device=mask.device).masked_fill(mask == 0, -math.inf)

"""Block-sparse attention (issue 17): DeepSpeed's SparsityConfig layouts and SparseSelfAttention,
on native C (CPU) and CUDA kernels whose cost grows with the number of non-zero blocks.

    from zero.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention
    attention = SparseSelfAttention(BigBirdSparsityConfig(num_heads=12, block=64))
    out = attention(q, k, v)  # (batch, heads, seq, head_dim)

See docs/sparse_attention.md. Importing this package builds nothing; the kernels are compiled at
their first call (zero/ops/builder.py).
"""
from zero.ops.sparse_attention import BlockSparseIndex
from zero.sparse_attention.attention import BlockSparseAttentionFunction, SparseSelfAttention, sparse_attention
from zero.sparse_attention.replace import replace_self_attention
from zero.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseSelfAttention", "sparse_attention",
    "BlockSparseAttentionFunction", "BlockSparseIndex", "replace_self_attention",
]

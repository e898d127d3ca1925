// The CUDA sparse-attention binding's problem struct, filled from tensors (the CPU op fills the same
// struct from Python: zero/ops/native.py).
// zero/ops/sparse_attention.py has checked every shape, dtype, device and index before this.
#pragma once

#include <optional>

#include "bindings/tensor_args.h"
#include "sparse_attention/sparse_attention.h"

// q: (batch, heads, seq, head_dim); layout_heads: rows of the compressed layout (1 or heads).
inline zero_sparse_attention_problem zero_sparse_problem_of(const at::Tensor& q, int64_t block, bool causal,
                                                            double scale, int64_t layout_heads,
                                                            const std::optional<at::Tensor>& key_bias,
                                                            const std::optional<at::Tensor>& attn_bias) {
  zero_sparse_attention_problem p{};
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.seq = q.size(2);
  p.head_dim = q.size(3);
  p.block = block;
  p.dtype = zero_dtype_of(q);
  p.causal = causal ? 1 : 0;
  p.scale = static_cast<float>(scale);
  p.layout_heads = layout_heads;
  p.key_bias = key_bias ? key_bias->data_ptr<float>() : nullptr;
  p.attn_bias = attn_bias ? attn_bias->data_ptr<float>() : nullptr;
  p.attn_bias_len = attn_bias ? attn_bias->size(0) : 0;
  return p;
}

/* Block-sparse attention on the CPU: forward and backward over a compressed block layout.
 *
 * Shapes. q, k, v, out and their gradients are contiguous (batch, heads, seq, head_dim) buffers of
 * one dtype (ZERO_F32, ZERO_BF16 or ZERO_F16 of common/dtypes.h); seq is a multiple of block
 * (the Python layer pads). lse is (batch, heads, seq) fp32: the log-sum-exp of each query row's
 * scores, written by the forward and read by the backward, so nothing of size seq^2 is ever kept.
 *
 * Layout. The (heads, seq/block, seq/block) block layout is given compressed, once per layout
 * head (layout_heads is 1 when every head shares one layout, else heads):
 *   row_ptr: layout_heads x (blocks + 1) int32 offsets into col_idx; block row r of layout head h
 *            attends to the key blocks col_idx[row_ptr[h][r] .. row_ptr[h][r+1]).
 *   col_ptr, row_idx: the same layout transposed (for key block c, the query block rows that
 *            attend to it); only the backward reads them.
 * A causal problem ignores blocks above the diagonal and masks the upper triangle of diagonal
 * blocks.
 *
 * Scores. s[i][j] = scale * q_i . k_j + attn_bias[i][j] + key_bias[b][j], minus infinity where
 * causal masks (j > i). key_bias (batch x seq, may be NULL) carries key padding (-inf on padded
 * keys); attn_bias (attn_bias_len x attn_bias_len, row-major, may be NULL) is read only where
 * i and j are both below attn_bias_len (elsewhere it counts as 0). A query row with no finite
 * score gets out = 0, lse = +inf and zero gradients.
 *
 * Work space. The caller allocates `*_workspace(p, num_threads)` floats (the kernels allocate
 * nothing, so a caller's allocator sees every byte) and passes the same num_threads.
 * simd: a ZERO_SIMD_* level of common/simd.h or ZERO_SIMD_BEST; num_threads <= 0 means the
 * OpenMP default. Every entry point returns ZERO_OK, or a negative code of common/simd.h
 * (ZERO_BAD_ARGUMENT, ZERO_SIMD_UNAVAILABLE) before writing anything. */
#ifndef ZERO_SPARSE_ATTENTION_H
#define ZERO_SPARSE_ATTENTION_H

#include <stdint.h>

#include "common/dtypes.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t batch, heads, seq, head_dim, block;
    int32_t dtype;
    int32_t causal;
    float scale;
    int64_t layout_heads;
    const int32_t *row_ptr, *col_idx; /* forward */
    const int32_t *col_ptr, *row_idx; /* backward */
    const float *key_bias;
    const float *attn_bias;
    int64_t attn_bias_len;
} zero_sparse_attention_problem;

/* Sizes the kernels accept: block 16, 32, 64 or 128; head_dim 1..ZERO_SPARSE_MAX_HEAD_DIM. */
#define ZERO_SPARSE_MAX_HEAD_DIM 128

/* 1 when p describes a problem the CPU and CUDA kernels accept (data pointers not checked). */
static inline int zero_sparse_attention_valid(const zero_sparse_attention_problem *p) {
    if (!p) return 0;
    const int64_t bs = p->block;
    if (bs != 16 && bs != 32 && bs != 64 && bs != 128) return 0;
    if (p->batch < 0 || p->heads < 1 || p->seq < 0 || p->seq % bs) return 0;
    if (p->head_dim < 1 || p->head_dim > ZERO_SPARSE_MAX_HEAD_DIM) return 0;
    if (p->dtype != ZERO_F32 && p->dtype != ZERO_F16 && p->dtype != ZERO_BF16) return 0;
    if (p->layout_heads != 1 && p->layout_heads != p->heads) return 0;
    if (!(p->scale == p->scale) || p->scale - p->scale != 0.0f) return 0; /* NaN or infinite */
    if (p->attn_bias_len < 0 || (p->attn_bias && p->attn_bias_len == 0)) return 0;
    return 1;
}

int64_t zero_sparse_attention_forward_workspace(const zero_sparse_attention_problem *p, int num_threads);
int zero_sparse_attention_forward(const zero_sparse_attention_problem *p, const void *q, const void *k, const void *v,
                                  void *out, float *lse, float *workspace, int simd, int num_threads);

int64_t zero_sparse_attention_backward_workspace(const zero_sparse_attention_problem *p, int num_threads);
int zero_sparse_attention_backward(const zero_sparse_attention_problem *p, const void *q, const void *k,
                                   const void *v, const void *out, const void *dout, const float *lse, void *dq,
                                   void *dk, void *dv, float *workspace, int simd, int num_threads);

#ifdef __cplusplus
}
#endif

#endif

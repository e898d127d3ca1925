/* Block-sparse attention on the GPU: the contract of sparse_attention/sparse_attention.h on device
 * buffers (q, k, v, the outputs, lse, the compressed layout, the biases) and a CUDA stream. The
 * forward reads row_ptr/col_idx; the backward reads both the layout and its transpose, and a
 * work buffer `delta` of batch * heads * seq floats. Plain C ABI, no torch headers. Returns 0,
 * -1 for arguments the kernels refuse, or the CUDA error of the launch. */
#ifndef ZERO_SPARSE_ATTENTION_CUDA_H
#define ZERO_SPARSE_ATTENTION_CUDA_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "sparse_attention/sparse_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

int zero_sparse_attention_forward_cuda(const zero_sparse_attention_problem *p, const void *q, const void *k,
                                       const void *v, void *out, float *lse, cudaStream_t stream);
int zero_sparse_attention_backward_cuda(const zero_sparse_attention_problem *p, const void *q, const void *k,
                                        const void *v, const void *out, const void *dout, const float *lse, void *dq,
                                        void *dk, void *dv, float *delta, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif

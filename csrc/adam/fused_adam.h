/* Fused multi-tensor Adam / AdamW on the GPU.
 *
 * One call updates a list of tensors: fp32 master params with fp32 first and second moments,
 * gradients in fp32, fp16 or bf16 (one dtype per call), and optionally writes a 16-bit copy of
 * every updated param in the same pass. Work is described to the kernel by a chunk table that
 * travels as a kernel argument; see [Note: chunk table] in fused_adam.cu.
 *
 * Per element: the update of [Note: adam math] (adam/adam_math.h), the very function the CPU
 * kernel's reference path calls, so both give the same bits for the same inputs.
 *
 * Plain C ABI: raw device pointers, element counts and a CUDA stream. No torch headers. */
#ifndef ZERO_ADAM_FUSED_ADAM_H
#define ZERO_ADAM_FUSED_ADAM_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "adam/adam_math.h" /* zero_adam_config */

#ifdef __cplusplus
extern "C" {
#endif

/* Update n tensors in place on `stream`.
 *
 *   params, exp_avgs, exp_avg_sqs: n fp32 device buffers of numels[i] elements.
 *   grads: n device buffers of numels[i] elements of `grad_dtype` (ZERO_F32/F16/BF16).
 *   out16: NULL for no copy-out, or n device buffers of numels[i] elements of `out16_dtype`
 *          (ZERO_F16 or ZERO_BF16) that receive the updated params rounded to nearest even;
 *          a NULL entry skips that tensor's copy.
 *
 * Buffers must be contiguous; any alignment works (see [Note: chunk table] for which take the
 * vector path). Returns 0 when every launch was queued, -1 for bad arguments (checked before
 * anything is launched), or a positive cudaError_t from a failed launch. Asynchronous like any
 * launch. */
int zero_fused_adam(int n, float *const *params, const void *const *grads, int32_t grad_dtype,
                    float *const *exp_avgs, float *const *exp_avg_sqs, void *const *out16,
                    int32_t out16_dtype, const int64_t *numels, const zero_adam_config *cfg,
                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif

/* Fused Adam / AdamW on the GPU, two entries:
 *
 * - zero_fused_adam: one call updates a list of tensors: fp32 master params with fp32 first and
 *   second moments, gradients in fp32, fp16 or bf16 (one dtype per call), and optionally writes
 *   a 16-bit copy of every updated param in the same pass. Work is described to the kernel by a
 *   chunk table that travels as a kernel argument; see [Note: chunk table] in fused_adam.cu.
 * - zero_fused_adam_step_fmt: one flat buffer whose master and moments may be stored in the
 *   low-precision formats of adam/adam_formats.h (bf16 master, bf16 or 8-bit moments); see
 *   [Note: state formats on the GPU] in fused_adam.cu.
 *
 * Per element: the update of [Note: adam math] (adam/adam_math.h), the very function the CPU
 * kernel's reference path calls, so both give the same bits for the same inputs.
 *
 * Plain C ABI: raw device pointers, element counts and a CUDA stream. No torch headers. */
#ifndef ZERO_ADAM_FUSED_ADAM_H
#define ZERO_ADAM_FUSED_ADAM_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "adam/adam_formats.h" /* zero_adam_format, ZERO_Q8 */
#include "adam/adam_math.h"    /* zero_adam_config */

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

/* One step over n elements of one flat buffer whose master and moments are stored in the formats
 * `fmt` names (see [Note: state formats] in adam/adam_formats.h), in place on `stream`; the GPU
 * twin of zero_cpu_adam_step_fmt (adam/cpu_adam.h).
 *
 *   param: n device elements, fp32 or bf16 (fmt->master_dtype).
 *   exp_avg, exp_avg_sq: n device elements each, fp32, bf16 or 8-bit codes (uint8)
 *          (fmt->state_dtype).
 *   m_scale, v_scale: for 8-bit codes, ceil(n / ZERO_Q8_BLOCK) fp32 device scales each, one per
 *          block of ZERO_Q8_BLOCK elements from element 0; read and rewritten. NULL otherwise.
 *   grad, grad_dtype, out16, out16_dtype: as in zero_fused_adam (for a bf16 master the copy is
 *          made from the stored master: a bf16 copy has exactly its bits).
 *
 * Gives exactly the bits of zero_adam_block_ref applied block by block, with random words keyed
 * by zero_sr_key_of(fmt->seed, cfg->step) and counted from fmt->index. An all-fp32 format is
 * zero_fused_adam itself. Buffers need only their element alignment. Returns 0 when the launch
 * was queued (or n == 0), -1 for bad arguments (checked before anything is launched), or a
 * positive cudaError_t from a failed launch. Asynchronous like any launch. */
int zero_fused_adam_step_fmt(int64_t n, void *param, const void *grad, int32_t grad_dtype, void *exp_avg,
                             void *exp_avg_sq, float *m_scale, float *v_scale, void *out16, int32_t out16_dtype,
                             const zero_adam_config *cfg, const zero_adam_format *fmt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif

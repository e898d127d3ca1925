/* Fused multi-tensor Adam / AdamW on the GPU.
 *
 * One call updates a list of tensors: fp32 master params with fp32 first and second moments,
 * gradients in fp32, fp16 or bf16 (one dtype per call), and optionally writes a 16-bit copy of
 * every updated param in the same pass. Work is described to the kernel by a chunk table that
 * travels as a kernel argument; see [Note: chunk table] in fused_adam.cu.
 *
 * Per element, with g the gradient divided by grad_scale:
 *   Adam  (adamw_mode = 0): g += weight_decay * p
 *   AdamW (adamw_mode = 1): p *= 1 - lr * weight_decay
 *   m = beta1 * m + (1 - beta1) * g
 *   v = beta2 * v + (1 - beta2) * g * g
 *   p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
 * where bc1 = 1 - beta1^step and bc2 = 1 - beta2^step (both 1 without bias correction),
 * computed in double on the host. The same math as torch.optim.Adam / AdamW.
 *
 * Plain C ABI: raw device pointers, element counts and a CUDA stream. No torch headers. */
#ifndef ZERO_ADAM_FUSED_ADAM_H
#define ZERO_ADAM_FUSED_ADAM_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Hyperparameters of one update, field for field like zero_adam_config of the CPU Adam
 * (adam/cpu_adam.h). Doubles so the host-side arithmetic (bias corrections,
 * 1 - lr * weight_decay) happens at full precision before it is rounded to fp32 once. */
typedef struct {
    double lr;
    double beta1, beta2; /* each in [0, 1) */
    double eps;
    double weight_decay;
    double grad_scale; /* the gradient is divided by this first; 1.0 = unscaled */
    int64_t step;      /* 1-based count of this update, used for bias correction */
    int adamw_mode;    /* 1: decoupled weight decay (AdamW); 0: L2 added to the grad (Adam) */
    int bias_correction; /* 1: divide by 1 - beta^step; 0: don't */
} zero_fused_adam_config;

/* Update n tensors in place on `stream`.
 *
 *   params, exp_avgs, exp_avg_sqs: n fp32 device buffers of numels[i] elements.
 *   grads: n device buffers of numels[i] elements of `grad_dtype` (ZERO_F32/F16/BF16).
 *   out16: NULL for no copy-out, or n device buffers of numels[i] elements of `out16_dtype`
 *          (ZERO_F16 or ZERO_BF16) that receive the updated params rounded to nearest even;
 *          a NULL entry skips that tensor's copy.
 *
 * Buffers must be contiguous; any alignment works (16-byte aligned ones take the vector path).
 * Returns 0 when every launch was queued, -1 for bad arguments (checked before anything is
 * launched), or a positive cudaError_t from a failed launch. Asynchronous like any launch. */
int zero_fused_adam(int n, float *const *params, const void *const *grads, int32_t grad_dtype,
                    float *const *exp_avgs, float *const *exp_avg_sqs, void *const *out16,
                    int32_t out16_dtype, const int64_t *numels, const zero_fused_adam_config *cfg,
                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif

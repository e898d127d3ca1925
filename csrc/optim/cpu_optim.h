/* CPU Lion and Adagrad steps over a contiguous fp32 master, in one pass each: the host update of
 * optimizer offload for the two element-wise optimizers DeepSpeed also offloads natively.
 *
 * The gradient is read as fp32, bf16 or fp16 and divided by grad_scale first (zero's one divisor:
 * loss scale, ranks, accumulation and clipping; see [Note: one divisor] in zero/stages/adam.py).
 * When out16 is given it receives the updated parameter rounded to bf16 / fp16 (nearest even,
 * common/dtypes.h). The arithmetic is torch's, operation by operation (zero.optimizers.Lion,
 * torch.optim.Adagrad's single-tensor step); the compiler vectorises the loops, so results agree
 * with torch's to fp32 round-off, not bit for bit. Work is split over OpenMP threads in tiles. */
#ifndef ZERO_OPTIM_CPU_OPTIM_H
#define ZERO_OPTIM_CPU_OPTIM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Lion, in place on param and exp_avg (fp32):
 *   g = grad / grad_scale;  param *= 1 - lr * weight_decay;
 *   param -= lr * sign(beta1 * exp_avg + (1 - beta1) * g);  exp_avg = beta2 * exp_avg + (1 - beta2) * g
 * Returns ZERO_OK, or ZERO_BAD_ARGUMENT before anything is written. */
int zero_cpu_lion_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg, void *out16,
                       int32_t out16_dtype, float lr, float beta1, float beta2, float weight_decay, float grad_scale,
                       int num_threads);

/* Adagrad, in place on param and state_sum (fp32), with clr = lr / (1 + (step - 1) * lr_decay):
 *   g = grad / grad_scale (+ weight_decay * param);  state_sum += g * g;
 *   param += -clr * (g / (sqrt(state_sum) + eps))
 * Returns ZERO_OK, or ZERO_BAD_ARGUMENT before anything is written. */
int zero_cpu_adagrad_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *state_sum,
                          void *out16, int32_t out16_dtype, float clr, float eps, float weight_decay, float grad_scale,
                          int num_threads);

#ifdef __cplusplus
}
#endif

#endif

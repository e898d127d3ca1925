/* CPU Adam / AdamW: one optimizer step over a contiguous fp32 master buffer, in one pass.
 *
 * For each element i (all arithmetic in fp32, coefficients prepared in double, see
 * [Note: adam math] in cpu_adam.c):
 *
 *     g  = grad[i] / grad_scale                    grad may be fp32, bf16 or fp16
 *     adamw_mode:  p *= 1 - lr * weight_decay      decoupled decay (torch.optim.AdamW)
 *     else:        g += weight_decay * p           L2 penalty     (torch.optim.Adam)
 *     m  = beta1 * m + (1 - beta1) * g
 *     v  = beta2 * v + (1 - beta2) * g * g
 *     p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
 *     out16[i] = p rounded to bf16 / fp16 (nearest even), when out16 is given
 *
 * with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step (both 1 when bias correction is off).
 *
 * The work is split across OpenMP threads and done with the widest SIMD the CPU has, chosen at
 * run time; the portable scalar path is the reference the others are tested against. */
#ifndef ZERO_ADAM_CPU_ADAM_H
#define ZERO_ADAM_CPU_ADAM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Instruction-set levels, lowest to highest. ZERO_SIMD_BEST asks for the best one available. */
enum {
    ZERO_SIMD_BEST = -1,
    ZERO_SIMD_SCALAR = 0, /* portable C: every CPU */
    ZERO_SIMD_AVX2 = 1,   /* x86-64 with AVX2 + FMA + F16C */
    ZERO_SIMD_AVX512 = 2, /* x86-64 with AVX-512 F + BW */
    ZERO_SIMD_LEVELS = 3
};

/* Return codes. */
enum {
    ZERO_ADAM_OK = 0,
    ZERO_ADAM_BAD_ARGUMENT = -1,   /* a null pointer, n < 0, step < 1, an unknown dtype */
    ZERO_ADAM_SIMD_UNAVAILABLE = -2 /* the forced SIMD level does not run on this CPU / build */
};

/* Hyperparameters of one step. Plain doubles so the host-side coefficients (bias corrections,
 * step size) are computed in double exactly as Python computes them for torch.optim. */
typedef struct {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double grad_scale;   /* the gradient is divided by this first; 1.0 = no scaling */
    int64_t step;        /* 1-based count of this step (already incremented) */
    int adamw_mode;      /* 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam) */
    int bias_correction; /* 1: divide by 1 - beta^step; 0: do not */
} zero_adam_config;

/* One Adam step over n elements, in place on param, exp_avg and exp_avg_sq (fp32).
 * grad has dtype grad_dtype (ZERO_F32, ZERO_BF16 or ZERO_F16). out16 may be NULL; otherwise it
 * receives the updated param in out16_dtype (ZERO_BF16 or ZERO_F16).
 * simd: a ZERO_SIMD_* level, or ZERO_SIMD_BEST. num_threads <= 0 means the OpenMP default.
 * Returns ZERO_ADAM_OK, or a negative code before anything is written. */
int zero_cpu_adam_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg,
                       float *exp_avg_sq, void *out16, int32_t out16_dtype, const zero_adam_config *cfg,
                       int simd, int num_threads);

/* 1 when `level` runs on this CPU and was compiled into this build, else 0. */
int zero_cpu_adam_simd_available(int level);

/* The highest available level. */
int zero_cpu_adam_best_simd(void);

/* "scalar", "avx2", "avx512"; "unknown" for anything else. */
const char *zero_cpu_adam_simd_name(int level);

/* A bandwidth probe with Adam's memory traffic: reads param, grad, exp_avg, exp_avg_sq and writes
 * param, exp_avg, exp_avg_sq (all fp32, 28 bytes per element), with the same threading and tiling
 * as zero_cpu_adam_step but almost no arithmetic (each buffer gets grad added to it). The
 * benchmark uses it as the ceiling an Adam step can reach on this machine. Same return codes. */
int zero_cpu_stream_pass(int64_t n, float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                         int simd, int num_threads);

#ifdef __cplusplus
}
#endif
#endif

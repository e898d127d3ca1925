/* CPU Adam / AdamW: one optimizer step over a contiguous fp32 master buffer, in one pass.
 *
 * For each element: the update of [Note: adam math] (adam/adam_math.h) on param, exp_avg and
 * exp_avg_sq, with the gradient read as fp32, bf16 or fp16; then, when out16 is given,
 * out16[i] = the updated param rounded to bf16 / fp16 (nearest even, common/dtypes.h).
 *
 * The work is split across OpenMP threads and done with the widest SIMD the CPU has, chosen at
 * run time; the portable scalar path is the reference the others are tested against (they give
 * its bits exactly). */
#ifndef ZERO_ADAM_CPU_ADAM_H
#define ZERO_ADAM_CPU_ADAM_H

#include <stdint.h>

#include "adam/adam_math.h" /* zero_adam_config */

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
    ZERO_ADAM_BAD_ARGUMENT = -1,   /* a null pointer, n < 0, an unknown dtype, a config torch refuses */
    ZERO_ADAM_SIMD_UNAVAILABLE = -2 /* the forced SIMD level does not run on this CPU / build */
};

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

/* The OpenMP threads a kernel uses: num_threads when > 0, else OpenMP's default (1 without OpenMP).
   Shared by the CPU kernels that link this file (1-bit pack, block-sparse attention). */
int zero_cpu_thread_count(int num_threads);

/* "scalar", "avx2", "avx512"; "unknown" for anything else. */
const char *zero_cpu_adam_simd_name(int level);

#ifdef __cplusplus
}
#endif
#endif

/* CPU Adam / AdamW: one optimizer step over a contiguous fp32 master buffer, in one pass.
 *
 * For each element: the update of [Note: adam math] (adam/adam_math.h) on param, exp_avg and
 * exp_avg_sq, with the gradient read as fp32, bf16 or fp16; then, when out16 is given,
 * out16[i] = the updated param rounded to bf16 / fp16 (nearest even, common/dtypes.h).
 *
 * The work is split across OpenMP threads and done with the widest SIMD the CPU has, chosen at
 * run time (common/simd.h); the portable scalar path is the reference the others are tested
 * against (they give its bits exactly). */
#ifndef ZERO_ADAM_CPU_ADAM_H
#define ZERO_ADAM_CPU_ADAM_H

#include <stdint.h>

#include "adam/adam_formats.h" /* zero_adam_format, ZERO_Q8 */
#include "adam/adam_math.h"    /* zero_adam_config */
#include "common/simd.h"    /* ZERO_SIMD_* levels, ZERO_OK and the other return codes */

#ifdef __cplusplus
extern "C" {
#endif

/* One Adam step over n elements, in place on param, exp_avg and exp_avg_sq (fp32).
 * grad has dtype grad_dtype (ZERO_F32, ZERO_BF16 or ZERO_F16). out16 may be NULL; otherwise it
 * receives the updated param in out16_dtype (ZERO_BF16 or ZERO_F16).
 * simd: a ZERO_SIMD_* level of common/simd.h, or ZERO_SIMD_BEST. num_threads <= 0 means the
 * OpenMP default. Returns ZERO_OK, or before anything is written ZERO_BAD_ARGUMENT (a null
 * pointer, n < 0, an unknown dtype, a config torch refuses) or ZERO_SIMD_UNAVAILABLE. */
int zero_cpu_adam_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg,
                       float *exp_avg_sq, void *out16, int32_t out16_dtype, const zero_adam_config *cfg,
                       int simd, int num_threads);

/* One Adam step over n elements whose master and moments are stored in the formats `fmt` names
 * (see [Note: state formats] in adam/adam_formats.h): param is fp32 or bf16, exp_avg and
 * exp_avg_sq fp32, bf16 or 8-bit codes (uint8), with m_scale / v_scale holding one fp32 scale per
 * block of ZERO_Q8_BLOCK elements (ceil(n / ZERO_Q8_BLOCK) each; NULL unless 8-bit). out16 as in
 * zero_cpu_adam_step (for a bf16 master: the stored master's bits). Every SIMD level and thread
 * count gives the bits of zero_adam_block_ref. An all-fp32 format is zero_cpu_adam_step itself.
 * Returns ZERO_OK, ZERO_BAD_ARGUMENT (before anything is written) or ZERO_SIMD_UNAVAILABLE. */
int zero_cpu_adam_step_fmt(int64_t n, void *param, const void *grad, int32_t grad_dtype, void *exp_avg,
                           void *exp_avg_sq, float *m_scale, float *v_scale, void *out16, int32_t out16_dtype,
                           const zero_adam_config *cfg, const zero_adam_format *fmt, int simd, int num_threads);

#ifdef __cplusplus
}
#endif
#endif

/* CPU Adam / AdamW step. See cpu_adam.h for the contract and adam/adam_math.h for the math.
 *
 * The op's translation units:
 *   - this file: 1. the portable scalar path, the reference (one zero_adam_element per element);
 *     2. dispatch (the level: common/simd.c) and OpenMP tiling
 *   - adam/cpu_adam_avx2.c (8 lanes) and adam/cpu_adam_avx512.c (16 lanes), x86-64 only: one
 *     body, adam/cpu_adam_body.h (and cpu_adam_formats_body.h), compiled once per width, in
 *     parallel; it performs the operations of [Note: adam math] in its order, with intrinsics,
 *     and gives the scalar bits
 *   - adam/cpu_adam_tiles.h: what they share (the tile size, the tile functions' shape)
 *
 * The 16-bit copy-out rounds to nearest even exactly like common/dtypes.h, bit-identical to
 * torch's `.to()` for every non-NaN value (infinities, overflow to infinity, fp16 subnormals,
 * signed zeros). A NaN is written as the canonical quiet NaN of dtypes.h; torch's own NaN bits
 * differ between its vectorised and scalar casts, so only "NaN stays NaN" is promised there.
 */
#include "adam/cpu_adam.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "adam/cpu_adam_tiles.h"

/* ============================================================================ 1. scalar path */

/* The reference: one element at a time through zero_adam_element. The coefficients are copied
 * into a local first: through the pointer, the compiler would have to reload them after every
 * float store (they could alias). gd and od are constants at each call site. */
static ALWAYS_INLINE void scalar_adam_typed(TILE_PARAMS) {
    const zero_adam_coeffs k = *c;
    for (int64_t i = 0; i < n; i++) {
        float pi = p[i], mi = m[i], vi = v[i];
        zero_adam_element(&pi, &mi, &vi, zero_load_f32(g, gd, i), &k);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (od != ZERO_F32) zero_store_f32(out, od, i, pi);
    }
}

static void adam_tile_scalar(TILE_PARAMS) { DISPATCH_DTYPES(scalar_adam_typed) }

/* A tile of the low-precision formats (adam/adam_formats.h): n elements from element `at` of the
 * buffers (a multiple of ZERO_Q8_BLOCK, so a tile holds whole blocks; only the last one of a
 * buffer may be partial). ms / vs: the 8-bit blocks' scales, indexed by block from element 0. */
static void adam_fmt_tile_scalar(FMT_TILE_PARAMS) {
    const int q8 = f->state_dtype == ZERO_Q8;
    for (int64_t b0 = 0; b0 < n; b0 += ZERO_Q8_BLOCK) {
        const int64_t blk = (at + b0) / ZERO_Q8_BLOCK;
        zero_adam_block_ref(n - b0 < ZERO_Q8_BLOCK ? n - b0 : ZERO_Q8_BLOCK, at + b0, p, g, gd, m, v,
                            q8 ? ms + blk : NULL, q8 ? vs + blk : NULL, out, od, c, f, key);
    }
}

/* ============================================================================ 2. dispatch */

typedef void (*adam_tile_fn)(TILE_PARAMS);

static adam_tile_fn adam_tile_for(int level) {
#if ZERO_HAVE_X86_SIMD
    if (level == ZERO_SIMD_AVX512) return adam_tile_avx512;
    if (level == ZERO_SIMD_AVX2) return adam_tile_avx2;
#endif
    (void)level;
    return adam_tile_scalar;
}

/* The checks both entry points make before anything is written: ZERO_OK and *level set, 1 for
 * "nothing to do" (n == 0), or an error code. */
static int check_step(int64_t n, const void *param, const void *grad, int32_t grad_dtype, const void *exp_avg,
                      const void *exp_avg_sq, const void *out16, int32_t out16_dtype, const zero_adam_config *cfg,
                      int simd, int *level) {
    if (n < 0 || !zero_adam_config_ok(cfg)) return ZERO_BAD_ARGUMENT;
    if (grad_dtype != ZERO_F32 && grad_dtype != ZERO_BF16 && grad_dtype != ZERO_F16) return ZERO_BAD_ARGUMENT;
    if (out16 != NULL && out16_dtype != ZERO_BF16 && out16_dtype != ZERO_F16) return ZERO_BAD_ARGUMENT;
    *level = zero_simd_resolve(simd);
    if (*level < 0) return *level;
    if (n == 0) return 1;
    if (param == NULL || grad == NULL || exp_avg == NULL || exp_avg_sq == NULL) return ZERO_BAD_ARGUMENT;
    return ZERO_OK;
}

int zero_cpu_adam_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg,
                       float *exp_avg_sq, void *out16, int32_t out16_dtype, const zero_adam_config *cfg,
                       int simd, int num_threads) {
    int level;
    const int rc = check_step(n, param, grad, grad_dtype, exp_avg, exp_avg_sq, out16, out16_dtype, cfg, simd, &level);
    if (rc != ZERO_OK) return rc == 1 ? ZERO_OK : rc;

    const zero_adam_coeffs c = zero_adam_coeffs_of(cfg);
    const adam_tile_fn tile = adam_tile_for(level);
    const int64_t ntiles = (n + TILE - 1) / TILE;
    const size_t gsz = (size_t)zero_dtype_size(grad_dtype);
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ntiles > 1 && threads > 1)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t b = t * TILE;
        const int64_t cnt = n - b < TILE ? n - b : TILE;
        tile(cnt, param + b, (const char *)grad + (size_t)b * gsz, grad_dtype, exp_avg + b, exp_avg_sq + b,
             out16 ? (void *)((uint16_t *)out16 + b) : NULL, out16_dtype, &c);
    }
    return ZERO_OK;
}

typedef void (*adam_fmt_tile_fn)(FMT_TILE_PARAMS);

static adam_fmt_tile_fn adam_fmt_tile_for(int level) {
#if ZERO_HAVE_X86_SIMD
    if (level == ZERO_SIMD_AVX512) return adam_fmt_tile_avx512;
    if (level == ZERO_SIMD_AVX2) return adam_fmt_tile_avx2;
#endif
    (void)level;
    return adam_fmt_tile_scalar;
}

int zero_cpu_adam_step_fmt(int64_t n, void *param, const void *grad, int32_t grad_dtype, void *exp_avg,
                           void *exp_avg_sq, float *m_scale, float *v_scale, void *out16, int32_t out16_dtype,
                           const zero_adam_config *cfg, const zero_adam_format *fmt, int simd, int num_threads) {
    if (fmt == NULL) return ZERO_BAD_ARGUMENT;
    const int pd = fmt->master_dtype, sd = fmt->state_dtype;
    if (pd != ZERO_F32 && pd != ZERO_BF16) return ZERO_BAD_ARGUMENT;
    if (sd != ZERO_F32 && sd != ZERO_BF16 && sd != ZERO_Q8) return ZERO_BAD_ARGUMENT;
    if (pd == ZERO_F32 && sd == ZERO_F32)
        return zero_cpu_adam_step(n, (float *)param, grad, grad_dtype, (float *)exp_avg, (float *)exp_avg_sq, out16,
                                  out16_dtype, cfg, simd, num_threads);
    int level;
    const int rc = check_step(n, param, grad, grad_dtype, exp_avg, exp_avg_sq, out16, out16_dtype, cfg, simd, &level);
    if (rc != ZERO_OK) return rc == 1 ? ZERO_OK : rc;
    if (sd == ZERO_Q8 && (m_scale == NULL || v_scale == NULL)) return ZERO_BAD_ARGUMENT;

    const zero_adam_coeffs c = zero_adam_coeffs_of(cfg);
    const zero_sr_key key = zero_sr_key_of(fmt->seed, cfg->step);
    const adam_fmt_tile_fn tile = adam_fmt_tile_for(level);
    const int64_t ntiles = (n + TILE - 1) / TILE;
    const int od = out16 == NULL ? ZERO_F32 : out16_dtype;
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ntiles > 1 && threads > 1)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t b = t * TILE;
        tile(n - b < TILE ? n - b : TILE, b, param, grad, grad_dtype, exp_avg, exp_avg_sq, m_scale, v_scale, out16,
             od, &c, fmt, &key);
    }
    return ZERO_OK;
}

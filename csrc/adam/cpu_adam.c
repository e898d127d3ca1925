/* CPU Adam / AdamW step. See cpu_adam.h for the contract and adam/adam_math.h for the math.
 *
 * Layout of this file:
 *   1. the portable scalar path: the reference, one zero_adam_element per element
 *   2. the AVX2 path (8 lanes) and the AVX-512 path (16 lanes), x86-64 only: one body,
 *      adam/cpu_adam_body.h, compiled once per width; it performs the operations of
 *      [Note: adam math] in its order, with intrinsics, and gives the scalar bits
 *   3. dispatch (the level: common/simd.c) and OpenMP tiling
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

#include "adam/adam_formats.h"
#include "adam/adam_math.h"
#include "common/dtypes.h"
#include "common/simd.h"

/* Work is handed to threads in tiles of TILE elements. One tile of param, grad, exp_avg and
 * exp_avg_sq is 16K x 16 bytes = 256 KB: it stays in a core's L2 while it is read and written
 * back, each of its four streams is 64 KB long (plenty for the hardware prefetchers), and one
 * tile is ~10 us of work, so handing tiles out dynamically costs nothing measurable. Dynamic
 * rather than static scheduling matters on a busy host: when another process takes a core away
 * from one of our threads, the others take over its remaining tiles instead of waiting for it at
 * the end of the loop. TILE is a multiple of every vector width, so only the last tile of a
 * buffer has a partial vector at its end. */
enum { TILE = 1 << 14 };

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Every path updates a tile through a function of this shape; od == ZERO_F32 means "no copy-out". */
#define TILE_PARAMS \
    int64_t n, float *p, const void *g, int gd, float *m, float *v, void *out, int od, const zero_adam_coeffs *c

/* Inside a tile function: call TYPED(n, p, g, GD, m, v, out, OD, c) with the grad dtype GD and the
 * copy-out dtype OD as constants, one instantiation per pair, so the always-inlined TYPED has no
 * dtype switch left in its inner loop. */
#define DISPATCH_OUT(TYPED, GD)                           \
    if (out == NULL)                                      \
        TYPED(n, p, g, GD, m, v, NULL, ZERO_F32, c);      \
    else if (od == ZERO_BF16)                             \
        TYPED(n, p, g, GD, m, v, out, ZERO_BF16, c);      \
    else                                                  \
        TYPED(n, p, g, GD, m, v, out, ZERO_F16, c);
#define DISPATCH_DTYPES(TYPED)        \
    if (gd == ZERO_F32) {             \
        DISPATCH_OUT(TYPED, ZERO_F32)  \
    } else if (gd == ZERO_BF16) {     \
        DISPATCH_OUT(TYPED, ZERO_BF16) \
    } else {                          \
        DISPATCH_OUT(TYPED, ZERO_F16)  \
    }

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
#define FMT_TILE_PARAMS                                                                                      \
    int64_t n, int64_t at, void *p, const void *g, int gd, void *m, void *v, float *ms, float *vs, void *out, \
        int od, const zero_adam_coeffs *c, const zero_adam_format *f, const zero_sr_key *key

static void adam_fmt_tile_scalar(FMT_TILE_PARAMS) {
    const int q8 = f->state_dtype == ZERO_Q8;
    for (int64_t b0 = 0; b0 < n; b0 += ZERO_Q8_BLOCK) {
        const int64_t blk = (at + b0) / ZERO_Q8_BLOCK;
        zero_adam_block_ref(n - b0 < ZERO_Q8_BLOCK ? n - b0 : ZERO_Q8_BLOCK, at + b0, p, g, gd, m, v,
                            q8 ? ms + blk : NULL, q8 ? vs + blk : NULL, out, od, c, f, key);
    }
}

#if ZERO_HAVE_X86_SIMD
/* ============================================================================ 2. SIMD paths
 *
 * adam/cpu_adam_body.h, once per width (see [Note: one body per vector width] in
 * common/simd_width.h); below, what both widths share. */
#include "common/simd_width.h"

/* [Note: streaming stores]
 * param, exp_avg and exp_avg_sq are read and written back in the same pass, so their cache lines
 * are already present when written: ordinary stores are right for them (streaming stores measured
 * ~15% slower on them). The 16-bit copy-out is write-only: an ordinary store would first read
 * each destination line into the cache (2 more bytes per element of traffic), so it is written
 * with non-temporal stores when aligned, which skip that read (~5% faster end to end). */

/* Finish an fp16 copy-out whose vector conversion met a NaN: the hardware keeps NaN payloads,
 * torch and dtypes.h write a canonical quiet NaN. Rare, so done element by element. */
static void fix_f16_nans(uint16_t *out, const float *x, int w) {
    for (int k = 0; k < w; k++)
        if (x[k] != x[k]) out[k] = zero_f32_to_f16(x[k]);
}

/* The partial last vector of a tile (rest < W <= 16 elements), zero-padded to a full vector. */
typedef struct {
    float p[16], m[16], v[16];
    uint16_t out[16];
    _Alignas(64) unsigned char g[64];
} partial_vec;

static void partial_in(partial_vec *t, int64_t rest, const float *p, const void *g, int gd, const float *m,
                       const float *v) {
    memset(t, 0, sizeof *t);
    memcpy(t->p, p, (size_t)rest * 4);
    memcpy(t->m, m, (size_t)rest * 4);
    memcpy(t->v, v, (size_t)rest * 4);
    memcpy(t->g, g, (size_t)rest * (size_t)zero_dtype_size(gd));
}

static void partial_out(const partial_vec *t, int64_t rest, float *p, float *m, float *v, uint16_t *out) {
    memcpy(p, t->p, (size_t)rest * 4);
    memcpy(m, t->m, (size_t)rest * 4);
    memcpy(v, t->v, (size_t)rest * 4);
    if (out != NULL) memcpy(out, t->out, (size_t)rest * 2);
}

#define ZV_BITS 256
#include "adam/cpu_adam_body.h"         /* adam_tile_avx2 */
#include "adam/cpu_adam_formats_body.h" /* adam_fmt_tile_avx2 */
#undef ZV_BITS
#define ZV_BITS 512
#include "adam/cpu_adam_body.h"         /* adam_tile_avx512 */
#include "adam/cpu_adam_formats_body.h" /* adam_fmt_tile_avx512 */
#undef ZV_BITS
#endif /* ZERO_HAVE_X86_SIMD */

/* ============================================================================ 3. dispatch */

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

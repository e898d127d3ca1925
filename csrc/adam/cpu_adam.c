/* CPU Adam / AdamW step. See cpu_adam.h for the contract.
 *
 * Layout of this file:
 *   1. coefficients: the per-step constants, computed once in double on the host side
 *   2. the portable scalar path: the reference the SIMD paths are tested against
 *   3. the AVX2 path (8 lanes) and the AVX-512 path (16 lanes), x86-64 only
 *   4. run-time dispatch and OpenMP tiling
 *   5. the stream pass used by the benchmark as a bandwidth ceiling
 *
 * [Note: adam math]
 * The per-element formulas follow torch.optim.Adam's single-tensor implementation operation by
 * operation, so results agree with torch to fp32 round-off:
 *     AdamW:  p = p * (1 - lr*wd)           torch: param.mul_(1 - lr * weight_decay)
 *     Adam:   g = g + wd * p                torch: grad.add(param, alpha=weight_decay)
 *             m = m + (1-beta1) * (g - m)   torch: exp_avg.lerp_(grad, 1 - beta1)
 *             v = v*beta2 + (1-beta2)*g*g   torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, ...)
 *             d = sqrt(v) / sqrt(bc2) + eps
 *             p = p + (-lr/bc1) * m / d     torch: param.addcdiv_(exp_avg, denom, value=-step_size)
 * Python evaluates lr/bc1, sqrt(bc2) and 1 - lr*wd in double and torch rounds each to fp32 once
 * when it is used as a tensor scalar; `make_coeffs` does the same.
 *
 * The SIMD paths differ from that order in two ways, each worth the last bit or two, never more
 * than round-off: they use fused multiply-adds (the lerp, as torch's own vectorised lerp does, the
 * v update and the L2 term), and they multiply sqrt(v) by 1/sqrt(bc2) (computed in double)
 * instead of dividing by sqrt(bc2). The second is for speed: a 16-lane division costs about as
 * much as a 16-lane square root. With two divisions and a square root per vector, the loop's
 * arithmetic on a 2-core AVX-512 host took 0.41 ns per element per thread (in cache), about 70%
 * of the ~0.6 ns its 28 bytes take per thread at full memory bandwidth: too close to hide behind
 * the memory traffic, and the step measured up to ~12% slower than torch's fused AdamW at 100M
 * parameters. With one division it takes 0.33 ns and the two run level.
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

#include "common/dtypes.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* The SIMD paths need x86 and GCC/Clang target attributes; elsewhere (ARM, MSVC) only the scalar
 * path is compiled. -DZERO_NO_X86_SIMD builds the scalar-only variant on x86 too. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ZERO_NO_X86_SIMD)
#define ZERO_HAVE_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define ZERO_HAVE_X86_SIMD 0
#endif

/* Work is handed to threads in tiles of TILE elements. One tile of param, grad, exp_avg and
 * exp_avg_sq is 16K x 16 bytes = 256 KB: it stays in a core's L2 while it is read and written
 * back, each of its four streams is 64 KB long (plenty for the hardware prefetchers), and one
 * tile is ~10 us of work, so handing tiles out dynamically costs nothing measurable. Dynamic
 * rather than static scheduling matters on a busy host: when another process takes a core away
 * from one of our threads, the others take over its remaining tiles instead of waiting for it at
 * the end of the loop. TILE is a multiple of every vector width, so only the last tile of a
 * buffer has a partial vector at its end. */
enum { TILE = 1 << 14 };

/* ============================================================================ 1. coefficients */

typedef struct {
    int scale_grad;      /* divide the gradient by grad_scale (skipped when it is exactly 1) */
    int adamw;           /* decoupled decay (multiply p by decay) or L2 (add l2 * p to g) */
    float grad_scale;
    float decay;         /* 1 - lr*wd in AdamW mode, else 1 */
    float l2;            /* wd in Adam mode, else 0 */
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float neg_step_size; /* -lr / bc1 */
    float bc2_sqrt;      /* sqrt(bc2) */
    float inv_bc2_sqrt;  /* 1 / sqrt(bc2), for the SIMD paths (see [Note: adam math]) */
    float eps;
} coeffs;

static coeffs make_coeffs(const zero_adam_config *cfg) {
    coeffs c;
    double bc1 = 1.0, bc2 = 1.0;
    if (cfg->bias_correction) {
        bc1 = 1.0 - pow(cfg->beta1, (double)cfg->step);
        bc2 = 1.0 - pow(cfg->beta2, (double)cfg->step);
    }
    c.scale_grad = cfg->grad_scale != 1.0;
    c.adamw = cfg->adamw_mode != 0;
    c.grad_scale = (float)cfg->grad_scale;
    c.decay = c.adamw ? (float)(1.0 - cfg->lr * cfg->weight_decay) : 1.0f;
    c.l2 = c.adamw ? 0.0f : (float)cfg->weight_decay;
    c.beta2 = (float)cfg->beta2;
    c.one_minus_beta1 = (float)(1.0 - cfg->beta1);
    c.one_minus_beta2 = (float)(1.0 - cfg->beta2);
    c.neg_step_size = (float)(-(cfg->lr / bc1));
    c.bc2_sqrt = (float)sqrt(bc2);
    c.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
    c.eps = (float)cfg->eps;
    return c;
}

/* ============================================================================ 2. scalar path */

/* The reference: one element at a time, in the operation order of [Note: adam math].
 * The coefficients are copied into locals first: through the pointer, the compiler would have to
 * reload them after every float store (they could alias). gd, od and adamw are constants at each
 * call site in adam_tile_scalar, so the loop body has no branches on them. (It stays scalar:
 * sqrtf's errno path, kept by the -std=c11 build, stops the compiler from vectorising it.) */
static inline __attribute__((always_inline)) void scalar_adam_typed(int64_t n, float *p, const void *g, int gd,
                                                                   float *m, float *v, void *out, int od,
                                                                   int adamw, const coeffs *cp) {
    const coeffs c = *cp;
    for (int64_t i = 0; i < n; i++) {
        float grad = zero_load_f32(g, gd, i);
        if (c.scale_grad) grad = grad / c.grad_scale;
        float param = p[i];
        if (adamw)
            param = param * c.decay;
        else
            grad = grad + c.l2 * param;
        float mi = m[i] + c.one_minus_beta1 * (grad - m[i]);
        float vi = v[i] * c.beta2 + c.one_minus_beta2 * grad * grad;
        float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
        param = param + c.neg_step_size * mi / denom;
        p[i] = param;
        m[i] = mi;
        v[i] = vi;
        if (od != ZERO_F32) zero_store_f32(out, od, i, param);
    }
}

static void adam_tile_scalar(int64_t n, float *p, const void *g, int gd, float *m, float *v, void *out,
                             int od, const coeffs *c) {
    /* one instantiation per (grad dtype, copy-out dtype, decay mode); ZERO_F32 out = no copy-out */
#define ZERO_SCALAR_MODE(GD, OD)                                             \
    if (c->adamw)                                                            \
        scalar_adam_typed(n, p, g, GD, m, v, out, OD, 1, c);                 \
    else                                                                     \
        scalar_adam_typed(n, p, g, GD, m, v, out, OD, 0, c);
#define ZERO_SCALAR_CASE(GD)                                                 \
    if (out == NULL) {                                                       \
        ZERO_SCALAR_MODE(GD, ZERO_F32)                                       \
    } else if (od == ZERO_BF16) {                                            \
        ZERO_SCALAR_MODE(GD, ZERO_BF16)                                      \
    } else {                                                                 \
        ZERO_SCALAR_MODE(GD, ZERO_F16)                                       \
    }
    if (gd == ZERO_F32) {
        ZERO_SCALAR_CASE(ZERO_F32)
    } else if (gd == ZERO_BF16) {
        ZERO_SCALAR_CASE(ZERO_BF16)
    } else {
        ZERO_SCALAR_CASE(ZERO_F16)
    }
#undef ZERO_SCALAR_CASE
#undef ZERO_SCALAR_MODE
}

static void stream_tile_scalar(int64_t n, float *p, const float *g, float *m, float *v) {
    for (int64_t i = 0; i < n; i++) {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
}

#if ZERO_HAVE_X86_SIMD
/* ============================================================================ 3. SIMD paths
 *
 * Each path has a vector body that updates exactly one vector of W elements at index i. A tile
 * runs the body over its full vectors; its last partial vector (at most W-1 elements, only in
 * the last tile of a buffer) is copied into small local buffers, run through the same body and
 * copied back, so every element of a buffer goes through the same arithmetic.
 *
 * The bodies are written once per (grad dtype, out dtype) pair through always-inlined helpers
 * whose dtype arguments are compile-time constants at each call site, so the dtype switches
 * vanish from the inner loops. */

#define ALWAYS_INLINE inline __attribute__((always_inline))

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

/* ---------------------------------------------------------------------------- AVX2 + FMA + F16C */
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

/* 8 gradient elements of dtype gd, widened to fp32. bf16 -> fp32 is a 16-bit left shift. */
TARGET_AVX2 static ALWAYS_INLINE __m256 avx2_load(const void *g, int gd, int64_t i) {
    if (gd == ZERO_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    if (gd == ZERO_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Round 8 fp32 values to bf16/fp16 (nearest even) and store them; `nt`: with a non-temporal
 * store (o must then be 16-byte aligned). See [Note: streaming stores]. */
TARGET_AVX2 static ALWAYS_INLINE void avx2_put16(uint16_t *o, __m128i h, int nt) {
    if (nt)
        _mm_stream_si128((__m128i *)o, h);
    else
        _mm_storeu_si128((__m128i *)o, h);
}

TARGET_AVX2 static ALWAYS_INLINE void avx2_store16(void *out, int od, int64_t i, __m256 x, int nt) {
    uint16_t *o = (uint16_t *)out + i;
    if (od == ZERO_BF16) {
        /* bits + 0x7fff + (bit 16 of bits), then keep the top half; NaN -> 0x7fc0 */
        __m256i u = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
        /* narrow 8 x 32-bit (each < 2^16) to 8 x 16-bit: pack within lanes, then join lanes */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        avx2_put16(o, _mm256_castsi256_si128(packed), nt);
    } else {
        avx2_put16(o, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nt);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
            float tmp[8];
            _mm256_storeu_ps(tmp, x);
            fix_f16_nans(o, tmp, 8);
        }
    }
}

typedef struct {
    __m256 grad_scale, decay, l2, beta2, one_minus_beta1, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps;
} avx2_coeffs;

TARGET_AVX2 static ALWAYS_INLINE void avx2_adam_vec(float *p, const void *g, int gd, float *m, float *v,
                                                    void *out, int od, int nt, int64_t i, const coeffs *c,
                                                    const avx2_coeffs *k) {
    __m256 grad = avx2_load(g, gd, i);
    if (c->scale_grad) grad = _mm256_div_ps(grad, k->grad_scale);
    __m256 param = _mm256_loadu_ps(p + i);
    if (c->adamw)
        param = _mm256_mul_ps(param, k->decay);
    else
        grad = _mm256_fmadd_ps(k->l2, param, grad);
    __m256 mi = _mm256_loadu_ps(m + i);
    mi = _mm256_fmadd_ps(k->one_minus_beta1, _mm256_sub_ps(grad, mi), mi);
    __m256 vi = _mm256_mul_ps(_mm256_loadu_ps(v + i), k->beta2);
    vi = _mm256_fmadd_ps(_mm256_mul_ps(k->one_minus_beta2, grad), grad, vi);
    __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), k->inv_bc2_sqrt, k->eps);
    param = _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(k->neg_step_size, mi), denom));
    _mm256_storeu_ps(p + i, param);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if (od != ZERO_F32) avx2_store16(out, od, i, param, nt);
}

/* od == ZERO_F32 here means "no copy-out". */
TARGET_AVX2 static ALWAYS_INLINE void avx2_adam_tile_typed(int64_t n, float *p, const void *g, int gd, float *m,
                                                           float *v, void *out, int od, const coeffs *c) {
    const avx2_coeffs k = {
        _mm256_set1_ps(c->grad_scale),      _mm256_set1_ps(c->decay),
        _mm256_set1_ps(c->l2),              _mm256_set1_ps(c->beta2),
        _mm256_set1_ps(c->one_minus_beta1), _mm256_set1_ps(c->one_minus_beta2),
        _mm256_set1_ps(c->neg_step_size),   _mm256_set1_ps(c->inv_bc2_sqrt),
        _mm256_set1_ps(c->eps),
    };
    const int64_t full = n - n % 8;
    const int nt = od != ZERO_F32 && ((uintptr_t)out % 16) == 0;
    for (int64_t i = 0; i < full; i += 8) avx2_adam_vec(p, g, gd, m, v, out, od, nt, i, c, &k);
    if (nt) _mm_sfence(); /* make the streamed copy-out visible before the tile is reported done */
    if (full == n) return;

    /* partial last vector: through zero-padded local copies */
    const int64_t rest = n - full;
    const size_t gsz = (size_t)zero_dtype_size(gd);
    float tp[8] = {0}, tm[8] = {0}, tv[8] = {0};
    uint16_t to[8] = {0};
    _Alignas(32) unsigned char tg[32] = {0};
    memcpy(tp, p + full, (size_t)rest * 4);
    memcpy(tm, m + full, (size_t)rest * 4);
    memcpy(tv, v + full, (size_t)rest * 4);
    memcpy(tg, (const char *)g + (size_t)full * gsz, (size_t)rest * gsz);
    avx2_adam_vec(tp, tg, gd, tm, tv, to, od, 0, 0, c, &k);
    memcpy(p + full, tp, (size_t)rest * 4);
    memcpy(m + full, tm, (size_t)rest * 4);
    memcpy(v + full, tv, (size_t)rest * 4);
    if (od != ZERO_F32) memcpy((uint16_t *)out + full, to, (size_t)rest * 2);
}

TARGET_AVX2 static void adam_tile_avx2(int64_t n, float *p, const void *g, int gd, float *m, float *v, void *out,
                                       int od, const coeffs *c) {
    /* one instantiation per (grad dtype, copy-out dtype) pair */
#define ZERO_AVX2_CASE(GD)                                                                  \
    if (out == NULL)                                                                        \
        avx2_adam_tile_typed(n, p, g, GD, m, v, NULL, ZERO_F32, c);                         \
    else if (od == ZERO_BF16)                                                               \
        avx2_adam_tile_typed(n, p, g, GD, m, v, out, ZERO_BF16, c);                         \
    else                                                                                    \
        avx2_adam_tile_typed(n, p, g, GD, m, v, out, ZERO_F16, c);
    if (gd == ZERO_F32) {
        ZERO_AVX2_CASE(ZERO_F32)
    } else if (gd == ZERO_BF16) {
        ZERO_AVX2_CASE(ZERO_BF16)
    } else {
        ZERO_AVX2_CASE(ZERO_F16)
    }
#undef ZERO_AVX2_CASE
}

TARGET_AVX2 static void stream_tile_avx2(int64_t n, float *p, const float *g, float *m, float *v) {
    const int64_t full = n - n % 8;
    for (int64_t i = 0; i < full; i += 8) {
        __m256 gi = _mm256_loadu_ps(g + i);
        _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), gi));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
    }
    stream_tile_scalar(n - full, p + full, g + full, m + full, v + full);
}

/* ---------------------------------------------------------------------------- AVX-512 F + BW */
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

/* 16 gradient elements of dtype gd, widened to fp32. */
TARGET_AVX512 static ALWAYS_INLINE __m512 avx512_load(const void *g, int gd, int64_t i) {
    if (gd == ZERO_F32) return _mm512_loadu_ps((const float *)g + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    if (gd == ZERO_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Round 16 fp32 values to bf16/fp16 (nearest even) and store them; `nt`: with a non-temporal
 * store (o must then be 32-byte aligned). See [Note: streaming stores]. */
TARGET_AVX512 static ALWAYS_INLINE void avx512_put16(uint16_t *o, __m256i h, int nt) {
    if (nt)
        _mm256_stream_si256((__m256i *)o, h);
    else
        _mm256_storeu_si256((__m256i *)o, h);
}

TARGET_AVX512 static ALWAYS_INLINE void avx512_store16(void *out, int od, int64_t i, __m512 x, int nt) {
    uint16_t *o = (uint16_t *)out + i;
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (od == ZERO_BF16) {
        /* same rounding as the AVX2 path; vpmovdw narrows 32 -> 16 bits in one instruction */
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
        avx512_put16(o, _mm512_cvtepi32_epi16(r), nt);
    } else {
        avx512_put16(o, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nt);
        if (nan) {
            float tmp[16];
            _mm512_storeu_ps(tmp, x);
            fix_f16_nans(o, tmp, 16);
        }
    }
}

typedef struct {
    __m512 grad_scale, decay, l2, beta2, one_minus_beta1, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps;
} avx512_coeffs;

TARGET_AVX512 static ALWAYS_INLINE void avx512_adam_vec(float *p, const void *g, int gd, float *m, float *v,
                                                        void *out, int od, int nt, int64_t i, const coeffs *c,
                                                        const avx512_coeffs *k) {
    __m512 grad = avx512_load(g, gd, i);
    if (c->scale_grad) grad = _mm512_div_ps(grad, k->grad_scale);
    __m512 param = _mm512_loadu_ps(p + i);
    if (c->adamw)
        param = _mm512_mul_ps(param, k->decay);
    else
        grad = _mm512_fmadd_ps(k->l2, param, grad);
    __m512 mi = _mm512_loadu_ps(m + i);
    mi = _mm512_fmadd_ps(k->one_minus_beta1, _mm512_sub_ps(grad, mi), mi);
    __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i), k->beta2);
    vi = _mm512_fmadd_ps(_mm512_mul_ps(k->one_minus_beta2, grad), grad, vi);
    __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), k->inv_bc2_sqrt, k->eps);
    param = _mm512_add_ps(param, _mm512_div_ps(_mm512_mul_ps(k->neg_step_size, mi), denom));
    _mm512_storeu_ps(p + i, param);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if (od != ZERO_F32) avx512_store16(out, od, i, param, nt);
}

TARGET_AVX512 static ALWAYS_INLINE void avx512_adam_tile_typed(int64_t n, float *p, const void *g, int gd,
                                                               float *m, float *v, void *out, int od,
                                                               const coeffs *c) {
    const avx512_coeffs k = {
        _mm512_set1_ps(c->grad_scale),      _mm512_set1_ps(c->decay),
        _mm512_set1_ps(c->l2),              _mm512_set1_ps(c->beta2),
        _mm512_set1_ps(c->one_minus_beta1), _mm512_set1_ps(c->one_minus_beta2),
        _mm512_set1_ps(c->neg_step_size),   _mm512_set1_ps(c->inv_bc2_sqrt),
        _mm512_set1_ps(c->eps),
    };
    const int64_t full = n - n % 16;
    const int nt = od != ZERO_F32 && ((uintptr_t)out % 32) == 0;
    for (int64_t i = 0; i < full; i += 16) avx512_adam_vec(p, g, gd, m, v, out, od, nt, i, c, &k);
    if (nt) _mm_sfence();
    if (full == n) return;

    const int64_t rest = n - full;
    const size_t gsz = (size_t)zero_dtype_size(gd);
    float tp[16] = {0}, tm[16] = {0}, tv[16] = {0};
    uint16_t to[16] = {0};
    _Alignas(64) unsigned char tg[64] = {0};
    memcpy(tp, p + full, (size_t)rest * 4);
    memcpy(tm, m + full, (size_t)rest * 4);
    memcpy(tv, v + full, (size_t)rest * 4);
    memcpy(tg, (const char *)g + (size_t)full * gsz, (size_t)rest * gsz);
    avx512_adam_vec(tp, tg, gd, tm, tv, to, od, 0, 0, c, &k);
    memcpy(p + full, tp, (size_t)rest * 4);
    memcpy(m + full, tm, (size_t)rest * 4);
    memcpy(v + full, tv, (size_t)rest * 4);
    if (od != ZERO_F32) memcpy((uint16_t *)out + full, to, (size_t)rest * 2);
}

TARGET_AVX512 static void adam_tile_avx512(int64_t n, float *p, const void *g, int gd, float *m, float *v,
                                           void *out, int od, const coeffs *c) {
#define ZERO_AVX512_CASE(GD)                                                                \
    if (out == NULL)                                                                        \
        avx512_adam_tile_typed(n, p, g, GD, m, v, NULL, ZERO_F32, c);                       \
    else if (od == ZERO_BF16)                                                               \
        avx512_adam_tile_typed(n, p, g, GD, m, v, out, ZERO_BF16, c);                       \
    else                                                                                    \
        avx512_adam_tile_typed(n, p, g, GD, m, v, out, ZERO_F16, c);
    if (gd == ZERO_F32) {
        ZERO_AVX512_CASE(ZERO_F32)
    } else if (gd == ZERO_BF16) {
        ZERO_AVX512_CASE(ZERO_BF16)
    } else {
        ZERO_AVX512_CASE(ZERO_F16)
    }
#undef ZERO_AVX512_CASE
}

TARGET_AVX512 static void stream_tile_avx512(int64_t n, float *p, const float *g, float *m, float *v) {
    const int64_t full = n - n % 16;
    for (int64_t i = 0; i < full; i += 16) {
        __m512 gi = _mm512_loadu_ps(g + i);
        _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gi));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
        _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
    }
    stream_tile_scalar(n - full, p + full, g + full, m + full, v + full);
}
#endif /* ZERO_HAVE_X86_SIMD */

/* ============================================================================ 4. dispatch */

int zero_cpu_adam_simd_available(int level) {
    if (level == ZERO_SIMD_SCALAR) return 1;
#if ZERO_HAVE_X86_SIMD
    __builtin_cpu_init();
    if (level == ZERO_SIMD_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (level == ZERO_SIMD_AVX2) {
        /* F16C is CPUID leaf 1, ECX bit 29; read directly as not every compiler names it */
        unsigned a, b, c, d;
        int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
#endif
    return 0;
}

int zero_cpu_adam_best_simd(void) {
    for (int level = ZERO_SIMD_LEVELS - 1; level > ZERO_SIMD_SCALAR; level--)
        if (zero_cpu_adam_simd_available(level)) return level;
    return ZERO_SIMD_SCALAR;
}

const char *zero_cpu_adam_simd_name(int level) {
    switch (level) {
    case ZERO_SIMD_SCALAR: return "scalar";
    case ZERO_SIMD_AVX2: return "avx2";
    case ZERO_SIMD_AVX512: return "avx512";
    default: return "unknown";
    }
}

/* Resolve ZERO_SIMD_BEST and check a forced level; negative on failure. */
static int resolve_simd(int simd) {
    if (simd == ZERO_SIMD_BEST) return zero_cpu_adam_best_simd();
    if (simd < ZERO_SIMD_SCALAR || simd >= ZERO_SIMD_LEVELS || !zero_cpu_adam_simd_available(simd))
        return ZERO_ADAM_SIMD_UNAVAILABLE;
    return simd;
}

static int thread_count(int num_threads) {
#ifdef _OPENMP
    return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
    (void)num_threads;
    return 1;
#endif
}

typedef void (*adam_tile_fn)(int64_t, float *, const void *, int, float *, float *, void *, int, const coeffs *);
typedef void (*stream_tile_fn)(int64_t, float *, const float *, float *, float *);

static adam_tile_fn adam_tile_for(int level) {
#if ZERO_HAVE_X86_SIMD
    if (level == ZERO_SIMD_AVX512) return adam_tile_avx512;
    if (level == ZERO_SIMD_AVX2) return adam_tile_avx2;
#endif
    (void)level;
    return adam_tile_scalar;
}

static stream_tile_fn stream_tile_for(int level) {
#if ZERO_HAVE_X86_SIMD
    if (level == ZERO_SIMD_AVX512) return stream_tile_avx512;
    if (level == ZERO_SIMD_AVX2) return stream_tile_avx2;
#endif
    (void)level;
    return stream_tile_scalar;
}

int zero_cpu_adam_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg,
                       float *exp_avg_sq, void *out16, int32_t out16_dtype, const zero_adam_config *cfg,
                       int simd, int num_threads) {
    if (n < 0 || cfg == NULL || cfg->step < 1) return ZERO_ADAM_BAD_ARGUMENT;
    if (grad_dtype != ZERO_F32 && grad_dtype != ZERO_BF16 && grad_dtype != ZERO_F16) return ZERO_ADAM_BAD_ARGUMENT;
    if (out16 != NULL && out16_dtype != ZERO_BF16 && out16_dtype != ZERO_F16) return ZERO_ADAM_BAD_ARGUMENT;
    const int level = resolve_simd(simd);
    if (level < 0) return level;
    if (n == 0) return ZERO_ADAM_OK;
    if (param == NULL || grad == NULL || exp_avg == NULL || exp_avg_sq == NULL) return ZERO_ADAM_BAD_ARGUMENT;

    const coeffs c = make_coeffs(cfg);
    const adam_tile_fn tile = adam_tile_for(level);
    const int64_t ntiles = (n + TILE - 1) / TILE;
    const size_t gsz = (size_t)zero_dtype_size(grad_dtype);
    const int threads = thread_count(num_threads);
    (void)threads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ntiles > 1 && threads > 1)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t b = t * TILE;
        const int64_t cnt = n - b < TILE ? n - b : TILE;
        tile(cnt, param + b, (const char *)grad + (size_t)b * gsz, grad_dtype, exp_avg + b, exp_avg_sq + b,
             out16 ? (void *)((uint16_t *)out16 + b) : NULL, out16_dtype, &c);
    }
    return ZERO_ADAM_OK;
}

/* ============================================================================ 5. stream pass */

int zero_cpu_stream_pass(int64_t n, float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                         int simd, int num_threads) {
    if (n < 0) return ZERO_ADAM_BAD_ARGUMENT;
    const int level = resolve_simd(simd);
    if (level < 0) return level;
    if (n == 0) return ZERO_ADAM_OK;
    if (param == NULL || grad == NULL || exp_avg == NULL || exp_avg_sq == NULL) return ZERO_ADAM_BAD_ARGUMENT;

    const stream_tile_fn tile = stream_tile_for(level);
    const int64_t ntiles = (n + TILE - 1) / TILE;
    const int threads = thread_count(num_threads);
    (void)threads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ntiles > 1 && threads > 1)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t b = t * TILE;
        const int64_t cnt = n - b < TILE ? n - b : TILE;
        tile(cnt, param + b, grad + b, exp_avg + b, exp_avg_sq + b);
    }
    return ZERO_ADAM_OK;
}

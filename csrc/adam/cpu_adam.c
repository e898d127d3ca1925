/* CPU Adam / AdamW step. See cpu_adam.h for the contract and adam/adam_math.h for the math.
 *
 * Layout of this file:
 *   1. the portable scalar path: the reference, one zero_adam_element per element
 *   2. the AVX2 path (8 lanes) and the AVX-512 path (16 lanes), x86-64 only; they perform the
 *      operations of [Note: adam math] in its order, with intrinsics, and give the scalar bits
 *   3. run-time dispatch and OpenMP tiling
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

#include "adam/adam_math.h"
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

#if ZERO_HAVE_X86_SIMD
/* ============================================================================ 2. SIMD paths
 *
 * Each path has a vector body that updates exactly one vector of W elements at index i, with
 * the operations of [Note: adam math] in its order (the same fmas, IEEE sqrt and division), so
 * each lane computes what zero_adam_element computes. A tile runs the body over its full
 * vectors; its last partial vector (at most W-1 elements, only in the last tile of a buffer)
 * goes through the same body via zero-padded local copies (partial_vec), so every element of a
 * buffer gets the same arithmetic. The two paths differ only in their width and intrinsics. */

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
                                                    void *out, int od, int nt, int64_t i, const zero_adam_coeffs *c,
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

TARGET_AVX2 static ALWAYS_INLINE void avx2_adam_tile_typed(TILE_PARAMS) {
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
    partial_vec t;
    partial_in(&t, n - full, p + full, (const char *)g + full * zero_dtype_size(gd), gd, m + full, v + full);
    avx2_adam_vec(t.p, t.g, gd, t.m, t.v, t.out, od, 0, 0, c, &k);
    partial_out(&t, n - full, p + full, m + full, v + full, od == ZERO_F32 ? NULL : (uint16_t *)out + full);
}

TARGET_AVX2 static void adam_tile_avx2(TILE_PARAMS) { DISPATCH_DTYPES(avx2_adam_tile_typed) }

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
                                                        void *out, int od, int nt, int64_t i,
                                                        const zero_adam_coeffs *c, const avx512_coeffs *k) {
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

TARGET_AVX512 static ALWAYS_INLINE void avx512_adam_tile_typed(TILE_PARAMS) {
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
    partial_vec t;
    partial_in(&t, n - full, p + full, (const char *)g + full * zero_dtype_size(gd), gd, m + full, v + full);
    avx512_adam_vec(t.p, t.g, gd, t.m, t.v, t.out, od, 0, 0, c, &k);
    partial_out(&t, n - full, p + full, m + full, v + full, od == ZERO_F32 ? NULL : (uint16_t *)out + full);
}

TARGET_AVX512 static void adam_tile_avx512(TILE_PARAMS) { DISPATCH_DTYPES(avx512_adam_tile_typed) }
#endif /* ZERO_HAVE_X86_SIMD */

/* ============================================================================ 3. dispatch */

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

int zero_cpu_thread_count(int num_threads) {
#ifdef _OPENMP
    return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
    (void)num_threads;
    return 1;
#endif
}

typedef void (*adam_tile_fn)(TILE_PARAMS);

static adam_tile_fn adam_tile_for(int level) {
#if ZERO_HAVE_X86_SIMD
    if (level == ZERO_SIMD_AVX512) return adam_tile_avx512;
    if (level == ZERO_SIMD_AVX2) return adam_tile_avx2;
#endif
    (void)level;
    return adam_tile_scalar;
}

int zero_cpu_adam_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg,
                       float *exp_avg_sq, void *out16, int32_t out16_dtype, const zero_adam_config *cfg,
                       int simd, int num_threads) {
    if (n < 0 || !zero_adam_config_ok(cfg)) return ZERO_ADAM_BAD_ARGUMENT;
    if (grad_dtype != ZERO_F32 && grad_dtype != ZERO_BF16 && grad_dtype != ZERO_F16) return ZERO_ADAM_BAD_ARGUMENT;
    if (out16 != NULL && out16_dtype != ZERO_BF16 && out16_dtype != ZERO_F16) return ZERO_ADAM_BAD_ARGUMENT;
    const int level = resolve_simd(simd);
    if (level < 0) return level;
    if (n == 0) return ZERO_ADAM_OK;
    if (param == NULL || grad == NULL || exp_avg == NULL || exp_avg_sq == NULL) return ZERO_ADAM_BAD_ARGUMENT;

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
    return ZERO_ADAM_OK;
}

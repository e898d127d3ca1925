/* Block-sparse attention on the CPU (contract: sparse_attention.h; design: docs/sparse_attention.md).
 *
 * [Note: sparse attention on the CPU]
 * Heads (batch x heads of them) are taken in groups (see GROUP_FLOATS): for each group, the
 * threads first pack what several tasks share (keys transposed, values, and in the backward the
 * scaled queries and dO) into fp32 work space, then take tasks from a dynamic schedule:
 *
 * - forward, one task per query block row r: for every key block c of r's index list, the block
 *   of scores S = (scale q_r) k_c^T (a block x block GEMM), the masks (only the diagonal block has
 *   a causal triangle; key padding and an attention bias are added where given), then the online
 *   softmax: a running row max m and sum l, P = exp(S - m), the output accumulator rescaled by
 *   exp(m_old - m) and O += P v_c. The row's out = O / l and lse = m + log l are written at the
 *   end. No score block outlives its iteration.
 * - backward, one task per key block column c (the transposed index): for every query block row r
 *   that attends to c, P = exp(S - lse_r) is recomputed from q, k and the saved lse, then
 *   dV_c += P^T dO_r, dP = dO_r v_c^T, dS = P (dP - delta_r) with delta = rowsum(dO * O),
 *   dK_c += dS^T (scale q_r), and dQ_r += dS k_c. dK_c and dV_c belong to the task; dQ_r is
 *   shared between columns, so each thread adds into its own dQ buffer and the buffers are summed
 *   after the last column: no atomics and no races; which thread took which column changes dQ
 *   only by the order of fp32 additions.
 *
 * Every product is one `gemm` call C (+)= A B with A read through (row, column) strides, so
 * A^T costs nothing. The portable path is plain loops; the AVX2 and AVX-512 paths are
 * register-blocked micro-kernels (6 rows x 16 or 32 columns of C in registers, a broadcast of A
 * and a row of B per step) plus a vector exp, chosen at run time. */
#include "sparse_attention/sparse_attention.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "adam/cpu_adam.h"
#include "common/dtypes.h"

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define TEAM_SIZE() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define TEAM_SIZE() 1
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ZERO_NO_X86_SIMD)
#define SPARSE_X86 1
#include <immintrin.h>
#else
#define SPARSE_X86 0
#endif

/* The vector operations one SIMD level provides; the drivers below are written once over them. */
typedef struct {
    /* C[M x N] (+)= A[M x K] B[K x N]; A[i][k] = A[i * a_rs + k * a_cs]; B, C row-major. */
    void (*gemm)(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs, const float *B,
                 int64_t ldb, float *C, int64_t ldc, int accumulate);
    float (*row_max)(int64_t n, const float *x);
    float (*exp_sub_sum)(int64_t n, float *x, float sub); /* x = exp(x - sub); returns the sum */
    void (*scale_row)(int64_t n, float *x, float a);
    void (*ds_row)(int64_t n, float *dp, const float *p, float delta); /* dp = p * (dp - delta) */
} vec_ops;

/* ------------------------------------------------------------------------------ portable */

static void gemm_scalar(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs, const float *B,
                        int64_t ldb, float *C, int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < N; j++) c[j] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float a = A[i * a_rs + k * a_cs];
            const float *b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

/* The row maxima keep a NaN (as dense softmax does: a NaN score makes its row NaN), which
 * fmax and the SIMD max instructions would drop. */
static inline float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

static float row_max_scalar(int64_t n, const float *x) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = nan_max(m, x[j]);
    return m;
}

static float exp_sub_sum_scalar(int64_t n, float *x, float sub) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        x[j] = expf(x[j] - sub);
        sum += x[j];
    }
    return sum;
}

static void scale_row_scalar(int64_t n, float *x, float a) {
    for (int64_t j = 0; j < n; j++) x[j] *= a;
}

static void ds_row_scalar(int64_t n, float *dp, const float *p, float delta) {
    for (int64_t j = 0; j < n; j++) dp[j] = p[j] * (dp[j] - delta);
}

static const vec_ops OPS_SCALAR = {gemm_scalar, row_max_scalar, exp_sub_sum_scalar, scale_row_scalar, ds_row_scalar};

#if SPARSE_X86
/* exp(x) for x <= 88: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact to fp32),
 * exp(r) by its degree-7 Taylor polynomial (relative error < 1e-8 on that interval), times 2^n
 * built in the exponent bits. Below ln(FLT_MIN) (and for -inf) the result is 0. */
#define EXP_LO (-87.33654475f)
#define EXP_HI 88.0f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187045e-06f
#define EXP_LOG2E 1.44269504088896341f

/* ------------------------------------------------------------------------------ AVX2 */
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define INLINE_AVX2 TARGET_AVX2 static inline __attribute__((always_inline))

INLINE_AVX2 __m256 exp_avx2(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    /* operands in this order: max/min return their second operand when either is NaN, so a NaN
       score stays NaN (as in the scalar path) instead of becoming a clamp bound */
    x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(1.0f / 5040);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 720));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* mr rows x (16 if wide else 8) columns of C, kept in registers over the whole K loop. */
INLINE_AVX2 void tile_avx2(const int mr, const int wide, int64_t K, const float *A, int64_t a_rs, int64_t a_cs,
                           const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    __m256 c0[6], c1[6];
    for (int r = 0; r < mr; r++) {
        c0[r] = accumulate ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();
        c1[r] = (accumulate && wide) ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * ldb, *a = A + k * a_cs;
        const __m256 b0 = _mm256_loadu_ps(b);
        const __m256 b1 = wide ? _mm256_loadu_ps(b + 8) : b0;
        for (int r = 0; r < mr; r++) {
            const __m256 x = _mm256_broadcast_ss(a + r * a_rs);
            c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
            if (wide) c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(C + r * ldc, c0[r]);
        if (wide) _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
    }
}

/* Rows i .. i+mr of C: 16-column tiles, an 8-column tile, then a scalar tail. */
INLINE_AVX2 void panel_avx2(const int mr, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs,
                            const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) tile_avx2(mr, 1, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
    if (j + 8 <= N) {
        tile_avx2(mr, 0, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
        j += 8;
    }
    if (j < N) gemm_scalar(mr, N - j, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
}

TARGET_AVX2 static void gemm_avx2(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs,
                                  const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t i = 0;
    for (; i + 6 <= M; i += 6) panel_avx2(6, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
    if (i + 4 <= M) {
        panel_avx2(4, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
        i += 4;
    }
    if (i + 2 <= M) {
        panel_avx2(2, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
        i += 2;
    }
    if (i < M) panel_avx2(1, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
}

INLINE_AVX2 float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static float row_max_avx2(int64_t n, const float *x) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; j < n; j++) r = nan_max(r, x[j]);
    return r;
}

TARGET_AVX2 static float exp_sub_sum_avx2(int64_t n, float *x, float sub) {
    const __m256 s = _mm256_set1_ps(sub);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), s));
        _mm256_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    return hsum_avx2(acc) + exp_sub_sum_scalar(n - j, x + j, sub);
}

TARGET_AVX2 static void scale_row_avx2(int64_t n, float *x, float a) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), va));
    scale_row_scalar(n - j, x + j, a);
}

TARGET_AVX2 static void ds_row_avx2(int64_t n, float *dp, const float *p, float delta) {
    const __m256 d = _mm256_set1_ps(delta);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(dp + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_sub_ps(_mm256_loadu_ps(dp + j), d)));
    ds_row_scalar(n - j, dp + j, p + j, delta);
}

static const vec_ops OPS_AVX2 = {gemm_avx2, row_max_avx2, exp_sub_sum_avx2, scale_row_avx2, ds_row_avx2};

/* ------------------------------------------------------------------------------ AVX-512 */
/* The AVX2 path with 16 lanes: tiles of 6 rows x 32 columns (12 accumulators of the 32
 * registers), then 16 columns, then 8 columns as a masked 16-lane tile. */
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define INLINE_AVX512 TARGET_AVX512 static inline __attribute__((always_inline))

INLINE_AVX512 __m512 exp_avx512(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x)); /* NaN stays: see AVX2 */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(1.0f / 5040);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 720));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

/* mr rows x (32 if wide, else the lanes of `lanes`) columns of C. */
INLINE_AVX512 void tile_avx512(const int mr, const int wide, const __mmask16 lanes, int64_t K, const float *A,
                               int64_t a_rs, int64_t a_cs, const float *B, int64_t ldb, float *C, int64_t ldc,
                               int accumulate) {
    __m512 c0[6], c1[6];
    for (int r = 0; r < mr; r++) {
        c0[r] = accumulate ? _mm512_maskz_loadu_ps(lanes, C + r * ldc) : _mm512_setzero_ps();
        c1[r] = (accumulate && wide) ? _mm512_loadu_ps(C + r * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * ldb, *a = A + k * a_cs;
        const __m512 b0 = _mm512_maskz_loadu_ps(lanes, b);
        const __m512 b1 = wide ? _mm512_loadu_ps(b + 16) : b0;
        for (int r = 0; r < mr; r++) {
            const __m512 x = _mm512_set1_ps(a[r * a_rs]);
            c0[r] = _mm512_fmadd_ps(x, b0, c0[r]);
            if (wide) c1[r] = _mm512_fmadd_ps(x, b1, c1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(C + r * ldc, lanes, c0[r]);
        if (wide) _mm512_storeu_ps(C + r * ldc + 16, c1[r]);
    }
}

INLINE_AVX512 void panel_avx512(const int mr, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs,
                                const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t j = 0;
    for (; j + 32 <= N; j += 32)
        tile_avx512(mr, 1, (__mmask16)0xffff, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
    if (j + 16 <= N) {
        tile_avx512(mr, 0, (__mmask16)0xffff, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
        j += 16;
    }
    if (j + 8 <= N) {
        tile_avx512(mr, 0, (__mmask16)0x00ff, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
        j += 8;
    }
    if (j < N) gemm_scalar(mr, N - j, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
}

TARGET_AVX512 static void gemm_avx512(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs,
                                      const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t i = 0;
    for (; i + 6 <= M; i += 6) panel_avx512(6, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
    if (i + 4 <= M) {
        panel_avx512(4, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
        i += 4;
    }
    if (i + 2 <= M) {
        panel_avx512(2, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
        i += 2;
    }
    if (i < M) panel_avx512(1, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
}

TARGET_AVX512 static float row_max_avx512(int64_t n, const float *x) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        m = _mm512_max_ps(m, v);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) return NAN;
    float r = _mm512_reduce_max_ps(m);
    for (; j < n; j++) r = nan_max(r, x[j]);
    return r;
}

TARGET_AVX512 static float exp_sub_sum_avx512(int64_t n, float *x, float sub) {
    const __m512 s = _mm512_set1_ps(sub);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + j), s));
        _mm512_storeu_ps(x + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc) + exp_sub_sum_scalar(n - j, x + j, sub);
}

TARGET_AVX512 static void scale_row_avx512(int64_t n, float *x, float a) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(x + j, _mm512_mul_ps(_mm512_loadu_ps(x + j), va));
    scale_row_scalar(n - j, x + j, a);
}

TARGET_AVX512 static void ds_row_avx512(int64_t n, float *dp, const float *p, float delta) {
    const __m512 d = _mm512_set1_ps(delta);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(dp + j, _mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_sub_ps(_mm512_loadu_ps(dp + j), d)));
    ds_row_scalar(n - j, dp + j, p + j, delta);
}

static const vec_ops OPS_AVX512 = {gemm_avx512, row_max_avx512, exp_sub_sum_avx512, scale_row_avx512,
                                   ds_row_avx512};
#endif /* SPARSE_X86 */

static const vec_ops *pick_ops(int simd) {
    int level = simd == ZERO_SIMD_BEST ? zero_cpu_adam_best_simd() : simd;
    if (level < ZERO_SIMD_SCALAR || level >= ZERO_SIMD_LEVELS || !zero_cpu_adam_simd_available(level)) return NULL;
#if SPARSE_X86
    if (level == ZERO_SIMD_AVX512) return &OPS_AVX512;
    if (level == ZERO_SIMD_AVX2) return &OPS_AVX2;
#endif
    return &OPS_SCALAR;
}

/* ------------------------------------------------------------------------------ shared pieces */

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* rows x D elements of src (rows row0.. of a (seq, D) buffer of `dtype`) as fp32, times scale,
 * into rows of D8 floats whose last D8 - D are 0. */
static void pack_rows(const void *src, int dtype, int64_t row0, int64_t rows, int64_t D, int64_t D8, float scale,
                      float *dst) {
    for (int64_t i = 0; i < rows; i++) {
        const int64_t s = (row0 + i) * D;
        float *d = dst + i * D8;
        for (int64_t e = 0; e < D; e++) d[e] = scale * zero_load_f32(src, dtype, s + e);
        for (int64_t e = D; e < D8; e++) d[e] = 0.0f;
    }
}

/* The same rows transposed: dst[e][i] (D rows of `rows` floats). */
static void pack_transposed(const void *src, int dtype, int64_t row0, int64_t rows, int64_t D, float *dst) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t e = 0; e < D; e++) dst[e * rows + i] = zero_load_f32(src, dtype, (row0 + i) * D + e);
}

static void store_rows(void *dst, int dtype, int64_t row0, int64_t rows, int64_t D, int64_t D8, float scale,
                       const float *src) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t e = 0; e < D; e++) zero_store_f32(dst, dtype, (row0 + i) * D + e, scale * src[i * D8 + e]);
}

/* Adds the masks of block (r, c) of batch b to its scores S (block x block, row-major). Only a
 * diagonal block of a causal problem has a triangle; biases are added where given. */
static void apply_masks(const zero_sparse_attention_problem *p, int64_t b, int64_t r, int64_t c, float *S) {
    const int64_t bs = p->block, q0 = r * bs, k0 = c * bs;
    if (p->key_bias) {
        const float *kb = p->key_bias + b * p->seq + k0;
        for (int64_t i = 0; i < bs; i++)
            for (int64_t j = 0; j < bs; j++) S[i * bs + j] += kb[j];
    }
    if (p->attn_bias && k0 < p->attn_bias_len) {
        const int64_t L = p->attn_bias_len, cols = k0 + bs <= L ? bs : L - k0;
        for (int64_t i = 0; i < bs && q0 + i < L; i++) {
            const float *row = p->attn_bias + (q0 + i) * L + k0;
            for (int64_t j = 0; j < cols; j++) S[i * bs + j] += row[j];
        }
    }
    if (p->causal && r == c)
        for (int64_t i = 0; i < bs; i++)
            for (int64_t j = i + 1; j < bs; j++) S[i * bs + j] = -INFINITY;
}

/* ------------------------------------------------------------------------------ forward */

typedef struct {
    float *q, *s, *o, *m, *l;
} forward_scratch;

static int64_t forward_thread_floats(int64_t bs, int64_t D8) { return round_up(2 * bs * D8 + bs * bs + 2 * bs, 16); }

/* One query block row r of one (batch, head): see [Note: sparse attention on the CPU]. q, out and
 * lse point at this (batch, head); Kt holds the keys transposed per block, Vf the values. */
static void forward_row(const zero_sparse_attention_problem *p, const vec_ops *ops, int64_t b, int64_t r,
                        const int32_t *cols, int64_t ncols, const void *q, const float *Kt, const float *Vf, void *out,
                        float *lse, forward_scratch w) {
    const int64_t bs = p->block, D = p->head_dim, D8 = round_up(D, 8);
    pack_rows(q, p->dtype, r * bs, bs, D, D8, p->scale, w.q);
    memset(w.o, 0, (size_t)(bs * D8) * sizeof(float));
    for (int64_t i = 0; i < bs; i++) {
        w.m[i] = -INFINITY;
        w.l[i] = 0.0f;
    }
    for (int64_t n = 0; n < ncols; n++) {
        const int64_t c = cols[n];
        if (p->causal && c > r) continue; /* entirely above the diagonal */
        ops->gemm(bs, bs, D, w.q, D8, 1, Kt + c * bs * D, bs, w.s, bs, 0);
        apply_masks(p, b, r, c, w.s);
        for (int64_t i = 0; i < bs; i++) {
            float *s = w.s + i * bs;
            const float m = nan_max(ops->row_max(bs, s), w.m[i]); /* a NaN stays for the whole row */
            if (m == -INFINITY) { /* nothing visible in this row yet */
                memset(s, 0, (size_t)bs * sizeof(float));
                continue;
            }
            const float alpha = expf(w.m[i] - m); /* 0 for the first finite block */
            const float sum = ops->exp_sub_sum(bs, s, m);
            if (alpha != 1.0f) ops->scale_row(D8, w.o + i * D8, alpha);
            w.l[i] = w.l[i] * alpha + sum;
            w.m[i] = m;
        }
        ops->gemm(bs, D8, bs, w.s, bs, 1, Vf + c * bs * D8, D8, w.o, D8, 1);
    }
    for (int64_t i = 0; i < bs; i++) {
        const float inv = w.l[i] > 0.0f ? 1.0f / w.l[i] : 0.0f;
        lse[r * bs + i] = w.l[i] > 0.0f || w.l[i] != w.l[i] ? w.m[i] + logf(w.l[i]) : INFINITY; /* NaN stays */
        ops->scale_row(D8, w.o + i * D8, inv);
    }
    store_rows(out, p->dtype, r * bs, bs, D, D8, 1.0f, w.o);
}

/* Heads are taken in groups whose packed inputs fill about GROUP_FLOATS floats (16 MB): one pack
 * phase and one task phase per group, so the threads meet at a barrier twice per group instead of
 * per head, and short sequences with many heads still give every thread enough tasks. */
#define GROUP_FLOATS ((int64_t)4 << 20)

static int64_t group_heads(int64_t units, int64_t per_head) {
    int64_t g = GROUP_FLOATS / (per_head > 0 ? per_head : 1);
    if (g > units) g = units;
    return g < 1 ? 1 : g;
}

static int64_t forward_head_floats(const zero_sparse_attention_problem *p) {
    return round_up(p->seq * p->head_dim, 16) + round_up(p->seq * round_up(p->head_dim, 8), 16);
}

int64_t zero_sparse_attention_forward_workspace(const zero_sparse_attention_problem *p, int num_threads) {
    if (!zero_sparse_attention_valid(p)) return -1;
    const int64_t head = forward_head_floats(p), group = group_heads(p->batch * p->heads, head);
    return group * head + zero_cpu_thread_count(num_threads) * forward_thread_floats(p->block, round_up(p->head_dim, 8));
}

int zero_sparse_attention_forward(const zero_sparse_attention_problem *p, const void *q, const void *k, const void *v,
                                  void *out, float *lse, float *workspace, int simd, int num_threads) {
    if (!zero_sparse_attention_valid(p) || !p->row_ptr || !p->col_idx) return ZERO_ADAM_BAD_ARGUMENT;
    const int64_t units = p->batch * p->heads;
    if (units == 0 || p->seq == 0) return ZERO_ADAM_OK;
    if (!q || !k || !v || !out || !lse || !workspace) return ZERO_ADAM_BAD_ARGUMENT;
    const vec_ops *ops = pick_ops(simd);
    if (!ops) return ZERO_ADAM_SIMD_UNAVAILABLE;
    const int64_t bs = p->block, D = p->head_dim, D8 = round_up(D, 8), T = p->seq, nb = T / bs;
    const int64_t head = forward_head_floats(p), group = group_heads(units, head), kt_floats = round_up(T * D, 16);
    const int64_t stride = T * D * zero_dtype_size(p->dtype); /* bytes of one (batch, head) */
    const int dt = p->dtype;
    float *per_thread = workspace + group * head;
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;
#pragma omp parallel num_threads(threads)
    {
        float *mine = per_thread + THREAD_ID() * forward_thread_floats(bs, D8);
        const forward_scratch w = {mine, mine + bs * D8, mine + bs * D8 + bs * bs, mine + 2 * bs * D8 + bs * bs,
                                   mine + 2 * bs * D8 + bs * bs + bs};
        for (int64_t u0 = 0; u0 < units; u0 += group) {
            const int64_t tasks = (units - u0 < group ? units - u0 : group) * nb;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) { /* key block c of head u0 + t / nb, packed */
                const int64_t u = u0 + t / nb, c = t % nb;
                float *Kt = workspace + (t / nb) * head, *Vf = Kt + kt_floats;
                pack_transposed((const char *)k + u * stride, dt, c * bs, bs, D, Kt + c * bs * D);
                pack_rows((const char *)v + u * stride, dt, c * bs, bs, D, D8, 1.0f, Vf + c * bs * D8);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; t++) { /* query block row r of head u0 + t / nb */
                const int64_t u = u0 + t / nb, r = t % nb, b = u / p->heads, h = u % p->heads;
                const int32_t *row_ptr = p->row_ptr + (p->layout_heads == 1 ? 0 : h) * (nb + 1);
                const float *Kt = workspace + (t / nb) * head;
                forward_row(p, ops, b, r, p->col_idx + row_ptr[r], row_ptr[r + 1] - row_ptr[r],
                            (const char *)q + u * stride, Kt, Kt + kt_floats, (char *)out + u * stride, lse + u * T, w);
            }
        }
    }
    return ZERO_ADAM_OK;
}

/* ------------------------------------------------------------------------------ backward */

typedef struct {
    float *s, *dp, *dk, *dv, *dq;
} backward_scratch;

typedef struct {
    const float *q, *k, *kt, *vt, *dout, *delta, *lse; /* this (batch, head)'s packed inputs */
} backward_inputs;

/* One key block column c of one (batch, head): see [Note: sparse attention on the CPU]. Adds
 * this column's share of dQ into the thread's w.dq; writes dK and dV of block c. */
static void backward_col(const zero_sparse_attention_problem *p, const vec_ops *ops, int64_t b, int64_t c,
                         const int32_t *rows, int64_t nrows, backward_inputs in, void *dk, void *dv,
                         backward_scratch w) {
    const int64_t bs = p->block, D = p->head_dim, D8 = round_up(D, 8);
    memset(w.dk, 0, (size_t)(bs * D8) * sizeof(float));
    memset(w.dv, 0, (size_t)(bs * D8) * sizeof(float));
    for (int64_t n = 0; n < nrows; n++) {
        const int64_t r = rows[n];
        if (p->causal && c > r) continue;
        const float *qr = in.q + r * bs * D8, *dor = in.dout + r * bs * D8;
        ops->gemm(bs, bs, D, qr, D8, 1, in.kt + c * bs * D, bs, w.s, bs, 0); /* S = (scale q) k^T */
        apply_masks(p, b, r, c, w.s);
        for (int64_t i = 0; i < bs; i++) ops->exp_sub_sum(bs, w.s + i * bs, in.lse[r * bs + i]); /* P */
        ops->gemm(bs, D8, bs, w.s, 1, bs, dor, D8, w.dv, D8, 1);             /* dV += P^T dO */
        ops->gemm(bs, bs, D, dor, D8, 1, in.vt + c * bs * D, bs, w.dp, bs, 0); /* dP = dO v^T */
        for (int64_t i = 0; i < bs; i++) ops->ds_row(bs, w.dp + i * bs, w.s + i * bs, in.delta[r * bs + i]);
        ops->gemm(bs, D8, bs, w.dp, 1, bs, qr, D8, w.dk, D8, 1);                          /* dK += dS^T (scale q) */
        ops->gemm(bs, D8, bs, w.dp, bs, 1, in.k + c * bs * D8, D8, w.dq + r * bs * D8, D8, 1); /* dQ += dS k */
    }
    store_rows(dk, p->dtype, c * bs, bs, D, D8, 1.0f, w.dk);
    store_rows(dv, p->dtype, c * bs, bs, D, D8, 1.0f, w.dv);
}

/* Per head of a group: the scaled q, k and dO as rows of D8 floats, k and v transposed, delta. */
static int64_t backward_head_floats(const zero_sparse_attention_problem *p) {
    const int64_t T = p->seq, D = p->head_dim, D8 = round_up(D, 8);
    return 3 * round_up(T * D8, 16) + 2 * round_up(T * D, 16) + round_up(T, 16);
}

/* Per thread: the block scratch, then one dQ accumulator per head of the group. */
static int64_t backward_thread_floats(const zero_sparse_attention_problem *p, int64_t group) {
    const int64_t bs = p->block, D8 = round_up(p->head_dim, 8);
    return round_up(2 * bs * bs + 2 * bs * D8, 16) + group * round_up(p->seq * D8, 16);
}

static int64_t backward_group(const zero_sparse_attention_problem *p, int threads) {
    const int64_t dq = round_up(p->seq * round_up(p->head_dim, 8), 16);
    return group_heads(p->batch * p->heads, backward_head_floats(p) + threads * dq);
}

int64_t zero_sparse_attention_backward_workspace(const zero_sparse_attention_problem *p, int num_threads) {
    if (!zero_sparse_attention_valid(p)) return -1;
    const int threads = zero_cpu_thread_count(num_threads);
    const int64_t group = backward_group(p, threads);
    return group * backward_head_floats(p) + threads * backward_thread_floats(p, group);
}

int zero_sparse_attention_backward(const zero_sparse_attention_problem *p, const void *q, const void *k,
                                   const void *v, const void *out, const void *dout, const float *lse, void *dq,
                                   void *dk, void *dv, float *workspace, int simd, int num_threads) {
    if (!zero_sparse_attention_valid(p) || !p->col_ptr || !p->row_idx) return ZERO_ADAM_BAD_ARGUMENT;
    const int64_t units = p->batch * p->heads;
    if (units == 0 || p->seq == 0) return ZERO_ADAM_OK;
    if (!q || !k || !v || !out || !dout || !lse || !dq || !dk || !dv || !workspace) return ZERO_ADAM_BAD_ARGUMENT;
    const vec_ops *ops = pick_ops(simd);
    if (!ops) return ZERO_ADAM_SIMD_UNAVAILABLE;
    const int64_t bs = p->block, D = p->head_dim, D8 = round_up(D, 8), T = p->seq, nb = T / bs;
    const int threads = zero_cpu_thread_count(num_threads);
    const int64_t head = backward_head_floats(p), group = backward_group(p, threads);
    const int64_t per = backward_thread_floats(p, group), scratch = round_up(2 * bs * bs + 2 * bs * D8, 16);
    const int64_t rows = round_up(T * D8, 16), cols = round_up(T * D, 16); /* one packed (T, D8) / (D, T) */
    const int64_t stride = T * D * zero_dtype_size(p->dtype);
    const int dt = p->dtype;
    float *per_thread = workspace + group * head;
#pragma omp parallel num_threads(threads)
    {
        float *mine = per_thread + THREAD_ID() * per;
        const int team = TEAM_SIZE();
        for (int64_t u0 = 0; u0 < units; u0 += group) {
            const int64_t heads_now = units - u0 < group ? units - u0 : group, tasks = heads_now * nb;
            memset(mine + scratch, 0, (size_t)(heads_now * rows) * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) { /* block c of head u0 + t / nb, packed */
                const int64_t off = (u0 + t / nb) * stride, r0 = (t % nb) * bs;
                float *Qf = workspace + (t / nb) * head, *Kf = Qf + rows, *dOf = Kf + rows, *Kt = dOf + rows;
                float *Vt = Kt + cols, *delta = Vt + cols;
                pack_rows((const char *)q + off, dt, r0, bs, D, D8, p->scale, Qf + r0 * D8);
                pack_rows((const char *)k + off, dt, r0, bs, D, D8, 1.0f, Kf + r0 * D8);
                pack_rows((const char *)dout + off, dt, r0, bs, D, D8, 1.0f, dOf + r0 * D8);
                pack_transposed((const char *)k + off, dt, r0, bs, D, Kt + r0 * D);
                pack_transposed((const char *)v + off, dt, r0, bs, D, Vt + r0 * D);
                for (int64_t i = r0; i < r0 + bs; i++) { /* delta = rowsum(dO * O), O as returned */
                    float sum = 0.0f;
                    for (int64_t e = 0; e < D; e++)
                        sum += dOf[i * D8 + e] * zero_load_f32((const char *)out + off, dt, i * D + e);
                    delta[i] = sum;
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; t++) { /* key block column c of head u0 + t / nb */
                const int64_t u = u0 + t / nb, c = t % nb, b = u / p->heads, h = u % p->heads;
                const int32_t *col_ptr = p->col_ptr + (p->layout_heads == 1 ? 0 : h) * (nb + 1);
                const float *Qf = workspace + (t / nb) * head;
                const backward_inputs in = {Qf, Qf + rows, Qf + 3 * rows, Qf + 3 * rows + cols, Qf + 2 * rows,
                                            Qf + 3 * rows + 2 * cols, lse + u * T};
                const backward_scratch w = {mine, mine + bs * bs, mine + 2 * bs * bs, mine + 2 * bs * bs + bs * D8,
                                            mine + scratch + (t / nb) * rows};
                backward_col(p, ops, b, c, p->row_idx + col_ptr[c], col_ptr[c + 1] - col_ptr[c], in,
                             (char *)dk + u * stride, (char *)dv + u * stride, w);
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) { /* dQ = scale * the threads' sums, block by block */
                const int64_t c = t % nb;
                float *first = per_thread + scratch + (t / nb) * rows + c * bs * D8;
                for (int i = 1; i < team; i++) {
                    const float *other = first + i * per;
                    for (int64_t e = 0; e < bs * D8; e++) first[e] += other[e];
                }
                store_rows((char *)dq + (u0 + t / nb) * stride, dt, c * bs, bs, D, D8, p->scale, first);
            }
        }
    }
    return ZERO_ADAM_OK;
}

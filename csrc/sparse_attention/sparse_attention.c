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
 * and a row of B per step) plus a vector exp, one body (sparse_attention_body.h) compiled per
 * width, chosen at run time (common/simd.h). */
#include "sparse_attention/sparse_attention.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "common/dtypes.h"
#include "common/simd.h"

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define TEAM_SIZE() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define TEAM_SIZE() 1
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

static const vec_ops ops_scalar = {gemm_scalar, row_max_scalar, exp_sub_sum_scalar, scale_row_scalar, ds_row_scalar};

#if ZERO_HAVE_X86_SIMD
/* The constants of the vector exp: see its comment in sparse_attention_body.h. */
#define EXP_LO (-87.33654475f)
#define EXP_HI 88.0f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187045e-06f
#define EXP_LOG2E 1.44269504088896341f

/* ------------------------------------------------------------------------------ AVX2, AVX-512 */
#include "common/simd_width.h"
#define ZV_BITS 256
#include "sparse_attention/sparse_attention_body.h" /* ops_avx2 */
#undef ZV_BITS
#define ZV_BITS 512
#include "sparse_attention/sparse_attention_body.h" /* ops_avx512 */
#undef ZV_BITS
#endif /* ZERO_HAVE_X86_SIMD */

static const vec_ops *pick_ops(int simd) {
    const int level = zero_simd_resolve(simd);
    if (level < 0) return NULL;
#if ZERO_HAVE_X86_SIMD
    if (level == ZERO_SIMD_AVX512) return &ops_avx512;
    if (level == ZERO_SIMD_AVX2) return &ops_avx2;
#endif
    return &ops_scalar;
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
    if (!zero_sparse_attention_valid(p) || !p->row_ptr || !p->col_idx) return ZERO_BAD_ARGUMENT;
    const int64_t units = p->batch * p->heads;
    if (units == 0 || p->seq == 0) return ZERO_OK;
    if (!q || !k || !v || !out || !lse || !workspace) return ZERO_BAD_ARGUMENT;
    const vec_ops *ops = pick_ops(simd);
    if (!ops) return ZERO_SIMD_UNAVAILABLE;
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
    return ZERO_OK;
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
    if (!zero_sparse_attention_valid(p) || !p->col_ptr || !p->row_idx) return ZERO_BAD_ARGUMENT;
    const int64_t units = p->batch * p->heads;
    if (units == 0 || p->seq == 0) return ZERO_OK;
    if (!q || !k || !v || !out || !dout || !lse || !dq || !dk || !dv || !workspace) return ZERO_BAD_ARGUMENT;
    const vec_ops *ops = pick_ops(simd);
    if (!ops) return ZERO_SIMD_UNAVAILABLE;
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
    return ZERO_OK;
}

/* Block-sparse attention on the GPU (contract: sparse_attention_cuda.h; the algorithm is the CPU
 * kernel's, see [Note: sparse attention on the CPU] in sparse_attention.c).
 *
 * [Note: sparse attention on the GPU]
 * A thread block (CTA) of 128 threads owns 16 rows; 8 consecutive lanes of a warp share a row,
 * each lane holding head_dim / 8 of the row's output columns in registers (head_dim <= 128).
 * Keys (or queries) stream through shared memory in chunks; scores are dot products out of
 * shared memory (rows padded to head_dim + 1 floats, so the 8 lanes of a row and the 4 rows of a
 * warp hit distinct banks), and row reductions are 8-lane shuffles. All arithmetic is fp32;
 * bf16/fp16 are converted on load and on store (common/dtypes.h).
 *
 * - forward_kernel: 16 query rows of one block row; for each key block of the row's index list
 *   and each chunk of 32 keys: scores, masks, online softmax (running max m, sum l, output
 *   rescaled by exp(m_old - m)), O += P V. Writes out = O / l and lse = m + log l.
 * - delta_kernel: delta = rowsum(dO * O), one warp per row.
 * - dq_kernel: 16 query rows; for each key block and chunk of 16 keys: P = exp(S - lse),
 *   dP = dO v^T, dS = P (dP - delta), dQ += dS k. Writes scale * dQ.
 * - dkv_kernel: 16 key rows of one key block; for each query block row of the transposed index
 *   and chunk of 16 queries: P and dS as above (transposed), dV += P^T dO, dK += dS^T (scale q).
 * No atomics: every output row has one owner, so results do not depend on scheduling.
 * This is a plain CUDA-core kernel (no tensor-core MMA); it was written without a GPU at hand.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/dtypes.h"
#include "sparse_attention/sparse_attention_cuda.h"

namespace {

typedef zero_sparse_attention_problem problem;

constexpr int ROWS = 16;                  /* rows (queries or keys) per CTA */
constexpr int LANES = 8;                  /* threads per row */
constexpr int THREADS = ROWS * LANES;     /* 128 */
constexpr int DPT = ZERO_SPARSE_MAX_HEAD_DIM / LANES; /* output columns per thread, at most */
constexpr int FWD_CHUNK = 32;             /* keys per shared-memory chunk, forward */
constexpr int BWD_CHUNK = 16;             /* keys or queries per chunk, backward */
constexpr unsigned FULL = 0xffffffffu;

template <int DT>
__device__ __forceinline__ float load(const void *p, int64_t i) { return zero_load_f32(p, DT, i); }

template <int DT>
__device__ __forceinline__ void store(void *p, int64_t i, float v) { zero_store_f32(p, DT, i, v); }

/* The score of query qi and key kj of batch b after the masks (the CPU kernel's order of additions). */
__device__ __forceinline__ float masked(const problem &p, int64_t b, int64_t qi, int64_t kj, float s) {
    if (p.causal && kj > qi) return -INFINITY;
    if (p.key_bias) s += p.key_bias[b * p.seq + kj];
    if (p.attn_bias && qi < p.attn_bias_len && kj < p.attn_bias_len) s += p.attn_bias[qi * p.attn_bias_len + kj];
    return s;
}

/* A max that keeps a NaN (dense softmax makes a row with a NaN score NaN; fmaxf would drop it). */
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float row_max(float x) {
    for (int off = LANES / 2; off > 0; off >>= 1) x = nan_max(x, __shfl_xor_sync(FULL, x, off));
    return x;
}

__device__ __forceinline__ float row_sum(float x) {
    for (int off = LANES / 2; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

__device__ __forceinline__ float dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
    for (int d = 0; d < n; d++) acc = fmaf(a[d], b[d], acc);
    return acc;
}

/* rows x D elements from row `row0` of a (seq, D) buffer into shared rows of `ld` floats, times scale. */
template <int DT>
__device__ __forceinline__ void load_rows(const void *src, int64_t base, int64_t row0, int rows, int D, int ld,
                                          float scale, float *dst) {
    for (int e = threadIdx.x; e < rows * D; e += THREADS) {
        const int i = e / D, d = e % D;
        dst[i * ld + d] = scale * load<DT>(src, base + (row0 + i) * (int64_t)D + d);
    }
}

/* Which (batch * heads + head) unit, block row and 16-row tile a CTA works on. */
struct place {
    int64_t unit, b, h, block_row, row0;
};

__device__ __forceinline__ place where(const problem &p) {
    const int64_t tiles = p.block / ROWS, nb = p.seq / p.block;
    int64_t id = blockIdx.x;
    place w;
    const int64_t tile = id % tiles;
    id /= tiles;
    w.block_row = id % nb;
    w.unit = id / nb;
    w.b = w.unit / p.heads;
    w.h = w.unit % p.heads;
    w.row0 = w.block_row * p.block + tile * ROWS;
    return w;
}

__device__ __forceinline__ const int32_t *layout_row(const problem &p, const int32_t *ptr, int64_t h) {
    return ptr + (p.layout_heads == 1 ? 0 : h) * (p.seq / p.block + 1);
}

template <int DT>
__global__ void __launch_bounds__(THREADS)
    forward_kernel(problem p, const void *q, const void *k, const void *v, void *out, float *lse) {
    extern __shared__ float smem[];
    const int D = (int)p.head_dim, ld = D + 1;
    const int64_t bs = p.block, T = p.seq;
    const place w = where(p);
    const int64_t base = w.unit * T * D;
    float *Qs = smem, *Ks = Qs + ROWS * ld, *Vs = Ks + FWD_CHUNK * ld, *Ps = Vs + FWD_CHUNK * ld;
    const int row = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const int64_t qi = w.row0 + row;
    load_rows<DT>(q, base, w.row0, ROWS, D, ld, p.scale, Qs);
    float o[DPT];
    for (int j = 0; j < DPT; j++) o[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int32_t *ptr = layout_row(p, p.row_ptr, w.h);
    const int32_t begin = ptr[w.block_row], end = ptr[w.block_row + 1];
    for (int32_t n = begin; n < end; n++) {
        const int64_t c = p.col_idx[n];
        if (p.causal && c > w.block_row) continue; /* the whole CTA agrees: no divergence around shuffles */
        for (int64_t kc = 0; kc < bs; kc += FWD_CHUNK) {
            const int64_t k0 = c * bs + kc;
            if (p.causal && k0 > w.row0 + ROWS - 1) break; /* every key after every query of the CTA */
            /* a block of 16 keys fills half a chunk: the rest belongs to the next block (which the
               layout may not have) or lies past the end of k and v, so it is neither loaded nor seen */
            const int valid = (int)(bs - kc < FWD_CHUNK ? bs - kc : FWD_CHUNK);
            __syncthreads(); /* the previous chunk is no longer read */
            load_rows<DT>(k, base, k0, valid, D, ld, 1.0f, Ks);
            load_rows<DT>(v, base, k0, valid, D, ld, 1.0f, Vs);
            for (int e = threadIdx.x; e < (FWD_CHUNK - valid) * D; e += THREADS)
                Vs[(valid + e / D) * ld + e % D] = 0.0f; /* its probabilities are 0: keep 0 * V finite */
            __syncthreads();
            float s[FWD_CHUNK / LANES], cmax = -INFINITY;
            for (int t = 0; t < FWD_CHUNK / LANES; t++) {
                const int j = lane + LANES * t;
                s[t] = j < valid ? masked(p, w.b, qi, k0 + j, dot(Qs + row * ld, Ks + j * ld, D)) : -INFINITY;
                cmax = nan_max(cmax, s[t]);
            }
            const float mnew = nan_max(row_max(cmax), m);
            float psum = 0.0f;
            for (int t = 0; t < FWD_CHUNK / LANES; t++) {
                s[t] = mnew == -INFINITY ? 0.0f : expf(s[t] - mnew);
                psum += s[t];
            }
            psum = row_sum(psum);
            const float alpha = mnew == -INFINITY ? 1.0f : expf(m - mnew);
            l = l * alpha + psum;
            m = mnew;
            for (int t = 0; t < FWD_CHUNK / LANES; t++) Ps[row * (FWD_CHUNK + 1) + lane + LANES * t] = s[t];
            __syncwarp();
            for (int jj = 0; jj < DPT; jj++) {
                const int d = lane + LANES * jj;
                if (d >= D) break;
                float acc = o[jj] * alpha;
                for (int j = 0; j < FWD_CHUNK; j++) acc = fmaf(Ps[row * (FWD_CHUNK + 1) + j], Vs[j * ld + d], acc);
                o[jj] = acc;
            }
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int jj = 0; jj < DPT; jj++) {
        const int d = lane + LANES * jj;
        if (d < D) store<DT>(out, base + qi * D + d, o[jj] * inv);
    }
    if (lane == 0) lse[w.unit * T + qi] = l > 0.0f || l != l ? m + logf(l) : INFINITY;
}

/* delta[i] = sum_d dO[i][d] * O[i][d]: one warp per row. */
template <int DT>
__global__ void delta_kernel(int64_t rows, int64_t D, const void *out, const void *dout, float *delta) {
    const int64_t i = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (i >= rows) return; /* whole warps leave together */
    float acc = 0.0f;
    for (int64_t d = threadIdx.x % 32; d < D; d += 32) acc += load<DT>(dout, i * D + d) * load<DT>(out, i * D + d);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(FULL, acc, off);
    if (threadIdx.x % 32 == 0) delta[i] = acc;
}

template <int DT>
__global__ void __launch_bounds__(THREADS)
    dq_kernel(problem p, const void *q, const void *k, const void *v, const void *dout, const float *lse,
              const float *delta, void *dq) {
    extern __shared__ float smem[];
    const int D = (int)p.head_dim, ld = D + 1;
    const int64_t bs = p.block, T = p.seq;
    const place w = where(p);
    const int64_t base = w.unit * T * D;
    float *Qs = smem, *dOs = Qs + ROWS * ld, *Ks = dOs + ROWS * ld, *Vs = Ks + BWD_CHUNK * ld;
    float *Ss = Vs + BWD_CHUNK * ld;
    const int row = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const int64_t qi = w.row0 + row;
    load_rows<DT>(q, base, w.row0, ROWS, D, ld, p.scale, Qs);
    load_rows<DT>(dout, base, w.row0, ROWS, D, ld, 1.0f, dOs);
    const float lse_i = lse[w.unit * T + qi], delta_i = delta[w.unit * T + qi];
    float g[DPT];
    for (int j = 0; j < DPT; j++) g[j] = 0.0f;
    const int32_t *ptr = layout_row(p, p.row_ptr, w.h);
    const int32_t begin = ptr[w.block_row], end = ptr[w.block_row + 1];
    for (int32_t n = begin; n < end; n++) {
        const int64_t c = p.col_idx[n];
        if (p.causal && c > w.block_row) continue;
        for (int64_t kc = 0; kc < bs; kc += BWD_CHUNK) {
            const int64_t k0 = c * bs + kc;
            if (p.causal && k0 > w.row0 + ROWS - 1) break;
            __syncthreads();
            load_rows<DT>(k, base, k0, BWD_CHUNK, D, ld, 1.0f, Ks);
            load_rows<DT>(v, base, k0, BWD_CHUNK, D, ld, 1.0f, Vs);
            __syncthreads();
            for (int t = 0; t < BWD_CHUNK / LANES; t++) {
                const int j = lane + LANES * t;
                const float s = masked(p, w.b, qi, k0 + j, dot(Qs + row * ld, Ks + j * ld, D));
                const float prob = expf(s - lse_i); /* 0 for a masked score or an empty row (lse = +inf) */
                const float dp = dot(dOs + row * ld, Vs + j * ld, D);
                Ss[row * (BWD_CHUNK + 1) + j] = prob * (dp - delta_i);
            }
            __syncwarp();
            for (int jj = 0; jj < DPT; jj++) {
                const int d = lane + LANES * jj;
                if (d >= D) break;
                float acc = g[jj];
                for (int j = 0; j < BWD_CHUNK; j++) acc = fmaf(Ss[row * (BWD_CHUNK + 1) + j], Ks[j * ld + d], acc);
                g[jj] = acc;
            }
        }
    }
    for (int jj = 0; jj < DPT; jj++) {
        const int d = lane + LANES * jj;
        if (d < D) store<DT>(dq, base + qi * D + d, p.scale * g[jj]);
    }
}

template <int DT>
__global__ void __launch_bounds__(THREADS)
    dkv_kernel(problem p, const void *q, const void *k, const void *v, const void *dout, const float *lse,
               const float *delta, void *dk, void *dv) {
    extern __shared__ float smem[];
    const int D = (int)p.head_dim, ld = D + 1;
    const int64_t bs = p.block, T = p.seq;
    const place w = where(p); /* here block_row is the key block column and row0 the first key */
    const int64_t base = w.unit * T * D;
    float *Ks = smem, *Vs = Ks + ROWS * ld, *Qs = Vs + ROWS * ld, *dOs = Qs + BWD_CHUNK * ld;
    float *Ps = dOs + BWD_CHUNK * ld, *Ss = Ps + ROWS * (BWD_CHUNK + 1), *Ls = Ss + ROWS * (BWD_CHUNK + 1);
    float *Ds = Ls + BWD_CHUNK;
    const int row = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const int64_t kj = w.row0 + row, c = w.block_row;
    load_rows<DT>(k, base, w.row0, ROWS, D, ld, 1.0f, Ks);
    load_rows<DT>(v, base, w.row0, ROWS, D, ld, 1.0f, Vs);
    float gk[DPT], gv[DPT];
    for (int j = 0; j < DPT; j++) gk[j] = gv[j] = 0.0f;
    const int32_t *ptr = layout_row(p, p.col_ptr, w.h);
    const int32_t begin = ptr[c], end = ptr[c + 1];
    for (int32_t n = begin; n < end; n++) {
        const int64_t r = p.row_idx[n];
        if (p.causal && c > r) continue;
        for (int64_t qc = 0; qc < bs; qc += BWD_CHUNK) {
            const int64_t q0 = r * bs + qc;
            if (p.causal && q0 + BWD_CHUNK - 1 < w.row0) continue; /* every query before every key of the CTA */
            __syncthreads();
            load_rows<DT>(q, base, q0, BWD_CHUNK, D, ld, p.scale, Qs);
            load_rows<DT>(dout, base, q0, BWD_CHUNK, D, ld, 1.0f, dOs);
            if (threadIdx.x < BWD_CHUNK) {
                Ls[threadIdx.x] = lse[w.unit * T + q0 + threadIdx.x];
                Ds[threadIdx.x] = delta[w.unit * T + q0 + threadIdx.x];
            }
            __syncthreads();
            for (int t = 0; t < BWD_CHUNK / LANES; t++) {
                const int i = lane + LANES * t;
                const float s = masked(p, w.b, q0 + i, kj, dot(Ks + row * ld, Qs + i * ld, D));
                const float prob = expf(s - Ls[i]);
                const float dp = dot(Vs + row * ld, dOs + i * ld, D);
                Ps[row * (BWD_CHUNK + 1) + i] = prob;
                Ss[row * (BWD_CHUNK + 1) + i] = prob * (dp - Ds[i]);
            }
            __syncwarp();
            for (int jj = 0; jj < DPT; jj++) {
                const int d = lane + LANES * jj;
                if (d >= D) break;
                float av = gv[jj], ak = gk[jj];
                for (int i = 0; i < BWD_CHUNK; i++) {
                    av = fmaf(Ps[row * (BWD_CHUNK + 1) + i], dOs[i * ld + d], av);
                    ak = fmaf(Ss[row * (BWD_CHUNK + 1) + i], Qs[i * ld + d], ak);
                }
                gv[jj] = av;
                gk[jj] = ak;
            }
        }
    }
    for (int jj = 0; jj < DPT; jj++) {
        const int d = lane + LANES * jj;
        if (d < D) {
            store<DT>(dk, base + kj * D + d, gk[jj]);
            store<DT>(dv, base + kj * D + d, gv[jj]);
        }
    }
}

size_t forward_smem(int D) { return sizeof(float) * ((size_t)(ROWS + 2 * FWD_CHUNK) * (D + 1) + ROWS * (FWD_CHUNK + 1)); }
size_t dq_smem(int D) { return sizeof(float) * ((size_t)(2 * ROWS + 2 * BWD_CHUNK) * (D + 1) + ROWS * (BWD_CHUNK + 1)); }
size_t dkv_smem(int D) {
    return sizeof(float) * ((size_t)(2 * ROWS + 2 * BWD_CHUNK) * (D + 1) + 2 * ROWS * (BWD_CHUNK + 1) + 2 * BWD_CHUNK);
}

/* CTAs for a problem: one per 16 rows of every (batch, head), or -1 beyond one grid dimension. */
int64_t grid_of(const problem *p) {
    const int64_t ctas = p->batch * p->heads * (p->seq / ROWS);
    return ctas > 0x7fffffffLL ? -1 : ctas;
}

template <int DT>
int forward_as(const problem *p, const void *q, const void *k, const void *v, void *out, float *lse,
               cudaStream_t stream) {
    const int D = (int)p->head_dim;
    forward_kernel<DT><<<(unsigned)grid_of(p), THREADS, forward_smem(D), stream>>>(*p, q, k, v, out, lse);
    return (int)cudaGetLastError();
}

template <int DT>
int backward_as(const problem *p, const void *q, const void *k, const void *v, const void *out, const void *dout,
                const float *lse, void *dq, void *dk, void *dv, float *delta, cudaStream_t stream) {
    const int D = (int)p->head_dim;
    const int64_t rows = p->batch * p->heads * p->seq, warps = 8;
    delta_kernel<DT><<<(unsigned)((rows + warps - 1) / warps), (unsigned)(32 * warps), 0, stream>>>(rows, D, out, dout,
                                                                                                    delta);
    int rc = (int)cudaGetLastError();
    if (rc) return rc;
    dq_kernel<DT><<<(unsigned)grid_of(p), THREADS, dq_smem(D), stream>>>(*p, q, k, v, dout, lse, delta, dq);
    rc = (int)cudaGetLastError();
    if (rc) return rc;
    dkv_kernel<DT><<<(unsigned)grid_of(p), THREADS, dkv_smem(D), stream>>>(*p, q, k, v, dout, lse, delta, dk, dv);
    return (int)cudaGetLastError();
}

/* Shared memory of every kernel fits the 48 KB a launch gets without opting in: the largest,
 * forward at head_dim 128, is (16 + 64) * 129 + 16 * 33 floats = 43 KB. */
static_assert(sizeof(float) * ((ROWS + 2 * FWD_CHUNK) * (ZERO_SPARSE_MAX_HEAD_DIM + 1) + ROWS * (FWD_CHUNK + 1)) <=
                  48 * 1024,
              "forward shared memory");
static_assert(sizeof(float) * ((2 * ROWS + 2 * BWD_CHUNK) * (ZERO_SPARSE_MAX_HEAD_DIM + 1) +
                               2 * ROWS * (BWD_CHUNK + 1) + 2 * BWD_CHUNK) <= 48 * 1024,
              "backward shared memory");

}  // namespace

extern "C" int zero_sparse_attention_forward_cuda(const zero_sparse_attention_problem *p, const void *q, const void *k,
                                                  const void *v, void *out, float *lse, cudaStream_t stream) {
    if (!zero_sparse_attention_valid(p) || !p->row_ptr || !p->col_idx) return -1;
    if (p->batch == 0 || p->seq == 0) return 0;
    if (!q || !k || !v || !out || !lse || grid_of(p) < 0) return -1;
    switch (p->dtype) {
    case ZERO_F32: return forward_as<ZERO_F32>(p, q, k, v, out, lse, stream);
    case ZERO_BF16: return forward_as<ZERO_BF16>(p, q, k, v, out, lse, stream);
    default: return forward_as<ZERO_F16>(p, q, k, v, out, lse, stream);
    }
}

extern "C" int zero_sparse_attention_backward_cuda(const zero_sparse_attention_problem *p, const void *q,
                                                   const void *k, const void *v, const void *out, const void *dout,
                                                   const float *lse, void *dq, void *dk, void *dv, float *delta,
                                                   cudaStream_t stream) {
    if (!zero_sparse_attention_valid(p) || !p->row_ptr || !p->col_idx || !p->col_ptr || !p->row_idx) return -1;
    if (p->batch == 0 || p->seq == 0) return 0;
    if (!q || !k || !v || !out || !dout || !lse || !dq || !dk || !dv || !delta || grid_of(p) < 0) return -1;
    if ((p->batch * p->heads * p->seq + 7) / 8 > 0x7fffffffLL) return -1;
    switch (p->dtype) {
    case ZERO_F32: return backward_as<ZERO_F32>(p, q, k, v, out, dout, lse, dq, dk, dv, delta, stream);
    case ZERO_BF16: return backward_as<ZERO_BF16>(p, q, k, v, out, dout, lse, dq, dk, dv, delta, stream);
    default: return backward_as<ZERO_F16>(p, q, k, v, out, dout, lse, dq, dk, dv, delta, stream);
    }
}

/* Fused Adam / AdamW: the multi-tensor kernel over fp32 state, and the one-buffer kernel over
 * the low-precision state formats. See fused_adam.h for the contracts, adam/adam_math.h for the
 * math and adam/adam_formats.h for the formats.
 *
 * [Note: chunk table]
 * Every tensor is cut into chunks of CHUNK elements and every chunk gets one thread block, so a
 * list of a thousand small tensors and a list of one huge tensor both fill the GPU from a single
 * launch. The table that tells a block what to work on travels by value as a kernel argument
 * (kernel arguments live in constant memory, so reading them costs no global load):
 *   - per tensor: its pointers, its element count, and first_block[t], the first block index
 *     that belongs to it (first_block[n] = the launch's grid size);
 *   - a block finds its tensor by binary search over first_block, and its chunk is
 *     blockIdx.x - first_block[t].
 * The table holds MAX_TENSORS tensors and stays under the classic 4 KiB kernel-argument limit,
 * so it works on every CUDA version and driver; a longer list simply takes several launches.
 * Only tensors are counted against the table, not chunks: one launch can cover any number of
 * elements (up to 2^31 - 1 blocks).
 *
 * Within its chunk a block walks with a block-sized stride. When param, exp_avg and exp_avg_sq
 * are 16-byte aligned, each thread moves four elements per step with 16-byte loads and stores;
 * the gradient and the 16-bit copy join that path whatever their own alignment, loaded and
 * stored four-wide when aligned and element by element when not. (A 16-bit copy at an arbitrary
 * offset, such as a stage-3 group range of a shard, must not push the fp32 traffic, 14 of every
 * 16 bytes moved, onto the scalar path.) Misaligned fp32 buffers, and the last < 4 elements,
 * go one element at a time.
 *
 * Arithmetic and conversions are the shared ones: zero_adam_element (IEEE sqrt and division
 * whatever the build flags) and common/dtypes.h's roundings, exactly torch's `.to()` for every
 * non-NaN value. Never build with --use_fast_math: it would flush fp16 subnormals to zero. */
#include "adam/fused_adam.h"

#include <cuda_runtime.h>
#include <stdint.h>

#include "adam/adam_formats.h"
#include "adam/adam_math.h"
#include "common/dtypes.h"

namespace {

constexpr int MAX_TENSORS = 64;
constexpr int CHUNK = 16384;
constexpr int THREADS = 256;
constexpr int NO_COPY = -1; /* out16 dtype code meaning "no 16-bit copy" */

struct AdamTable {
    float *params[MAX_TENSORS];
    const void *grads[MAX_TENSORS];
    float *exp_avgs[MAX_TENSORS];
    float *exp_avg_sqs[MAX_TENSORS];
    void *out16[MAX_TENSORS];
    int64_t numels[MAX_TENSORS];
    int32_t first_block[MAX_TENSORS + 1];
    int n;
};

static_assert(sizeof(AdamTable) + sizeof(zero_adam_coeffs) <= 4000, "kernel arguments must stay under 4 KiB");

/* ---------------------------------------------------------------------------- element access */

__device__ __forceinline__ bool aligned(const void *p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (uintptr_t)(bytes - 1)) == 0;
}

/* Four consecutive grads from element i (a multiple of 4): one 16- or 8-byte load when `vec`
 * (the buffer is aligned for it), else four element loads. */
template <int GD>
__device__ __forceinline__ float4 load_grad4(const void *g, int i, bool vec) {
    if (!vec)
        return make_float4(zero_load_f32(g, GD, i), zero_load_f32(g, GD, i + 1), zero_load_f32(g, GD, i + 2),
                           zero_load_f32(g, GD, i + 3));
    if (GD == ZERO_F32) return reinterpret_cast<const float4 *>(g)[i / 4];
    const uint2 raw = reinterpret_cast<const uint2 *>(g)[i / 4];
    const uint16_t h[4] = {(uint16_t)(raw.x & 0xffffu), (uint16_t)(raw.x >> 16), (uint16_t)(raw.y & 0xffffu),
                           (uint16_t)(raw.y >> 16)};
    return make_float4(zero_load_f32(h, GD, 0), zero_load_f32(h, GD, 1), zero_load_f32(h, GD, 2),
                       zero_load_f32(h, GD, 3));
}

/* Round four updated params to OD and store them at element i: one 8-byte store when `vec`,
 * else four 2-byte stores. */
template <int OD>
__device__ __forceinline__ void store_out4(uint16_t *out, int i, float4 p, bool vec) {
    uint16_t h[4];
    zero_store_f32(h, OD, 0, p.x);
    zero_store_f32(h, OD, 1, p.y);
    zero_store_f32(h, OD, 2, p.z);
    zero_store_f32(h, OD, 3, p.w);
    if (vec) {
        reinterpret_cast<uint2 *>(out)[i / 4] = make_uint2((uint32_t)h[0] | ((uint32_t)h[1] << 16),
                                                           (uint32_t)h[2] | ((uint32_t)h[3] << 16));
    } else {
        for (int k = 0; k < 4; k++) out[i + k] = h[k];
    }
}

/* ---------------------------------------------------------------------------- the kernel */

/* Index of the tensor that block b belongs to: the last t with first_block[t] <= b. */
__device__ __forceinline__ int tensor_of_block(const int32_t *first_block, int n, int32_t b) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_block[mid] <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

template <int GD, int OD>
__global__ void __launch_bounds__(THREADS) adam_kernel(const AdamTable table, const zero_adam_coeffs c) {
    const int t = tensor_of_block(table.first_block, table.n, (int32_t)blockIdx.x);
    const int64_t begin = (int64_t)((int32_t)blockIdx.x - table.first_block[t]) * CHUNK;
    const int64_t left = table.numels[t] - begin;
    const int count = left < CHUNK ? (int)left : CHUNK;

    constexpr int gsize = GD == ZERO_F32 ? 4 : 2;
    float *__restrict__ p = table.params[t] + begin;
    float *__restrict__ m = table.exp_avgs[t] + begin;
    float *__restrict__ v = table.exp_avg_sqs[t] + begin;
    const void *g = static_cast<const char *>(table.grads[t]) + begin * gsize;
    uint16_t *out = nullptr;
    if (OD != NO_COPY && table.out16[t] != nullptr) out = static_cast<uint16_t *>(table.out16[t]) + begin;

    int done = 0;
    if (aligned(p, 16) && aligned(m, 16) && aligned(v, 16)) {
        /* the same for every thread of the block: no divergence */
        const bool g_vec = aligned(g, 4 * gsize);
        const bool out_vec = out != nullptr && aligned(out, 8);
        const int vec_end = count & ~3;
        for (int i = 4 * (int)threadIdx.x; i < vec_end; i += 4 * THREADS) {
            float4 p4 = reinterpret_cast<float4 *>(p)[i / 4];
            float4 m4 = reinterpret_cast<float4 *>(m)[i / 4];
            float4 v4 = reinterpret_cast<float4 *>(v)[i / 4];
            const float4 g4 = load_grad4<GD>(g, i, g_vec);
            zero_adam_element(&p4.x, &m4.x, &v4.x, g4.x, &c);
            zero_adam_element(&p4.y, &m4.y, &v4.y, g4.y, &c);
            zero_adam_element(&p4.z, &m4.z, &v4.z, g4.z, &c);
            zero_adam_element(&p4.w, &m4.w, &v4.w, g4.w, &c);
            reinterpret_cast<float4 *>(p)[i / 4] = p4;
            reinterpret_cast<float4 *>(m)[i / 4] = m4;
            reinterpret_cast<float4 *>(v)[i / 4] = v4;
            if (OD != NO_COPY && out != nullptr) store_out4<OD>(out, i, p4, out_vec);
        }
        done = vec_end;
    }
    for (int i = done + (int)threadIdx.x; i < count; i += THREADS) {
        float pi = p[i], mi = m[i], vi = v[i];
        zero_adam_element(&pi, &mi, &vi, zero_load_f32(g, GD, i), &c);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (OD != NO_COPY && out != nullptr) zero_store_f32(out, OD, i, pi);
    }
}

/* ---------------------------------------------------------------------------- host side */

template <int GD, int OD>
int launch_all(int n, float *const *params, const void *const *grads, float *const *exp_avgs,
               float *const *exp_avg_sqs, void *const *out16, const int64_t *numels, const zero_adam_coeffs &c,
               cudaStream_t stream) {
    AdamTable table;
    table.n = 0;
    table.first_block[0] = 0;
    auto flush = [&]() -> int {
        if (table.n == 0) return 0;
        const int32_t blocks = table.first_block[table.n];
        adam_kernel<GD, OD><<<blocks, THREADS, 0, stream>>>(table, c);
        table.n = 0;
        table.first_block[0] = 0;
        const cudaError_t err = cudaGetLastError();
        return err == cudaSuccess ? 0 : (int)err;
    };
    for (int i = 0; i < n; i++) {
        if (numels[i] == 0) continue;
        const int64_t blocks = (numels[i] + CHUNK - 1) / CHUNK;
        if (table.n == MAX_TENSORS || (int64_t)table.first_block[table.n] + blocks > INT32_MAX) {
            const int rc = flush();
            if (rc != 0) return rc;
        }
        const int k = table.n++;
        table.params[k] = params[i];
        table.grads[k] = grads[i];
        table.exp_avgs[k] = exp_avgs[i];
        table.exp_avg_sqs[k] = exp_avg_sqs[i];
        table.out16[k] = out16 != nullptr ? out16[i] : nullptr;
        table.numels[k] = numels[i];
        table.first_block[k + 1] = table.first_block[k] + (int32_t)blocks;
    }
    return flush();
}

template <int GD>
int launch_for_grad(int32_t out16_dtype, int n, float *const *params, const void *const *grads,
                    float *const *exp_avgs, float *const *exp_avg_sqs, void *const *out16,
                    const int64_t *numels, const zero_adam_coeffs &c, cudaStream_t stream) {
    if (out16 == nullptr)
        return launch_all<GD, NO_COPY>(n, params, grads, exp_avgs, exp_avg_sqs, nullptr, numels, c, stream);
    if (out16_dtype == ZERO_F16)
        return launch_all<GD, ZERO_F16>(n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, c, stream);
    return launch_all<GD, ZERO_BF16>(n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, c, stream);
}

/* ---------------------------------------------------------------------------- state formats */

/* [Note: state formats on the GPU]
 * zero_fused_adam_step_fmt gives, element for element, the bits of zero_adam_block_ref
 * (adam/adam_formats.h) applied block by block. One thread per element, one thread block of
 * ZERO_Q8_BLOCK threads per block of that reference (blocks start at the buffer's element 0), for
 * every format, so a thread finds its element and its block's scales from its indices alone.
 *
 * A thread runs the reference's own per-element step, zero_adam_fmt_element (ZERO_HD): widen the
 * stored master and moments (8-bit codes with the block's current scales), zero_adam_element,
 * store the master (bf16: stochastically with the word of its global index fmt->index + i, or to
 * nearest even), the 16-bit copy, and fp32 / bf16 moments. The formats are template arguments
 * written into the thread's copy of the format, so their branches fold away.
 *
 * 8-bit codes need the block's largest |m| and v before any code can be written (the reference's
 * zero_q8_block_store): a warp-shuffle max, then one step through shared memory. fmaxf is exact
 * and ignores NaN, so the result is the reference's whatever the order (only its exponent is
 * used, and +0 and -0 give the same). Thread 0 turns the two maxima into exponents with
 * zero_q8_exponent and writes the block's scales (every thread read the old ones before the
 * barrier), then every thread encodes its element with the header's encoders.
 *
 * One element per thread keeps every access coalesced at any alignment; with 1 to 4 bytes per
 * state element the kernel is bound by memory traffic, not by its arithmetic. The all-fp32 format
 * takes zero_fused_adam's four-wide kernel, which computes the same bits.
 *
 * nvcc contracts a product followed by an addition into one fma (on by default, as in torch's
 * builds). The formats add no such pair whose product is inexact: a decoded m is a code's
 * magnitude (at most 4 significant bits) times a power-of-two scale, exact, and the code of a
 * small magnitude is r * 2^k + 0.5 with r * 2^k exact. */

/* The arguments of one zero_fused_adam_step_fmt launch (kernel arguments, as the chunk table). */
struct FmtArgs {
    int64_t n;
    void *p;        /* master */
    const void *g;  /* gradient, of dtype gd */
    void *m, *v;    /* moments */
    float *ms, *vs; /* 8-bit codes: one scale per block */
    void *out;      /* 16-bit copy, when od != ZERO_F32 (zero_adam_block_ref's convention) */
    int32_t gd, od;
    zero_adam_format fmt;
    zero_sr_key key; /* zero_sr_key_of(fmt.seed, step) */
};

constexpr int Q8_WARPS = ZERO_Q8_BLOCK / 32;

/* The block's scales from its largest new |m| and v, then each live thread's codes. Every thread
 * of the block calls this (the dead ones of the last block with live = false). */
__device__ __forceinline__ void store_q8_block(const FmtArgs &a, int64_t i, bool live, float mi, float vi) {
    __shared__ float warp_max[2][Q8_WARPS];
    __shared__ float inv_scale[2];
    float am = live ? fabsf(mi) : 0.0f, av = live ? vi : 0.0f;
    for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, lane_mask));
        av = fmaxf(av, __shfl_xor_sync(0xffffffffu, av, lane_mask));
    }
    if (threadIdx.x % 32 == 0) {
        warp_max[0][threadIdx.x / 32] = am;
        warp_max[1][threadIdx.x / 32] = av;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mmax = 0.0f, vmax = 0.0f;
        for (int w = 0; w < Q8_WARPS; w++) {
            mmax = fmaxf(mmax, warp_max[0][w]);
            vmax = fmaxf(vmax, warp_max[1][w]);
        }
        const uint32_t me = zero_q8_exponent(mmax), ve = zero_q8_exponent(vmax);
        a.ms[blockIdx.x] = zero_q8_scale(me);
        a.vs[blockIdx.x] = zero_q8_scale(ve);
        inv_scale[0] = zero_q8_inv_scale(me);
        inv_scale[1] = zero_q8_inv_scale(ve);
    }
    __syncthreads();
    if (live) {
        static_cast<uint8_t *>(a.m)[i] = zero_q8_encode_m(mi, inv_scale[0]);
        static_cast<uint8_t *>(a.v)[i] = zero_q8_encode_v(vi, inv_scale[1]);
    }
}

/* One element per thread; see [Note: state formats on the GPU]. PD: the master's format
 * (ZERO_F32 / ZERO_BF16), SD: the moments' (ZERO_F32 / ZERO_BF16 / ZERO_Q8). */
template <int PD, int SD>
__global__ void __launch_bounds__(ZERO_Q8_BLOCK) adam_fmt_kernel(const FmtArgs a, const zero_adam_coeffs c) {
    zero_adam_format fmt = a.fmt;
    fmt.master_dtype = PD;
    fmt.state_dtype = SD;
    const int64_t i = (int64_t)blockIdx.x * ZERO_Q8_BLOCK + (int64_t)threadIdx.x;
    const bool live = i < a.n;
    float mi = 0.0f, vi = 0.0f; /* 8-bit states: the new moments, until the block's scales are known */
    if (live) {
        const float ms = SD == ZERO_Q8 ? a.ms[blockIdx.x] : 0.0f, vs = SD == ZERO_Q8 ? a.vs[blockIdx.x] : 0.0f;
        zero_adam_fmt_element(i, a.p, a.g, a.gd, a.m, a.v, ms, vs, a.out, a.od, &c, &fmt, &a.key, &mi, &vi);
    }
    if (SD == ZERO_Q8) store_q8_block(a, i, live, mi, vi); /* the whole block, live or not */
}

template <int PD, int SD>
int launch_fmt(const FmtArgs &a, const zero_adam_coeffs &c, cudaStream_t stream) {
    const int64_t blocks = (a.n + ZERO_Q8_BLOCK - 1) / ZERO_Q8_BLOCK;
    adam_fmt_kernel<PD, SD><<<(unsigned)blocks, ZERO_Q8_BLOCK, 0, stream>>>(a, c);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? 0 : (int)err;
}

}  // namespace

extern "C" int zero_fused_adam(int n, float *const *params, const void *const *grads, int32_t grad_dtype,
                               float *const *exp_avgs, float *const *exp_avg_sqs, void *const *out16,
                               int32_t out16_dtype, const int64_t *numels, const zero_adam_config *cfg,
                               cudaStream_t stream) {
    /* Everything is checked before the first launch, so a bad call changes nothing. */
    if (n < 0 || !zero_adam_config_ok(cfg)) return -1;
    if (grad_dtype != ZERO_F32 && grad_dtype != ZERO_F16 && grad_dtype != ZERO_BF16) return -1;
    if (out16 != nullptr && out16_dtype != ZERO_F16 && out16_dtype != ZERO_BF16) return -1;
    if (n > 0 && (params == nullptr || grads == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr ||
                  numels == nullptr))
        return -1;
    for (int i = 0; i < n; i++) {
        if (numels[i] < 0 || (int64_t)(numels[i] / CHUNK) >= (int64_t)INT32_MAX) return -1;
        if (numels[i] > 0 && (params[i] == nullptr || grads[i] == nullptr || exp_avgs[i] == nullptr ||
                              exp_avg_sqs[i] == nullptr))
            return -1;
    }
    const zero_adam_coeffs c = zero_adam_coeffs_of(cfg);
    switch (grad_dtype) {
    case ZERO_F16:
        return launch_for_grad<ZERO_F16>(out16_dtype, n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, c, stream);
    case ZERO_BF16:
        return launch_for_grad<ZERO_BF16>(out16_dtype, n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, c, stream);
    default:
        return launch_for_grad<ZERO_F32>(out16_dtype, n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, c, stream);
    }
}

extern "C" int zero_fused_adam_step_fmt(int64_t n, void *param, const void *grad, int32_t grad_dtype, void *exp_avg,
                                        void *exp_avg_sq, float *m_scale, float *v_scale, void *out16,
                                        int32_t out16_dtype, const zero_adam_config *cfg, const zero_adam_format *fmt,
                                        cudaStream_t stream) {
    /* Everything is checked before the launch, so a bad call changes nothing. */
    if (n < 0 || !zero_adam_config_ok(cfg) || fmt == nullptr) return -1;
    const int32_t pd = fmt->master_dtype, sd = fmt->state_dtype;
    if (pd != ZERO_F32 && pd != ZERO_BF16) return -1;
    if (sd != ZERO_F32 && sd != ZERO_BF16 && sd != ZERO_Q8) return -1;
    if (grad_dtype != ZERO_F32 && grad_dtype != ZERO_F16 && grad_dtype != ZERO_BF16) return -1;
    if (out16 != nullptr && out16_dtype != ZERO_F16 && out16_dtype != ZERO_BF16) return -1;
    if (n / ZERO_Q8_BLOCK >= (int64_t)INT32_MAX) return -1; /* one thread block per ZERO_Q8_BLOCK elements */
    if (n == 0) return 0;
    if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) return -1;
    if (sd == ZERO_Q8 && (m_scale == nullptr || v_scale == nullptr)) return -1;

    if (pd == ZERO_F32 && sd == ZERO_F32) {
        float *p = static_cast<float *>(param), *m = static_cast<float *>(exp_avg), *v = static_cast<float *>(exp_avg_sq);
        return zero_fused_adam(1, &p, &grad, grad_dtype, &m, &v, out16 != nullptr ? &out16 : nullptr, out16_dtype, &n,
                               cfg, stream);
    }
    FmtArgs a;
    a.n = n;
    a.p = param;
    a.g = grad;
    a.m = exp_avg;
    a.v = exp_avg_sq;
    a.ms = m_scale;
    a.vs = v_scale;
    a.out = out16;
    a.gd = grad_dtype;
    a.od = out16 != nullptr ? out16_dtype : ZERO_F32;
    a.fmt = *fmt;
    a.key = zero_sr_key_of(fmt->seed, cfg->step);
    const zero_adam_coeffs c = zero_adam_coeffs_of(cfg);
    if (pd == ZERO_F32) {
        if (sd == ZERO_BF16) return launch_fmt<ZERO_F32, ZERO_BF16>(a, c, stream);
        return launch_fmt<ZERO_F32, ZERO_Q8>(a, c, stream);
    }
    if (sd == ZERO_F32) return launch_fmt<ZERO_BF16, ZERO_F32>(a, c, stream);
    if (sd == ZERO_BF16) return launch_fmt<ZERO_BF16, ZERO_BF16>(a, c, stream);
    return launch_fmt<ZERO_BF16, ZERO_Q8>(a, c, stream);
}

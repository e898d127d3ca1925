/* Fused multi-tensor Adam / AdamW. See fused_adam.h for the contract and adam/adam_math.h for
 * the math.
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

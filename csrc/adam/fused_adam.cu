/* Fused multi-tensor Adam / AdamW. See fused_adam.h for the contract and the math.
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
 * Within its chunk a block walks with a block-sized stride. When every pointer of a tensor is
 * aligned for it, each thread moves four elements per step with 16-byte fp32 loads (8-byte loads
 * for 16-bit grads and copies); otherwise, or for the last < 4 elements, one at a time.
 *
 * [Note: fused Adam arithmetic]
 * sqrt and division use __fsqrt_rn / __fdiv_rn, which are IEEE round-to-nearest whatever flags
 * the file is compiled with (--use_fast_math would otherwise turn them into approximations), so
 * the update matches torch's to fp32 round-off. Scalars that depend only on the step (bias
 * corrections, 1 - lr * wd) are computed in double on the host and rounded to fp32 once, as
 * torch does with its Python-float scalars. The 16-bit copy uses the round-to-nearest-even
 * intrinsics, giving exactly what torch's `.to(torch.bfloat16 / torch.float16)` gives on CUDA. */
#include "adam/fused_adam.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

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

/* The per-step scalars, already rounded to fp32. */
struct AdamScalars {
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float eps;
    float weight_decay; /* Adam: added to the grad as weight_decay * p */
    float decay;        /* AdamW: p *= decay, decay = 1 - lr * weight_decay */
    float step_size;    /* lr / (1 - beta1^step) */
    float bc2_sqrt;     /* sqrt(1 - beta2^step) */
    float grad_scale;
    int adamw_mode;
};

static_assert(sizeof(AdamTable) + sizeof(AdamScalars) <= 4000, "kernel arguments must stay under 4 KiB");

/* ---------------------------------------------------------------------------- element access */

__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

template <int DT>
__device__ __forceinline__ float load_grad(const void *g, int i) {
    if (DT == ZERO_F32) return static_cast<const float *>(g)[i];
    const uint16_t h = static_cast<const uint16_t *>(g)[i];
    return DT == ZERO_F16 ? f16_bits_to_f32(h) : bf16_bits_to_f32(h);
}

/* Four consecutive grads starting at element i (a multiple of 4), from an aligned buffer. */
template <int DT>
__device__ __forceinline__ float4 load_grad4(const void *g, int i) {
    if (DT == ZERO_F32) return reinterpret_cast<const float4 *>(g)[i / 4];
    const uint2 raw = reinterpret_cast<const uint2 *>(g)[i / 4];
    const uint16_t h[4] = {(uint16_t)(raw.x & 0xffffu), (uint16_t)(raw.x >> 16), (uint16_t)(raw.y & 0xffffu),
                           (uint16_t)(raw.y >> 16)};
    if (DT == ZERO_F16)
        return make_float4(f16_bits_to_f32(h[0]), f16_bits_to_f32(h[1]), f16_bits_to_f32(h[2]), f16_bits_to_f32(h[3]));
    return make_float4(bf16_bits_to_f32(h[0]), bf16_bits_to_f32(h[1]), bf16_bits_to_f32(h[2]), bf16_bits_to_f32(h[3]));
}

template <int OD>
__device__ __forceinline__ uint16_t round16(float x) {
    if (OD == ZERO_F16) return __half_as_ushort(__float2half_rn(x));
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

/* ---------------------------------------------------------------------------- the update */

/* One Adam step on one element; p, m, v are updated in place. */
__device__ __forceinline__ void adam_element(float &p, float &m, float &v, float g, const AdamScalars &s) {
    g = __fdiv_rn(g, s.grad_scale);
    if (s.adamw_mode)
        p = p * s.decay;
    else
        g = g + s.weight_decay * p;
    m = s.beta1 * m + s.one_minus_beta1 * g;
    v = s.beta2 * v + s.one_minus_beta2 * g * g;
    const float denom = __fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt) + s.eps;
    p = p - s.step_size * __fdiv_rn(m, denom);
}

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

__device__ __forceinline__ bool aligned(const void *p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (uintptr_t)(bytes - 1)) == 0;
}

template <int GD, int OD>
__global__ void __launch_bounds__(THREADS) adam_kernel(const AdamTable table, const AdamScalars s) {
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
    if (aligned(p, 16) && aligned(m, 16) && aligned(v, 16) && aligned(g, 4 * gsize) && (out == nullptr || aligned(out, 8))) {
        const int vec_end = count & ~3;
        for (int i = 4 * (int)threadIdx.x; i < vec_end; i += 4 * THREADS) {
            float4 p4 = reinterpret_cast<float4 *>(p)[i / 4];
            float4 m4 = reinterpret_cast<float4 *>(m)[i / 4];
            float4 v4 = reinterpret_cast<float4 *>(v)[i / 4];
            const float4 g4 = load_grad4<GD>(g, i);
            adam_element(p4.x, m4.x, v4.x, g4.x, s);
            adam_element(p4.y, m4.y, v4.y, g4.y, s);
            adam_element(p4.z, m4.z, v4.z, g4.z, s);
            adam_element(p4.w, m4.w, v4.w, g4.w, s);
            reinterpret_cast<float4 *>(p)[i / 4] = p4;
            reinterpret_cast<float4 *>(m)[i / 4] = m4;
            reinterpret_cast<float4 *>(v)[i / 4] = v4;
            if (OD != NO_COPY && out != nullptr) {
                uint2 o;
                o.x = (uint32_t)round16<OD>(p4.x) | ((uint32_t)round16<OD>(p4.y) << 16);
                o.y = (uint32_t)round16<OD>(p4.z) | ((uint32_t)round16<OD>(p4.w) << 16);
                reinterpret_cast<uint2 *>(out)[i / 4] = o;
            }
        }
        done = vec_end;
    }
    for (int i = done + (int)threadIdx.x; i < count; i += THREADS) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_element(pi, mi, vi, load_grad<GD>(g, i), s);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (OD != NO_COPY && out != nullptr) out[i] = round16<OD>(pi);
    }
}

/* ---------------------------------------------------------------------------- host side */

AdamScalars scalars_of(const zero_fused_adam_config &o) {
    const double bc1 = o.bias_correction ? 1.0 - pow(o.beta1, (double)o.step) : 1.0;
    const double bc2 = o.bias_correction ? 1.0 - pow(o.beta2, (double)o.step) : 1.0;
    AdamScalars s;
    s.beta1 = (float)o.beta1;
    s.one_minus_beta1 = (float)(1.0 - o.beta1);
    s.beta2 = (float)o.beta2;
    s.one_minus_beta2 = (float)(1.0 - o.beta2);
    s.eps = (float)o.eps;
    s.weight_decay = (float)o.weight_decay;
    s.decay = (float)(1.0 - o.lr * o.weight_decay);
    s.step_size = (float)(o.lr / bc1);
    s.bc2_sqrt = (float)sqrt(bc2);
    s.grad_scale = (float)o.grad_scale;
    s.adamw_mode = o.adamw_mode ? 1 : 0;
    return s;
}

bool config_ok(const zero_fused_adam_config *o) {
    if (o == nullptr) return false;
    const bool finite = isfinite(o->lr) && isfinite(o->eps) && isfinite(o->weight_decay) && isfinite(o->grad_scale);
    return finite && o->lr >= 0 && o->beta1 >= 0 && o->beta1 < 1 && o->beta2 >= 0 && o->beta2 < 1 && o->eps >= 0 &&
           o->weight_decay >= 0 && o->grad_scale > 0 && (!o->bias_correction || o->step >= 1);
}

template <int GD, int OD>
int launch_all(int n, float *const *params, const void *const *grads, float *const *exp_avgs,
               float *const *exp_avg_sqs, void *const *out16, const int64_t *numels, const AdamScalars &s,
               cudaStream_t stream) {
    AdamTable table;
    table.n = 0;
    table.first_block[0] = 0;
    auto flush = [&]() -> int {
        if (table.n == 0) return 0;
        const int32_t blocks = table.first_block[table.n];
        adam_kernel<GD, OD><<<blocks, THREADS, 0, stream>>>(table, s);
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
                    const int64_t *numels, const AdamScalars &s, cudaStream_t stream) {
    if (out16 == nullptr)
        return launch_all<GD, NO_COPY>(n, params, grads, exp_avgs, exp_avg_sqs, nullptr, numels, s, stream);
    if (out16_dtype == ZERO_F16)
        return launch_all<GD, ZERO_F16>(n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, s, stream);
    return launch_all<GD, ZERO_BF16>(n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, s, stream);
}

}  // namespace

extern "C" int zero_fused_adam(int n, float *const *params, const void *const *grads, int32_t grad_dtype,
                               float *const *exp_avgs, float *const *exp_avg_sqs, void *const *out16,
                               int32_t out16_dtype, const int64_t *numels, const zero_fused_adam_config *cfg,
                               cudaStream_t stream) {
    /* Everything is checked before the first launch, so a bad call changes nothing. */
    if (n < 0 || !config_ok(cfg)) return -1;
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
    const AdamScalars s = scalars_of(*cfg);
    switch (grad_dtype) {
    case ZERO_F16:
        return launch_for_grad<ZERO_F16>(out16_dtype, n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, s, stream);
    case ZERO_BF16:
        return launch_for_grad<ZERO_BF16>(out16_dtype, n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, s, stream);
    default:
        return launch_for_grad<ZERO_F32>(out16_dtype, n, params, grads, exp_avgs, exp_avg_sqs, out16, numels, s, stream);
    }
}

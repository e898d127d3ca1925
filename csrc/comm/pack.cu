/* CUDA bucket pack/unpack. See pack_cuda.h for the contract (the same as pack.h's).
 *
 * One launch moves a whole list of tensors, using the chunk table of [Note: chunk table] in
 * adam/fused_adam.cu: every tensor is cut into chunks of CHUNK elements, each chunk is one thread
 * block, and a block finds its tensor by binary search over the per-tensor first block index
 * carried in the kernel argument.
 *
 * Same-dtype moves (and opaque bytes) are plain byte copies, 16 bytes per thread when both ends
 * are 16-byte aligned and narrower otherwise. Casts go element by element through the device
 * copies of the conversions in common/dtypes.h below, which are bit-for-bit those of the CPU
 * kernel (including the NaN patterns, where the hardware's cvt instructions would differ), so
 * the CPU and CUDA ops are interchangeable. */
#include "comm/pack_cuda.h"

#include <cuda_runtime.h>
#include <stdint.h>

#include "common/dtypes.h"

namespace {

constexpr int MAX_TENSORS = 112;
constexpr int CHUNK = 16384; /* elements of the tensor's dtype (bytes for ZERO_BYTES) */
constexpr int THREADS = 256;

struct PackTable {
    char *tensors[MAX_TENSORS];
    int64_t numels[MAX_TENSORS];
    int64_t offsets[MAX_TENSORS];
    int32_t first_block[MAX_TENSORS + 1];
    int8_t dtypes[MAX_TENSORS];
    char *bucket;
    int32_t bucket_dtype;
    int32_t to_bucket; /* 1: pack (tensors -> bucket); 0: unpack */
    int n;
};

static_assert(sizeof(PackTable) <= 4000, "kernel arguments must stay under 4 KiB");

/* ---------------------------------------------------------------------------- conversions
 * Device twins of common/dtypes.h: same bit manipulation, same results. */

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round half to even */
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in fp32 */
        const float f = __fmul_rn((float)mant, 5.9604644775390625e-8f);
        return sign ? -f : f;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ uint16_t f32_to_f16(float f) {
    uint32_t u = __float_as_uint(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) /* |f| >= 2^16: inf, or NaN */
        return sign | (u > 0x7f800000u ? 0x7e00 : 0x7c00);
    if (u < 0x38800000u) { /* below fp16's smallest normal: let the FPU round at 2^-24 */
        const float a = __fadd_rn(__uint_as_float(u), 0.5f);
        return sign | (uint16_t)(__float_as_uint(a) - 0x3f000000u);
    }
    u += 0xc8000fffu + ((u >> 13) & 1u); /* rebias 127 -> 15, round the dropped bits to even */
    return sign | (uint16_t)(u >> 13);
}

/* ---------------------------------------------------------------------------- moves */

__device__ __forceinline__ bool aligned(const void *p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (uintptr_t)(bytes - 1)) == 0;
}

__device__ __forceinline__ int dtype_size(int dtype) { /* zero_dtype_size, on the device */
    return dtype == ZERO_F32 ? 4 : (dtype == ZERO_F16 || dtype == ZERO_BF16) ? 2 : 1;
}

/* Copy `nbytes` bytes with the widest access both ends allow; the block shares the work. */
template <typename W>
__device__ __forceinline__ void copy_as(char *dst, const char *src, int64_t nbytes) {
    const int64_t words = nbytes / (int64_t)sizeof(W);
    for (int64_t k = threadIdx.x; k < words; k += THREADS)
        reinterpret_cast<W *>(dst)[k] = reinterpret_cast<const W *>(src)[k];
    for (int64_t k = words * (int64_t)sizeof(W) + threadIdx.x; k < nbytes; k += THREADS) dst[k] = src[k];
}

__device__ void copy_bytes(char *dst, const char *src, int64_t nbytes) {
    if (aligned(dst, 16) && aligned(src, 16))
        copy_as<uint4>(dst, src, nbytes);
    else if (aligned(dst, 8) && aligned(src, 8))
        copy_as<uint2>(dst, src, nbytes);
    else if (aligned(dst, 4) && aligned(src, 4))
        copy_as<uint32_t>(dst, src, nbytes);
    else if (aligned(dst, 2) && aligned(src, 2))
        copy_as<uint16_t>(dst, src, nbytes);
    else
        copy_as<uint8_t>(dst, src, nbytes);
}

/* Convert `count` elements between two different float dtypes. */
__device__ void convert(char *dst, int dd, const char *src, int sd, int count) {
    const uint16_t *s16 = reinterpret_cast<const uint16_t *>(src);
    const float *s32 = reinterpret_cast<const float *>(src);
    uint16_t *d16 = reinterpret_cast<uint16_t *>(dst);
    float *d32 = reinterpret_cast<float *>(dst);
    const int i0 = (int)threadIdx.x;
    if (dd == ZERO_F32 && sd == ZERO_BF16) {
        for (int i = i0; i < count; i += THREADS) d32[i] = bf16_to_f32(s16[i]);
    } else if (dd == ZERO_F32 && sd == ZERO_F16) {
        for (int i = i0; i < count; i += THREADS) d32[i] = f16_to_f32(s16[i]);
    } else if (dd == ZERO_BF16 && sd == ZERO_F32) {
        for (int i = i0; i < count; i += THREADS) d16[i] = f32_to_bf16(s32[i]);
    } else if (dd == ZERO_F16 && sd == ZERO_F32) {
        for (int i = i0; i < count; i += THREADS) d16[i] = f32_to_f16(s32[i]);
    } else if (dd == ZERO_BF16 && sd == ZERO_F16) {
        for (int i = i0; i < count; i += THREADS) d16[i] = f32_to_bf16(f16_to_f32(s16[i]));
    } else { /* F16 from BF16 */
        for (int i = i0; i < count; i += THREADS) d16[i] = f32_to_f16(bf16_to_f32(s16[i]));
    }
}

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

__global__ void __launch_bounds__(THREADS) pack_kernel(const PackTable table) {
    const int t = tensor_of_block(table.first_block, table.n, (int32_t)blockIdx.x);
    const int64_t begin = (int64_t)((int32_t)blockIdx.x - table.first_block[t]) * CHUNK;
    const int64_t left = table.numels[t] - begin;
    const int count = left < CHUNK ? (int)left : CHUNK;

    const int td = table.dtypes[t], bd = table.bucket_dtype;
    const int tsize = dtype_size(td), bsize = dtype_size(bd);
    char *tp = table.tensors[t] + begin * tsize;
    char *bp = table.bucket + (table.offsets[t] + begin) * bsize;
    if (td == bd) {
        if (table.to_bucket)
            copy_bytes(bp, tp, (int64_t)count * tsize);
        else
            copy_bytes(tp, bp, (int64_t)count * tsize);
    } else if (table.to_bucket) {
        convert(bp, bd, tp, td, count);
    } else {
        convert(tp, td, bp, bd, count);
    }
}

/* ---------------------------------------------------------------------------- host side */

bool supported(int a, int b) {
    if (a < ZERO_F32 || a > ZERO_BYTES || b < ZERO_F32 || b > ZERO_BYTES) return false;
    return (a == ZERO_BYTES) == (b == ZERO_BYTES);
}

int copy_all(int n, void *const *tensors, const int32_t *dtypes, const int64_t *numels, const int64_t *offsets,
             void *bucket, int32_t bucket_dtype, cudaStream_t stream, int to_bucket) {
    if (n < 0) return -1;
    for (int i = 0; i < n; i++) {
        if (!supported(dtypes[i], bucket_dtype) || numels[i] < 0 || offsets[i] < 0) return -1;
        if (numels[i] / CHUNK >= (int64_t)INT32_MAX) return -1;
        if (numels[i] > 0 && (tensors[i] == nullptr || bucket == nullptr)) return -1;
    }
    PackTable table;
    table.n = 0;
    table.first_block[0] = 0;
    table.bucket = static_cast<char *>(bucket);
    table.bucket_dtype = bucket_dtype;
    table.to_bucket = to_bucket;
    auto flush = [&]() -> int {
        if (table.n == 0) return 0;
        pack_kernel<<<table.first_block[table.n], THREADS, 0, stream>>>(table);
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
        table.tensors[k] = static_cast<char *>(tensors[i]);
        table.numels[k] = numels[i];
        table.offsets[k] = offsets[i];
        table.dtypes[k] = (int8_t)dtypes[i];
        table.first_block[k + 1] = table.first_block[k] + (int32_t)blocks;
    }
    return flush();
}

}  // namespace

extern "C" int zero_pack_cuda(int n, const void *const *srcs, const int32_t *src_dtypes, const int64_t *numels,
                              const int64_t *offsets, void *bucket, int32_t bucket_dtype, cudaStream_t stream) {
    return copy_all(n, const_cast<void *const *>(srcs), src_dtypes, numels, offsets, bucket, bucket_dtype, stream, 1);
}

extern "C" int zero_unpack_cuda(int n, void *const *dsts, const int32_t *dst_dtypes, const int64_t *numels,
                                const int64_t *offsets, const void *bucket, int32_t bucket_dtype, cudaStream_t stream) {
    return copy_all(n, dsts, dst_dtypes, numels, offsets, const_cast<void *>(bucket), bucket_dtype, stream, 0);
}

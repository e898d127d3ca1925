/* 1-bit pack and unpack-mean on the GPU (see onebit/onebit_cuda.h and [Note: 1-bit compression]).
 *
 * pack: one thread block per compression block. Pass 1: every thread adds its elements of x into
 * the error buffer (y = err + x, the same fp32 addition as the reference, so the same bits) and
 * sums their squares; a block reduction gives the scale. Pass 2: each warp takes 32 consecutive
 * elements at a time; __ballot_sync(y >= 0) is their 32 sign bits in element order, written as
 * four bytes (one at a time at the ragged end), and each thread writes its new error.
 * unpack_mean: one thread per element, looping over the k messages.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "onebit/onebit_cuda.h"

namespace {

constexpr int THREADS = 256;

__global__ void pack_kernel(int64_t n, const float *__restrict__ x, float *__restrict__ err, int64_t block,
                            uint8_t *__restrict__ bits, float *__restrict__ scales) {
    const int64_t lo = (int64_t)blockIdx.x * block;
    const int64_t len = (lo + block <= n) ? block : n - lo;
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
        float y = err[lo + i] + x[lo + i];
        err[lo + i] = y;
        sum += y * y;
    }
    __shared__ float partial[THREADS / 32];
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    __shared__ float scale;
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < THREADS / 32; w++) total += partial[w];
        scale = sqrtf(total / (float)len);
        scales[blockIdx.x] = scale;
    }
    __syncthreads();
    const float s = scale;
    for (int64_t base = (int64_t)warp * 32; base < len; base += THREADS) {
        const int64_t i = base + lane;
        const bool inside = i < len;
        const float y = inside ? err[lo + i] : 0.0f;
        const bool pos = inside && y >= 0.0f;
        const unsigned mask = __ballot_sync(0xffffffffu, pos);
        if (inside) err[lo + i] = y - (pos ? s : -s);
        if (lane < 4) {
            const int64_t byte = (lo + base) / 8 + lane;  /* lo and base are multiples of 8 */
            if (base + 8 * lane < len) bits[byte] = (uint8_t)(mask >> (8 * lane));
        }
    }
}

__global__ void unpack_kernel(int64_t k, int64_t n, const uint8_t *__restrict__ bits, const float *__restrict__ scales,
                              int64_t block, float *__restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t row_bytes = (n + 7) / 8, row_scales = (n + block - 1) / block, b = i / block;
    float acc = 0.0f;
    for (int64_t r = 0; r < k; r++) {
        const float s = scales[r * row_scales + b];
        acc += ((bits[r * row_bytes + i / 8] >> (i % 8)) & 1) ? s : -s;
    }
    out[i] = acc / (float)k;
}

}  // namespace

extern "C" int zero_onebit_pack_cuda(int64_t n, const float *x, float *err, int64_t block, uint8_t *bits,
                                     float *scales, cudaStream_t stream) {
    if (n < 0 || block <= 0 || block % 32 || !x || !err || !bits || !scales) return -1;
    if (n == 0) return (int)cudaMemsetAsync(scales, 0, sizeof(float), stream);
    const int64_t blocks = (n + block - 1) / block;
    if (blocks > 0x7fffffff) return -1; /* beyond one grid */
    pack_kernel<<<(unsigned)blocks, THREADS, 0, stream>>>(n, x, err, block, bits, scales);
    return (int)cudaGetLastError();
}

extern "C" int zero_onebit_unpack_mean_cuda(int64_t k, int64_t n, const uint8_t *bits, const float *scales,
                                            int64_t block, float *out, cudaStream_t stream) {
    if (k <= 0 || n < 0 || block <= 0 || !bits || !scales || !out) return -1;
    if (n == 0) return 0;
    if ((n + THREADS - 1) / THREADS > 0x7fffffff) return -1; /* beyond one grid */
    unpack_kernel<<<(unsigned)((n + THREADS - 1) / THREADS), THREADS, 0, stream>>>(k, n, bits, scales, block, out);
    return (int)cudaGetLastError();
}

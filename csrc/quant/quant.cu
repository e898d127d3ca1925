/* qwZ's weight blocks on the GPU (see quant/quant.h).
 *
 * quantize: one thread block of ZERO_QW_BLOCK threads per block of elements, one element per
 * thread: the block's amax by warp shuffles and shared memory (keeping a NaN, as the CPU path
 * does), then each thread writes its code; the first thread writes the scale. The max is exact
 * in any order, so the bits are the CPU's.
 * dequantize: one thread per element of the k messages.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "quant/quant.h"
#include "quant/quant_cuda.h"

namespace {

constexpr int THREADS = ZERO_QW_BLOCK;

template <int DTYPE>
__global__ void quantize_kernel(int64_t n, const void *__restrict__ x, uint8_t *__restrict__ msg) {
    const int64_t lo = (int64_t)blockIdx.x * ZERO_QW_BLOCK, i = lo + threadIdx.x;
    const float v = i < n ? zero_load_f32(x, DTYPE, i) : 0.0f;
    float m = fabsf(v);
    for (int offset = 16; offset > 0; offset >>= 1) m = zero_qw_amax(m, __shfl_down_sync(0xffffffffu, m, offset));
    __shared__ float partial[THREADS / 32];
    __shared__ float scale;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float top = 0.0f;
        for (int w = 0; w < THREADS / 32; w++) top = zero_qw_amax(top, partial[w]);
        scale = top / 127.0f;
        float *scales = (float *)(msg + zero_qw_codes_bytes(n));
        scales[blockIdx.x] = scale;
    }
    __syncthreads();
    if (i < n) ((int8_t *)msg)[i] = zero_qw_code(v, scale);
    else if (i < zero_qw_codes_bytes(n)) msg[i] = 0;
}

template <int DTYPE>
__global__ void dequantize_kernel(int64_t k, int64_t n, const uint8_t *__restrict__ msgs, void *__restrict__ out) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= k * n) return;
    const int64_t r = j / n, i = j % n;
    const uint8_t *msg = msgs + r * zero_qw_message_bytes(n);
    const float s = ((const float *)(msg + zero_qw_codes_bytes(n)))[i / ZERO_QW_BLOCK];
    zero_store_f32(out, DTYPE, j, (float)((const int8_t *)msg)[i] * s);
}

}  // namespace

extern "C" int zero_qw_quantize_cuda(int64_t n, const void *x, int dtype, uint8_t *msg, cudaStream_t stream) {
    if (n < 0 || (n && (!x || !msg))) return -1;
    if (n == 0) return 0;
    const int64_t blocks = zero_qw_blocks(n); /* the codes' padding lies in the last block */
    if (blocks > 0x7fffffff) return -1; /* beyond one grid */
    switch (dtype) {
    case ZERO_F32: quantize_kernel<ZERO_F32><<<(unsigned)blocks, THREADS, 0, stream>>>(n, x, msg); break;
    case ZERO_F16: quantize_kernel<ZERO_F16><<<(unsigned)blocks, THREADS, 0, stream>>>(n, x, msg); break;
    case ZERO_BF16: quantize_kernel<ZERO_BF16><<<(unsigned)blocks, THREADS, 0, stream>>>(n, x, msg); break;
    default: return -1;
    }
    return (int)cudaGetLastError();
}

extern "C" int zero_qw_dequantize_cuda(int64_t k, int64_t n, const uint8_t *msgs, void *out, int dtype,
                                       cudaStream_t stream) {
    if (k < 0 || n < 0 || ((k && n) && (!msgs || !out))) return -1;
    if (k * n == 0) return 0;
    const int64_t grid = (k * n + 255) / 256;
    if (grid > 0x7fffffff) return -1;
    switch (dtype) {
    case ZERO_F32: dequantize_kernel<ZERO_F32><<<(unsigned)grid, 256, 0, stream>>>(k, n, msgs, out); break;
    case ZERO_F16: dequantize_kernel<ZERO_F16><<<(unsigned)grid, 256, 0, stream>>>(k, n, msgs, out); break;
    case ZERO_BF16: dequantize_kernel<ZERO_BF16><<<(unsigned)grid, 256, 0, stream>>>(k, n, msgs, out); break;
    default: return -1;
    }
    return (int)cudaGetLastError();
}

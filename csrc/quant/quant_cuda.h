/* qwZ's weight blocks on the GPU: the contract of quant/quant.h, on device buffers and a CUDA
 * stream. Plain C ABI, no torch headers. Returns 0, -1 for bad arguments, or the CUDA error. */
#ifndef ZERO_QUANT_CUDA_H
#define ZERO_QUANT_CUDA_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

int zero_qw_quantize_cuda(int64_t n, const void *x, int dtype, uint8_t *msg, cudaStream_t stream);
int zero_qw_dequantize_cuda(int64_t k, int64_t n, const uint8_t *msgs, void *out, int dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif

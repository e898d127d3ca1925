/* 1-bit pack and unpack-mean on the GPU: the contract of onebit/onebit.h, on device buffers and a
 * CUDA stream. Plain C ABI, no torch headers. Returns 0, -1 for bad arguments, or the CUDA error. */
#ifndef ZERO_ONEBIT_CUDA_H
#define ZERO_ONEBIT_CUDA_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

int zero_onebit_pack_cuda(int64_t n, const float *x, float *err, int64_t block, uint8_t *bits, float *scales,
                          cudaStream_t stream);
int zero_onebit_unpack_mean_cuda(int64_t k, int64_t n, const uint8_t *bits, const float *scales, int64_t block,
                                 float *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif

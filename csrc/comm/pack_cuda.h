/* CUDA bucket pack/unpack: the device twin of comm/pack.h, with the same contract.
 *
 * Tensor i holds numels[i] contiguous elements of its own dtype at device address srcs[i] /
 * dsts[i] and occupies elements [offsets[i], offsets[i] + numels[i]) of the device bucket; gaps
 * between tensors are left untouched. fp32, fp16 and bf16 convert among themselves (round to
 * nearest even, bit for bit what the CPU kernel writes, NaN and subnormals included);
 * ZERO_BYTES tensors are copied only to and from a ZERO_BYTES bucket, with numels and offsets
 * counted in bytes. The whole list goes in one launch (several only for very long lists), queued
 * on `stream`; the host arrays may be freed as soon as the call returns.
 *
 * Returns 0 when the copy was queued, -1 for an unsupported dtype pair or a negative size or
 * offset (checked for every tensor before anything is launched), or a positive cudaError_t from a
 * failed launch. Plain C ABI, no torch headers. */
#ifndef ZERO_COMM_PACK_CUDA_H
#define ZERO_COMM_PACK_CUDA_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

int zero_pack_cuda(int n, const void *const *srcs, const int32_t *src_dtypes, const int64_t *numels,
                   const int64_t *offsets, void *bucket, int32_t bucket_dtype, cudaStream_t stream);

int zero_unpack_cuda(int n, void *const *dsts, const int32_t *dst_dtypes, const int64_t *numels,
                     const int64_t *offsets, const void *bucket, int32_t bucket_dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif

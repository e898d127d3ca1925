/* Bucket pack/unpack: gather a list of tensors into one contiguous bucket and scatter it back,
 * converting between fp32, fp16 and bf16 on the way. These feed the bucketed reduce-scatter
 * (grads -> bucket) and all-gather (bucket -> params).
 *
 * Tensor i holds numels[i] contiguous elements of its own dtype and occupies elements
 * [offsets[i], offsets[i] + numels[i]) of the bucket; gaps between tensors (padding) are
 * left untouched. ZERO_BYTES tensors are copied only to and from a ZERO_BYTES bucket, with
 * numels and offsets counted in bytes. Return 0 on success, -1 for an unsupported dtype pair
 * (checked for every tensor before anything is written). */
#ifndef ZERO_COMM_PACK_H
#define ZERO_COMM_PACK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int zero_pack(int n, const void *const *srcs, const int32_t *src_dtypes, const int64_t *numels,
              const int64_t *offsets, void *bucket, int32_t bucket_dtype, int num_threads);

int zero_unpack(int n, void *const *dsts, const int32_t *dst_dtypes, const int64_t *numels,
                const int64_t *offsets, const void *bucket, int32_t bucket_dtype, int num_threads);

#ifdef __cplusplus
}
#endif
#endif

/* CPU bucket pack/unpack. See pack.h for the contract.
 *
 * The copy is split into chunks of at most CHUNK elements across all tensors, and the chunks are
 * shared among OpenMP threads, so a bucket of one huge tensor and a bucket of a thousand tiny ones
 * both spread over the cores. */
#include "comm/pack.h"

#include <stdlib.h>
#include <string.h>

#include "common/dtypes.h"

#ifdef _OPENMP
#include <omp.h>
#endif

enum { CHUNK = 1 << 16 };

/* Convert `count` elements from `src` (dtype `sd`) to `dst` (dtype `dd`). The loops are written
 * per dtype pair so the compiler vectorises each one without a switch inside. */
static void convert(void *dst, int dd, const void *src, int sd, int64_t count) {
    if (dd == sd) {
        memcpy(dst, src, (size_t)count * (size_t)zero_dtype_size(dd));
        return;
    }
    const uint16_t *s16 = (const uint16_t *)src;
    const float *s32 = (const float *)src;
    uint16_t *d16 = (uint16_t *)dst;
    float *d32 = (float *)dst;
    if (dd == ZERO_F32 && sd == ZERO_BF16) {
        for (int64_t i = 0; i < count; i++) d32[i] = zero_bf16_to_f32(s16[i]);
    } else if (dd == ZERO_F32 && sd == ZERO_F16) {
        for (int64_t i = 0; i < count; i++) d32[i] = zero_f16_to_f32(s16[i]);
    } else if (dd == ZERO_BF16 && sd == ZERO_F32) {
        for (int64_t i = 0; i < count; i++) d16[i] = zero_f32_to_bf16(s32[i]);
    } else if (dd == ZERO_F16 && sd == ZERO_F32) {
        for (int64_t i = 0; i < count; i++) d16[i] = zero_f32_to_f16(s32[i]);
    } else if (dd == ZERO_BF16 && sd == ZERO_F16) {
        for (int64_t i = 0; i < count; i++) d16[i] = zero_f32_to_bf16(zero_f16_to_f32(s16[i]));
    } else { /* F16 from BF16 */
        for (int64_t i = 0; i < count; i++) d16[i] = zero_f32_to_f16(zero_bf16_to_f32(s16[i]));
    }
}

static int supported(int a, int b) {
    if (a < ZERO_F32 || a > ZERO_BYTES || b < ZERO_F32 || b > ZERO_BYTES) return 0;
    return (a == ZERO_BYTES) == (b == ZERO_BYTES);
}

typedef struct {
    int tensor;
    int64_t begin, count;
} chunk;

/* Move elements between n tensors and one bucket, in the direction `to_bucket`. */
static int copy_all(int n, void *const *tensors, const int32_t *dtypes, const int64_t *numels,
                    const int64_t *offsets, void *bucket, int32_t bucket_dtype, int num_threads,
                    int to_bucket) {
    int64_t nchunks = 0;
    for (int i = 0; i < n; i++) {
        if (!supported(dtypes[i], bucket_dtype) || numels[i] < 0 || offsets[i] < 0) return -1;
        nchunks += (numels[i] + CHUNK - 1) / CHUNK;
    }
    if (nchunks == 0) return 0;
    chunk *chunks = (chunk *)malloc((size_t)nchunks * sizeof(chunk));
    if (!chunks) return -2;
    int64_t c = 0;
    for (int i = 0; i < n; i++)
        for (int64_t b = 0; b < numels[i]; b += CHUNK)
            chunks[c++] = (chunk){i, b, numels[i] - b < CHUNK ? numels[i] - b : CHUNK};

    const int bsize = zero_dtype_size(bucket_dtype);
    (void)num_threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads > 0 ? num_threads : omp_get_max_threads()) if (nchunks > 1)
    for (int64_t k = 0; k < nchunks; k++) {
        const chunk ch = chunks[k];
        const int td = dtypes[ch.tensor];
        char *t = (char *)tensors[ch.tensor] + ch.begin * zero_dtype_size(td);
        char *b = (char *)bucket + (offsets[ch.tensor] + ch.begin) * bsize;
        if (to_bucket)
            convert(b, bucket_dtype, t, td, ch.count);
        else
            convert(t, td, b, bucket_dtype, ch.count);
    }
    free(chunks);
    return 0;
}

int zero_pack(int n, const void *const *srcs, const int32_t *src_dtypes, const int64_t *numels,
              const int64_t *offsets, void *bucket, int32_t bucket_dtype, int num_threads) {
    return copy_all(n, (void *const *)srcs, src_dtypes, numels, offsets, bucket, bucket_dtype,
                    num_threads, 1);
}

int zero_unpack(int n, void *const *dsts, const int32_t *dst_dtypes, const int64_t *numels,
                const int64_t *offsets, const void *bucket, int32_t bucket_dtype, int num_threads) {
    return copy_all(n, dsts, dst_dtypes, numels, offsets, (void *)bucket, bucket_dtype, num_threads, 0);
}

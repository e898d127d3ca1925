/* 1-bit pack and unpack-mean on the CPU: a portable path and AVX2 / AVX-512 paths picked at run
 * time (the levels of common/simd.h), OpenMP over blocks. See onebit.h for the contract.
 *
 * Every path computes y = err + x element by element (the same fp32 additions as the torch
 * reference, so the bits are the same), a block's sum of squares (8 or 16 fp32 lanes in the SIMD
 * paths, one double in the scalar path; the rounding differs from torch's within 1e-6 relative),
 * then the bits and the new error in a second pass over the block, which is still in L1 (a block
 * of 1024 floats is 4 KB). */
#include "onebit/onebit.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "common/simd.h"

/* ------------------------------------------------------------------------------ portable */

static float block_scale_scalar(int64_t len, const float *x, float *y) {
    double sum = 0.0; /* one lane: in double, or a block's rounding would reach 1e-5 */
    for (int64_t i = 0; i < len; i++) {
        y[i] = y[i] + x[i];
        sum += (double)y[i] * y[i];
    }
    return (float)sqrt(sum / (double)len);
}

static void block_bits_scalar(int64_t len, float *y, float s, uint8_t *bits) {
    for (int64_t j = 0; j < (len + 7) / 8; j++) {
        uint8_t byte = 0;
        for (int i = 0; i < 8 && 8 * j + i < len; i++) {
            float v = y[8 * j + i];
            int pos = v >= 0.0f;
            byte |= (uint8_t)(pos << i);
            y[8 * j + i] = v - (pos ? s : -s);
        }
        bits[j] = byte;
    }
}

static void unpack_block_scalar(int64_t k, int64_t len, const uint8_t *bits, int64_t row_bytes, const float *scales,
                                int64_t row_scales, float *out) {
    for (int64_t i = 0; i < len; i++) out[i] = 0.0f;
    for (int64_t r = 0; r < k; r++) {
        float s = scales[r * row_scales];
        const uint8_t *b = bits + r * row_bytes;
        for (int64_t i = 0; i < len; i++) out[i] += ((b[i >> 3] >> (i & 7)) & 1) ? s : -s;
    }
    for (int64_t i = 0; i < len; i++) out[i] /= (float)k;
}

#if ZERO_HAVE_X86_SIMD
#include "common/simd_width.h"

/* The SIMD scale's tail: elements i.. of the block, added to the lanes' fp32 sum. */
static float finish_scale(float sum, int64_t i, int64_t len, const float *x, float *y) {
    for (; i < len; i++) {
        y[i] = y[i] + x[i];
        sum += y[i] * y[i];
    }
    return sqrtf(sum / (float)len);
}

/* The lanes' sum of a block's squares. The two widths add their lanes in different orders (AVX2
 * one lane after another, AVX-512 by zv_reduce_add's halving); each keeps its own so that its
 * scales keep their bits. */
ZERO_TARGET_AVX2 static inline __attribute__((always_inline)) float lane_sum_256(__m256 acc) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}
#define lane_sum_512(acc) zv_reduce_add_512(acc)

/* ------------------------------------------------------------------------------ AVX2, AVX-512 */
#define ZV_BITS 256
#include "onebit/onebit_body.h" /* block_scale_avx2, block_bits_avx2, unpack_block_avx2 */
#undef ZV_BITS
#define ZV_BITS 512
#include "onebit/onebit_body.h" /* the same, _avx512 */
#undef ZV_BITS
#endif /* ZERO_HAVE_X86_SIMD */

/* ------------------------------------------------------------------------------ dispatch */

int zero_onebit_pack(int64_t n, const float *x, float *err, int64_t block, uint8_t *bits, float *scales, int simd,
                     int num_threads) {
    if (n < 0 || block <= 0 || block % 16 || !x || !err || !bits || !scales) return ZERO_BAD_ARGUMENT;
    const int level = zero_simd_resolve(simd);
    if (level < 0) return level;
    int64_t blocks = n ? (n + block - 1) / block : 0;
    if (n == 0) scales[0] = 0.0f;
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 8)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * block, len = (lo + block <= n) ? block : n - lo;
        float s;
#if ZERO_HAVE_X86_SIMD
        if (level == ZERO_SIMD_AVX512) {
            s = block_scale_avx512(len, x + lo, err + lo);
            block_bits_avx512(len, err + lo, s, bits + lo / 8);
        } else if (level == ZERO_SIMD_AVX2) {
            s = block_scale_avx2(len, x + lo, err + lo);
            block_bits_avx2(len, err + lo, s, bits + lo / 8);
        } else
#endif
        {
            s = block_scale_scalar(len, x + lo, err + lo);
            block_bits_scalar(len, err + lo, s, bits + lo / 8);
        }
        scales[b] = s;
    }
    return ZERO_OK;
}

int zero_onebit_unpack_mean(int64_t k, int64_t n, const uint8_t *bits, const float *scales, int64_t block, float *out,
                            int simd, int num_threads) {
    if (k <= 0 || n < 0 || block <= 0 || block % 16 || !bits || !scales || !out) return ZERO_BAD_ARGUMENT;
    const int level = zero_simd_resolve(simd);
    if (level < 0) return level;
    int64_t blocks = n ? (n + block - 1) / block : 0, row_bytes = (n + 7) / 8, row_scales = blocks ? blocks : 1;
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 8)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * block, len = (lo + block <= n) ? block : n - lo;
#if ZERO_HAVE_X86_SIMD
        if (level == ZERO_SIMD_AVX512)
            unpack_block_avx512(k, len, bits + lo / 8, row_bytes, scales + b, row_scales, out + lo);
        else if (level == ZERO_SIMD_AVX2)
            unpack_block_avx2(k, len, bits + lo / 8, row_bytes, scales + b, row_scales, out + lo);
        else
#endif
            unpack_block_scalar(k, len, bits + lo / 8, row_bytes, scales + b, row_scales, out + lo);
    }
    return ZERO_OK;
}

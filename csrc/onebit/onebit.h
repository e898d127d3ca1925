/* 1-bit compression with error feedback (see [Note: 1-bit compression] in zero/onebit/compress.py).
 *
 * zero_onebit_pack: y = err + x; per block of `block` elements one scale s = sqrt(mean(y^2));
 *   bit i of byte j = (y[8j + i] >= 0); err = y - (bit ? s : -s). x and err: n fp32; bits:
 *   ceil(n / 8) bytes (the unused high bits of the last byte are 0); scales: ceil(n / block) floats.
 * zero_onebit_unpack_mean: out[i] = mean over r < k of (bit_r(i) ? s_r : -s_r), s_r the scale of i's
 *   block in message r; bits: k rows of ceil(n / 8) bytes, scales: k rows of ceil(n / block).
 * block must be a positive multiple of 16. simd: a ZERO_SIMD_* level of common/simd.h
 * (ZERO_SIMD_BEST for the best available); num_threads <= 0 means the OpenMP default. Returns
 * ZERO_OK (0), or a negative code of common/simd.h before anything is written. */
#ifndef ZERO_ONEBIT_H
#define ZERO_ONEBIT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int zero_onebit_pack(int64_t n, const float *x, float *err, int64_t block, uint8_t *bits, float *scales, int simd,
                     int num_threads);
int zero_onebit_unpack_mean(int64_t k, int64_t n, const uint8_t *bits, const float *scales, int64_t block, float *out,
                            int simd, int num_threads);

#ifdef __cplusplus
}
#endif

#endif

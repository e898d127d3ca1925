/* ZeRO++ qwZ's weight blocks (see [Note: int8 weight blocks] in zero/zeropp/blocks.py).
 *
 * A message of n elements: n int8 codes (padded with zeros to a multiple of 4 bytes), then one
 * fp32 scale per block of ZERO_QW_BLOCK elements (blocks start at the message's first element).
 * scale = amax / 127 over the block (NaN if an element is NaN, inf if one is inf); a code is
 * rint(x / scale) clamped to [-127, 127] (round half to even), 0 where the scale is 0 or not
 * finite. Decoding: (float)code * scale, then rounded to the output's dtype (common/dtypes.h).
 * Every step is one IEEE operation, so the C, CUDA and torch paths give the same bits.
 *
 * zero_qw_quantize: x (n elements of `dtype`: F32/F16/BF16) -> msg (zero_qw_message_bytes(n)).
 * zero_qw_dequantize: k messages of n elements each (rows of zero_qw_message_bytes(n) bytes) ->
 *   out, k * n elements of `dtype`, message r into out[r * n ...].
 * num_threads <= 0 means the OpenMP default. Returns ZERO_OK (0), or a negative code of
 * common/simd.h before anything is written. */
#ifndef ZERO_QUANT_H
#define ZERO_QUANT_H

#include <math.h>
#include <stdint.h>

#include "common/dtypes.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { ZERO_QW_BLOCK = 256 };

static inline ZERO_HD int64_t zero_qw_blocks(int64_t n) { return (n + ZERO_QW_BLOCK - 1) / ZERO_QW_BLOCK; }
static inline ZERO_HD int64_t zero_qw_codes_bytes(int64_t n) { return (n + 3) / 4 * 4; }
static inline ZERO_HD int64_t zero_qw_message_bytes(int64_t n) { return zero_qw_codes_bytes(n) + 4 * zero_qw_blocks(n); }

/* max(|a|, m) that keeps a NaN: once m is NaN it stays NaN. */
static inline ZERO_HD float zero_qw_amax(float m, float a) { return (a > m || a != a) ? a : m; }

/* The code of x in a block of scale s. */
static inline ZERO_HD int8_t zero_qw_code(float x, float s) {
    if (!(s > 0.0f) || !(s <= 3.402823466e38f)) return 0; /* zero, NaN or inf scale */
    float r = rintf(x / s);
    r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
    return (int8_t)r;
}

int zero_qw_quantize(int64_t n, const void *x, int dtype, uint8_t *msg, int num_threads);
int zero_qw_dequantize(int64_t k, int64_t n, const uint8_t *msgs, void *out, int dtype, int num_threads);

#ifdef __cplusplus
}
#endif

#endif

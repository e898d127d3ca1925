/* 1-bit pack and unpack-mean on the CPU: a portable path and AVX2 / AVX-512 paths picked at run
 * time (the levels of adam/cpu_adam.h), OpenMP over blocks. See onebit.h for the contract.
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

#include "adam/cpu_adam.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ZERO_NO_X86_SIMD)
#define ONEBIT_X86 1
#include <immintrin.h>
#else
#define ONEBIT_X86 0
#endif

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

#if ONEBIT_X86
/* The SIMD scale's tail: elements i.. of the block, added to the lanes' fp32 sum. */
static float finish_scale(float sum, int64_t i, int64_t len, const float *x, float *y) {
    for (; i < len; i++) {
        y[i] = y[i] + x[i];
        sum += y[i] * y[i];
    }
    return sqrtf(sum / (float)len);
}

/* ------------------------------------------------------------------------------ AVX2 */
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

TARGET_AVX2 static float block_scale_avx2(int64_t len, const float *x, float *y) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i));
        _mm256_storeu_ps(y + i, v);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return finish_scale(sum, i, len, x, y);
}

TARGET_AVX2 static void block_bits_avx2(int64_t len, float *y, float s, uint8_t *bits) {
    const __m256 zero = _mm256_setzero_ps(), pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
    int64_t j = 0;
    for (; 8 * j + 8 <= len; j++) {
        __m256 v = _mm256_loadu_ps(y + 8 * j);
        __m256 ge = _mm256_cmp_ps(v, zero, _CMP_GE_OQ);
        bits[j] = (uint8_t)_mm256_movemask_ps(ge);
        _mm256_storeu_ps(y + 8 * j, _mm256_sub_ps(v, _mm256_blendv_ps(neg, pos, ge)));
    }
    if (8 * j < len) block_bits_scalar(len - 8 * j, y + 8 * j, s, bits + j);
}

TARGET_AVX2 static void unpack_block_avx2(int64_t k, int64_t len, const uint8_t *bits, int64_t row_bytes,
                                          const float *scales, int64_t row_scales, float *out) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    int64_t full = len / 8 * 8;
    for (int64_t i = 0; i < full; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t r = 0; r < k; r++) {
            float s = scales[r * row_scales];
            __m256i b = _mm256_set1_epi32(bits[r * row_bytes + (i >> 3)]);
            __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), lane_bit));
            acc = _mm256_add_ps(acc, _mm256_blendv_ps(_mm256_set1_ps(-s), _mm256_set1_ps(s), on));
        }
        _mm256_storeu_ps(out + i, _mm256_div_ps(acc, _mm256_set1_ps((float)k)));
    }
    if (full < len) /* the tail, from a byte boundary: the same sums in the same order */
        unpack_block_scalar(k, len - full, bits + full / 8, row_bytes, scales, row_scales, out + full);
}

/* ------------------------------------------------------------------------------ AVX-512 */

TARGET_AVX512 static float block_scale_avx512(int64_t len, const float *x, float *y) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(x + i));
        _mm512_storeu_ps(y + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float sum = _mm512_reduce_add_ps(acc);
    return finish_scale(sum, i, len, x, y);
}

TARGET_AVX512 static void block_bits_avx512(int64_t len, float *y, float s, uint8_t *bits) {
    const __m512 zero = _mm512_setzero_ps(), pos = _mm512_set1_ps(s), neg = _mm512_set1_ps(-s);
    int64_t j = 0;
    for (; 8 * j + 16 <= len; j += 2) {
        __m512 v = _mm512_loadu_ps(y + 8 * j);
        __mmask16 ge = _mm512_cmp_ps_mask(v, zero, _CMP_GE_OQ);
        bits[j] = (uint8_t)(ge & 0xff);
        bits[j + 1] = (uint8_t)(ge >> 8);
        _mm512_storeu_ps(y + 8 * j, _mm512_sub_ps(v, _mm512_mask_blend_ps(ge, neg, pos)));
    }
    if (8 * j < len) block_bits_scalar(len - 8 * j, y + 8 * j, s, bits + j);
}

TARGET_AVX512 static void unpack_block_avx512(int64_t k, int64_t len, const uint8_t *bits, int64_t row_bytes,
                                              const float *scales, int64_t row_scales, float *out) {
    int64_t full = len / 16 * 16;
    for (int64_t i = 0; i < full; i += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t r = 0; r < k; r++) {
            float s = scales[r * row_scales];
            const uint8_t *b = bits + r * row_bytes + (i >> 3);
            __mmask16 on = (__mmask16)(b[0] | ((unsigned)b[1] << 8));
            acc = _mm512_add_ps(acc, _mm512_mask_blend_ps(on, _mm512_set1_ps(-s), _mm512_set1_ps(s)));
        }
        _mm512_storeu_ps(out + i, _mm512_div_ps(acc, _mm512_set1_ps((float)k)));
    }
    if (full < len)
        unpack_block_scalar(k, len - full, bits + full / 8, row_bytes, scales, row_scales, out + full);
}
#endif /* ONEBIT_X86 */

/* ------------------------------------------------------------------------------ dispatch */

static int pick(int simd) {
    if (simd == ZERO_SIMD_BEST) return zero_cpu_adam_best_simd();
    if (simd < ZERO_SIMD_SCALAR || simd >= ZERO_SIMD_LEVELS || !zero_cpu_adam_simd_available(simd)) return -1;
    return simd;
}

int zero_onebit_pack(int64_t n, const float *x, float *err, int64_t block, uint8_t *bits, float *scales, int simd,
                     int num_threads) {
    if (n < 0 || block <= 0 || block % 16 || !x || !err || !bits || !scales) return ZERO_ADAM_BAD_ARGUMENT;
    int level = pick(simd);
    if (level < 0) return ZERO_ADAM_SIMD_UNAVAILABLE;
    int64_t blocks = n ? (n + block - 1) / block : 0;
    if (n == 0) scales[0] = 0.0f;
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (blocks > 8)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * block, len = (lo + block <= n) ? block : n - lo;
        float s;
#if ONEBIT_X86
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
    return ZERO_ADAM_OK;
}

int zero_onebit_unpack_mean(int64_t k, int64_t n, const uint8_t *bits, const float *scales, int64_t block, float *out,
                            int simd, int num_threads) {
    if (k <= 0 || n < 0 || block <= 0 || block % 16 || !bits || !scales || !out) return ZERO_ADAM_BAD_ARGUMENT;
    int level = pick(simd);
    if (level < 0) return ZERO_ADAM_SIMD_UNAVAILABLE;
    int64_t blocks = n ? (n + block - 1) / block : 0, row_bytes = (n + 7) / 8, row_scales = blocks ? blocks : 1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (blocks > 8)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * block, len = (lo + block <= n) ? block : n - lo;
#if ONEBIT_X86
        if (level == ZERO_SIMD_AVX512)
            unpack_block_avx512(k, len, bits + lo / 8, row_bytes, scales + b, row_scales, out + lo);
        else if (level == ZERO_SIMD_AVX2)
            unpack_block_avx2(k, len, bits + lo / 8, row_bytes, scales + b, row_scales, out + lo);
        else
#endif
            unpack_block_scalar(k, len, bits + lo / 8, row_bytes, scales + b, row_scales, out + lo);
    }
    return ZERO_ADAM_OK;
}

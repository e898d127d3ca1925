/* Element types shared by every kernel, and exact scalar conversions between fp32 and the
 * 16-bit formats. Rounding is round-to-nearest-even and overflow becomes infinity: bit for bit
 * the results of torch's `.to(torch.bfloat16 / torch.float16)` for every non-NaN value, on the
 * CPU and on CUDA. NaN stays a quiet NaN, written as the canonical 0x7fc0 (bf16) / 0x7e00 (fp16);
 * its payload bits may differ from torch's (whose own vector and scalar casts disagree on them).
 *
 * Plain C11, usable from C, C++ and CUDA. Under nvcc every function is __host__ __device__
 * (ZERO_HD), so the CPU kernels and the CUDA kernels convert with the very same code. The
 * subnormal fp16 path relies on IEEE addition with subnormals kept: never build with
 * flush-to-zero (--use_fast_math). */
#ifndef ZERO_COMMON_DTYPES_H
#define ZERO_COMMON_DTYPES_H

#include <stdint.h>
#include <string.h>

/* Marks a function callable from both host and device code under nvcc; empty elsewhere. */
#ifndef ZERO_HD
#ifdef __CUDACC__
#define ZERO_HD __host__ __device__
#else
#define ZERO_HD
#endif
#endif

typedef enum {
    ZERO_F32 = 0,
    ZERO_F16 = 1,
    ZERO_BF16 = 2,
    ZERO_BYTES = 3, /* anything else: opaque bytes, never converted */
} zero_dtype;

static inline ZERO_HD int zero_dtype_size(int dtype) {
    return dtype == ZERO_F32 ? 4 : (dtype == ZERO_F16 || dtype == ZERO_BF16) ? 2 : 1;
}

static inline ZERO_HD uint32_t zero_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline ZERO_HD float zero_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline ZERO_HD float zero_bf16_to_f32(uint16_t h) { return zero_bits_f32((uint32_t)h << 16); }

static inline ZERO_HD uint16_t zero_f32_to_bf16(float f) {
    uint32_t u = zero_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round half to even */
    return (uint16_t)(u >> 16);
}

static inline ZERO_HD float zero_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return zero_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in fp32 */
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return zero_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline ZERO_HD uint16_t zero_f32_to_f16(float f) {
    uint32_t u = zero_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) /* |f| >= 2^16: inf, or NaN */
        return sign | (u > 0x7f800000u ? 0x7e00 : 0x7c00);
    if (u < 0x38800000u) { /* below fp16's smallest normal: let the FPU round at 2^-24 */
        float a = zero_bits_f32(u) + 0.5f;
        return sign | (uint16_t)(zero_f32_bits(a) - 0x3f000000u);
    }
    /* normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even */
    u += 0xc8000fffu + ((u >> 13) & 1u);
    return sign | (uint16_t)(u >> 13);
}

/* Load element i of a buffer of `dtype` (F32/F16/BF16) as fp32, and store fp32 into one. With a
 * constant dtype (a template argument, an inlined constant) the switch folds away. */
static inline ZERO_HD float zero_load_f32(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case ZERO_F16: return zero_f16_to_f32(((const uint16_t *)p)[i]);
    case ZERO_BF16: return zero_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline ZERO_HD void zero_store_f32(void *p, int dtype, int64_t i, float v) {
    switch (dtype) {
    case ZERO_F16: ((uint16_t *)p)[i] = zero_f32_to_f16(v); break;
    case ZERO_BF16: ((uint16_t *)p)[i] = zero_f32_to_bf16(v); break;
    default: ((float *)p)[i] = v;
    }
}

#endif

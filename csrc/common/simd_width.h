/* Width macros: the names a kernel's vector body is written in, for AVX2 (8 fp32 lanes) and
 * AVX-512 (16 fp32 lanes). x86 only: include it under `#if ZERO_HAVE_X86_SIMD` (common/simd.h).
 *
 * [Note: one body per vector width]
 * A kernel writes its vector code once, in a body header with no include guard
 * (adam/cpu_adam_body.h, onebit/onebit_body.h, sparse_attention/sparse_attention_body.h), and
 * its .c file compiles that body once per width:
 *
 *     #include "common/simd_width.h"
 *     #define ZV_BITS 256
 *     #include "adam/cpu_adam_body.h"    (defines adam_tile_avx2, ...)
 *     #undef ZV_BITS
 *     #define ZV_BITS 512
 *     #include "adam/cpu_adam_body.h"    (defines adam_tile_avx512, ...)
 *
 * Every name below expands, where it is used, to its `_256` or `_512` definition according to
 * the ZV_BITS then in force (ZV_(name) pastes the width on). So the body's functions are named
 * ZV_NAME(f) (f_avx2 / f_avx512), carry that level's target attribute (ZV_FN, ZV_INLINE: never
 * -march=native, see [Note: SIMD levels]), and compute on ZV_W lanes.
 *
 * Each name is one instruction, or a short fixed sequence where the two instruction sets differ
 * (AVX-512 keeps per-lane conditions in mask registers, AVX2 as all-ones lanes; 16-bit narrowing;
 * horizontal reductions). Lane by lane the two widths therefore perform the operations the body
 * spells, in its order, with the same IEEE rounding, which is what keeps each path's results equal
 * to the scalar reference's where the kernel promises that (tests/test_cpu_adam.py checks it).
 * Horizontal reductions (zv_reduce_add) add lanes in a fixed order of their own per width.
 *
 * Types: zv (ZV_W fp32), zvi (the same register as ZV_W int32), zvh (ZV_W uint16: half a
 * register), zv_mask (a condition per lane), zv_lanes (which lanes a partial load or store
 * touches; AVX-512 only, see ZV_HAS_LANE_MASKS). */
#ifndef ZERO_COMMON_SIMD_WIDTH_H
#define ZERO_COMMON_SIMD_WIDTH_H

#include <stdint.h>

#include "common/simd.h"

#if !ZERO_HAVE_X86_SIMD
#error "common/simd_width.h holds the x86 SIMD paths: include it only when ZERO_HAVE_X86_SIMD"
#endif
#include <immintrin.h>

#define ZV_CAT_(a, b) a##b
#define ZV_CAT(a, b) ZV_CAT_(a, b)
#define ZV_(name) ZV_CAT(name, ZV_BITS) /* name##256 or name##512 */

/* ------------------------------------------------------------------------- the body's names */

#define ZV_W ZV_(ZV_W_)                               /* fp32 lanes per vector */
#define ZV_NAME(f) ZV_CAT(f, ZV_(ZV_SUFFIX_))         /* f_avx2 / f_avx512 */
#define ZV_FN ZV_(ZV_TARGET_) static                  /* a function of the body */
#define ZV_ENTRY ZV_(ZV_TARGET_) __attribute__((visibility("hidden"))) /* called from another unit of the op */
#define ZV_INLINE ZV_FN inline __attribute__((always_inline))
#define ZV_HAS_LANE_MASKS ZV_(ZV_HAS_LANE_MASKS_)     /* 1: zv_loadu_lanes can leave lanes out */

#define zv ZV_(zv_)
#define zvi ZV_(zvi_)
#define zvh ZV_(zvh_)
#define zv_mask ZV_(zv_mask_)
#define zv_lanes ZV_(zv_lanes_)

#define zv_loadu ZV_(zv_loadu_)           /* (const float *p) */
#define zv_storeu ZV_(zv_storeu_)         /* (float *p, zv x) */
#define zv_broadcast ZV_(zv_broadcast_)   /* (const float *p): *p in every lane */
#define zv_set1 ZV_(zv_set1_)             /* (float x) */
#define zv_zero ZV_(zv_zero_)             /* () */
#define zv_add ZV_(zv_add_)               /* a + b, and so on, each rounded once */
#define zv_sub ZV_(zv_sub_)
#define zv_mul ZV_(zv_mul_)
#define zv_div ZV_(zv_div_)
#define zv_sqrt ZV_(zv_sqrt_)
#define zv_fmadd ZV_(zv_fmadd_)           /* a * b + c, rounded once */
#define zv_fnmadd ZV_(zv_fnmadd_)         /* c - a * b, rounded once */
#define zv_max ZV_(zv_max_)               /* b where either is NaN (x86 max/min keep the second) */
#define zv_min ZV_(zv_min_)
#define zv_round ZV_(zv_round_)           /* to the nearest integer, ties to even */
#define zv_to_int ZV_(zv_to_int_)         /* fp32 -> int32, nearest even */
#define zv_as_int ZV_(zv_as_int_)         /* the same bits as zvi */
#define zv_reduce_add ZV_(zv_reduce_add_) /* sum of the lanes (a fixed order per width) */
#define zv_reduce_max ZV_(zv_reduce_max_) /* max of the lanes (no NaN expected) */

#define zv_isnan ZV_(zv_isnan_)           /* (zv x) -> zv_mask */
#define zv_cmplt ZV_(zv_cmplt_)           /* (zv a, zv b) -> zv_mask of a < b (false for NaN) */
#define zv_cmpge ZV_(zv_cmpge_)           /* (zv a, zv b) -> zv_mask of a >= b (false for NaN) */
#define zv_mask_bits ZV_(zv_mask_bits_)   /* zv_mask -> unsigned int, bit l = lane l */
#define zv_mask_of_bits ZV_(zv_mask_of_bits_) /* (const uint8_t *p): lane l set when bit l of p is */
#define zv_mask_or ZV_(zv_mask_or_)
#define zv_mask_any ZV_(zv_mask_any_)     /* nonzero when any lane is set */
#define ZV_NO_LANES ZV_(ZV_NO_LANES_)     /* a zv_mask with no lane set */
#define zv_zero_where ZV_(zv_zero_where_) /* (zv_mask m, zv x): 0 in the lanes of m, x elsewhere */
#define zv_blend ZV_(zv_blend_)           /* (a, b, zv_mask m): b in the lanes of m, a elsewhere */

#define ZV_ALL_LANES ZV_(ZV_ALL_LANES_)   /* zv_lanes: the whole vector */
#define ZV_LOW_HALF ZV_(ZV_LOW_HALF_)     /* zv_lanes: the first ZV_W / 2 (AVX-512 only) */
#define zv_loadu_lanes ZV_(zv_loadu_lanes_)   /* (lanes, p): the other lanes are 0 */
#define zv_storeu_lanes ZV_(zv_storeu_lanes_) /* (p, lanes, x): writes those lanes only */

#define zvi_set1 ZV_(zvi_set1_)
#define zvi_add32 ZV_(zvi_add32_)
#define zvi_and ZV_(zvi_and_)
#define zvi_slli32 ZV_(zvi_slli32_)
#define zvi_srli32 ZV_(zvi_srli32_)
#define zvi_as_float ZV_(zvi_as_float_)
#define zvi_blend ZV_(zvi_blend_)         /* (a, b, zv_mask m): b in the lanes of m, a elsewhere */
#define zvi_narrow16 ZV_(zvi_narrow16_)   /* zvi whose lanes are < 2^16 -> zvh */
#define zvi_xor ZV_(zvi_xor_)
#define zvi_or ZV_(zvi_or_)
#define zvi_sub32 ZV_(zvi_sub32_)
#define zvi_mullo32 ZV_(zvi_mullo32_)     /* low 32 bits of the product */
#define zvi_min_u32 ZV_(zvi_min_u32_)     /* unsigned minimum */
#define zvi_cmpgt32 ZV_(zvi_cmpgt32_)     /* (a, b) -> zv_mask of a > b, signed */
#define zvi_cmplt_u32 ZV_(zvi_cmplt_u32_) /* (a, b) -> zv_mask of a < b, unsigned */
#define zvi_one_where ZV_(zvi_one_where_) /* (zv_mask m) -> 1 in the lanes of m, 0 elsewhere */
#define zvi_iota ZV_(zvi_iota_)           /* () -> 0, 1, ..., ZV_W - 1 */
#define zvi_to_float ZV_(zvi_to_float_)   /* int32 -> fp32 (exact below 2^24) */
#define zv_trunc_int ZV_(zv_trunc_int_)   /* fp32 -> int32, toward zero */
#define zvb_load ZV_(zvb_load_)           /* (const uint8_t *p): ZV_W bytes, zero-extended to zvi */
#define zvi_loadu ZV_(zvi_loadu_)         /* (const void *p): ZV_W 32-bit lanes */
#define zvi_storeu ZV_(zvi_storeu_)       /* (void *p, zvi a) */
#define zvi_stream ZV_(zvi_stream_)       /* the same, non-temporal: p aligned to a whole vector */
#define zvb_store ZV_(zvb_store_)         /* (uint8_t *p, zvi a): the low byte of each lane */

#define zvh_loadu ZV_(zvh_loadu_)         /* (const uint16_t *p) */
#define zvh_storeu ZV_(zvh_storeu_)       /* (uint16_t *p, zvh h) */
#define zvh_stream ZV_(zvh_stream_)       /* the same, non-temporal: p aligned to 2 * ZV_W bytes */
#define zvh_widen32 ZV_(zvh_widen32_)     /* zvh -> zvi, zero-extended */
#define zvh_f16_to_zv ZV_(zvh_f16_to_zv_) /* ZV_W fp16 -> fp32 (exact) */
#define zv_to_f16 ZV_(zv_to_f16_)         /* ZV_W fp32 -> fp16, nearest even (NaN payloads kept) */

/* ------------------------------------------------------------------------- AVX2 + FMA + F16C */

#define ZV_W_256 8
#define ZV_SUFFIX_256 _avx2
#define ZV_TARGET_256 ZERO_TARGET_AVX2
#define ZV_HAS_LANE_MASKS_256 0
typedef __m256 zv_256;
typedef __m256i zvi_256;
typedef __m128i zvh_256;
typedef __m256 zv_mask_256; /* all-ones lanes where set */
typedef int zv_lanes_256;   /* AVX2 loads and stores whole vectors: always ZV_ALL_LANES */

#define zv_loadu_256(p) _mm256_loadu_ps(p)
#define zv_storeu_256(p, x) _mm256_storeu_ps(p, x)
#define zv_broadcast_256(p) _mm256_broadcast_ss(p)
#define zv_set1_256(x) _mm256_set1_ps(x)
#define zv_zero_256() _mm256_setzero_ps()
#define zv_add_256(a, b) _mm256_add_ps(a, b)
#define zv_sub_256(a, b) _mm256_sub_ps(a, b)
#define zv_mul_256(a, b) _mm256_mul_ps(a, b)
#define zv_div_256(a, b) _mm256_div_ps(a, b)
#define zv_sqrt_256(a) _mm256_sqrt_ps(a)
#define zv_fmadd_256(a, b, c) _mm256_fmadd_ps(a, b, c)
#define zv_fnmadd_256(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define zv_max_256(a, b) _mm256_max_ps(a, b)
#define zv_min_256(a, b) _mm256_min_ps(a, b)
#define zv_round_256(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define zv_to_int_256(a) _mm256_cvtps_epi32(a)
#define zv_as_int_256(a) _mm256_castps_si256(a)
#define zv_reduce_add_256(a) zero_avx2_reduce_add(a)
#define zv_reduce_max_256(a) zero_avx2_reduce_max(a)

#define zv_isnan_256(x) _mm256_cmp_ps(x, x, _CMP_UNORD_Q)
#define zv_cmplt_256(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define zv_cmpge_256(a, b) _mm256_cmp_ps(a, b, _CMP_GE_OQ)
#define zv_mask_bits_256(m) ((unsigned)_mm256_movemask_ps(m))
#define zv_mask_of_bits_256(p) zero_avx2_mask_of_bits(p)
#define zv_mask_or_256(a, b) _mm256_or_ps(a, b)
#define zv_mask_any_256(m) _mm256_movemask_ps(m)
#define ZV_NO_LANES_256 _mm256_setzero_ps()
#define zv_zero_where_256(m, x) _mm256_andnot_ps(m, x)
#define zv_blend_256(a, b, m) _mm256_blendv_ps(a, b, m)

#define ZV_ALL_LANES_256 0
#define ZV_LOW_HALF_256 0
#define zv_loadu_lanes_256(lanes, p) ((void)(lanes), _mm256_loadu_ps(p))
#define zv_storeu_lanes_256(p, lanes, x) ((void)(lanes), _mm256_storeu_ps(p, x))

#define zvi_set1_256(x) _mm256_set1_epi32(x)
#define zvi_add32_256(a, b) _mm256_add_epi32(a, b)
#define zvi_and_256(a, b) _mm256_and_si256(a, b)
#define zvi_slli32_256(a, n) _mm256_slli_epi32(a, n)
#define zvi_srli32_256(a, n) _mm256_srli_epi32(a, n)
#define zvi_as_float_256(a) _mm256_castsi256_ps(a)
#define zvi_blend_256(a, b, m) _mm256_blendv_epi8(a, b, _mm256_castps_si256(m))
/* pack to 16 bits within each 128-bit half, then gather the two halves' low quarters */
#define zvi_narrow16_256(a) _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(a, a), 0x08))

#define zvi_xor_256(a, b) _mm256_xor_si256(a, b)
#define zvi_or_256(a, b) _mm256_or_si256(a, b)
#define zvi_sub32_256(a, b) _mm256_sub_epi32(a, b)
#define zvi_mullo32_256(a, b) _mm256_mullo_epi32(a, b)
#define zvi_min_u32_256(a, b) _mm256_min_epu32(a, b)
#define zvi_cmpgt32_256(a, b) _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b))
#define zvi_cmplt_u32_256(a, b) \
    zvi_cmpgt32_256(_mm256_xor_si256(b, _mm256_set1_epi32(INT32_MIN)), _mm256_xor_si256(a, _mm256_set1_epi32(INT32_MIN)))
#define zvi_one_where_256(m) _mm256_srli_epi32(_mm256_castps_si256(m), 31)
#define zvi_iota_256() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define zvi_to_float_256(a) _mm256_cvtepi32_ps(a)
#define zv_trunc_int_256(a) _mm256_cvttps_epi32(a)
#define zvb_load_256(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define zvi_loadu_256(p) _mm256_loadu_si256((const __m256i *)(p))
#define zvi_storeu_256(p, a) _mm256_storeu_si256((__m256i *)(p), a)
#define zvi_stream_256(p, a) _mm256_stream_si256((__m256i *)(p), a)
#define zvb_store_256(p, a) _mm_storel_epi64((__m128i *)(p), zero_avx2_narrow8(a))

#define zvh_loadu_256(p) _mm_loadu_si128((const __m128i *)(p))
#define zvh_storeu_256(p, h) _mm_storeu_si128((__m128i *)(p), h)
#define zvh_stream_256(p, h) _mm_stream_si128((__m128i *)(p), h)
#define zvh_widen32_256(h) _mm256_cvtepu16_epi32(h)
#define zvh_f16_to_zv_256(h) _mm256_cvtph_ps(h)
#define zv_to_f16_256(x) _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* The lanes' sum: the upper half added to the lower, then pairs, then the last two. */
ZERO_TARGET_AVX2 static inline __attribute__((always_inline)) float zero_avx2_reduce_add(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ZERO_TARGET_AVX2 static inline __attribute__((always_inline)) float zero_avx2_reduce_max(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The low byte of each of the 8 lanes, in the low 8 bytes of the result. */
ZERO_TARGET_AVX2 static inline __attribute__((always_inline)) __m128i zero_avx2_narrow8(__m256i a) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                                          -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(a, pick); /* 4 bytes at the start of each 128-bit half */
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

/* Lane l set when bit l of the byte *p is: the byte in every lane, tested against lane l's bit. */
ZERO_TARGET_AVX2 static inline __attribute__((always_inline)) __m256 zero_avx2_mask_of_bits(const uint8_t *p) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_set1_epi32(p[0]);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), lane_bit));
}

/* ------------------------------------------------------------------------- AVX-512 F + BW */

#define ZV_W_512 16
#define ZV_SUFFIX_512 _avx512
#define ZV_TARGET_512 ZERO_TARGET_AVX512
#define ZV_HAS_LANE_MASKS_512 1
typedef __m512 zv_512;
typedef __m512i zvi_512;
typedef __m256i zvh_512;
typedef __mmask16 zv_mask_512;
typedef __mmask16 zv_lanes_512;

#define zv_loadu_512(p) _mm512_loadu_ps(p)
#define zv_storeu_512(p, x) _mm512_storeu_ps(p, x)
#define zv_broadcast_512(p) _mm512_set1_ps(*(p))
#define zv_set1_512(x) _mm512_set1_ps(x)
#define zv_zero_512() _mm512_setzero_ps()
#define zv_add_512(a, b) _mm512_add_ps(a, b)
#define zv_sub_512(a, b) _mm512_sub_ps(a, b)
#define zv_mul_512(a, b) _mm512_mul_ps(a, b)
#define zv_div_512(a, b) _mm512_div_ps(a, b)
#define zv_sqrt_512(a) _mm512_sqrt_ps(a)
#define zv_fmadd_512(a, b, c) _mm512_fmadd_ps(a, b, c)
#define zv_fnmadd_512(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define zv_max_512(a, b) _mm512_max_ps(a, b)
#define zv_min_512(a, b) _mm512_min_ps(a, b)
#define zv_round_512(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define zv_to_int_512(a) _mm512_cvtps_epi32(a)
#define zv_as_int_512(a) _mm512_castps_si512(a)
#define zv_reduce_add_512(a) _mm512_reduce_add_ps(a)
#define zv_reduce_max_512(a) _mm512_reduce_max_ps(a)

#define zv_isnan_512(x) _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
#define zv_cmplt_512(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define zv_cmpge_512(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)
#define zv_mask_bits_512(m) ((unsigned)(m))
#define zv_mask_of_bits_512(p) ((__mmask16)((p)[0] | ((unsigned)(p)[1] << 8)))
#define zv_mask_or_512(a, b) ((__mmask16)((a) | (b)))
#define zv_mask_any_512(m) (m)
#define ZV_NO_LANES_512 ((__mmask16)0)
#define zv_zero_where_512(m, x) _mm512_maskz_mov_ps((__mmask16)~(m), x)
#define zv_blend_512(a, b, m) _mm512_mask_blend_ps(m, a, b)

#define ZV_ALL_LANES_512 ((__mmask16)0xffff)
#define ZV_LOW_HALF_512 ((__mmask16)0x00ff)
#define zv_loadu_lanes_512(lanes, p) _mm512_maskz_loadu_ps(lanes, p)
#define zv_storeu_lanes_512(p, lanes, x) _mm512_mask_storeu_ps(p, lanes, x)

#define zvi_set1_512(x) _mm512_set1_epi32(x)
#define zvi_add32_512(a, b) _mm512_add_epi32(a, b)
#define zvi_and_512(a, b) _mm512_and_si512(a, b)
#define zvi_slli32_512(a, n) _mm512_slli_epi32(a, n)
#define zvi_srli32_512(a, n) _mm512_srli_epi32(a, n)
#define zvi_as_float_512(a) _mm512_castsi512_ps(a)
#define zvi_blend_512(a, b, m) _mm512_mask_mov_epi32(a, m, b)
#define zvi_narrow16_512(a) _mm512_cvtepi32_epi16(a) /* vpmovdw: one instruction */

#define zvi_xor_512(a, b) _mm512_xor_si512(a, b)
#define zvi_or_512(a, b) _mm512_or_si512(a, b)
#define zvi_sub32_512(a, b) _mm512_sub_epi32(a, b)
#define zvi_mullo32_512(a, b) _mm512_mullo_epi32(a, b)
#define zvi_min_u32_512(a, b) _mm512_min_epu32(a, b)
#define zvi_cmpgt32_512(a, b) _mm512_cmpgt_epi32_mask(a, b)
#define zvi_cmplt_u32_512(a, b) _mm512_cmplt_epu32_mask(a, b)
#define zvi_one_where_512(m) _mm512_maskz_mov_epi32(m, _mm512_set1_epi32(1))
#define zvi_iota_512() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define zvi_to_float_512(a) _mm512_cvtepi32_ps(a)
#define zv_trunc_int_512(a) _mm512_cvttps_epi32(a)
#define zvb_load_512(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define zvi_loadu_512(p) _mm512_loadu_si512(p)
#define zvi_storeu_512(p, a) _mm512_storeu_si512(p, a)
#define zvi_stream_512(p, a) _mm512_stream_si512((void *)(p), a)
#define zvb_store_512(p, a) _mm_storeu_si128((__m128i *)(p), _mm512_cvtepi32_epi8(a))

#define zvh_loadu_512(p) _mm256_loadu_si256((const __m256i *)(p))
#define zvh_storeu_512(p, h) _mm256_storeu_si256((__m256i *)(p), h)
#define zvh_stream_512(p, h) _mm256_stream_si256((__m256i *)(p), h)
#define zvh_widen32_512(h) _mm512_cvtepu16_epi32(h)
#define zvh_f16_to_zv_512(h) _mm512_cvtph_ps(h)
#define zv_to_f16_512(x) _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#endif

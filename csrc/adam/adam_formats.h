/* Low-precision formats of the Adam state: a bf16 master, bf16 moments, 8-bit moment codes with
 * one scale per block; stochastic rounding from a counter-based generator. Shared by the CPU
 * kernel (adam/cpu_adam.c, every SIMD level) and the CUDA kernel (adam/fused_adam.cu): one
 * formula per format, here, as adam/adam_math.h is for the update itself.
 *
 * [Note: state formats]
 * Each element's update is [Note: adam math] on fp32 values; only how the master and the
 * moments are *stored* between steps changes:
 *
 *   master  fp32 | bf16                 bf16: rounded stochastically (unbiased) or to nearest even
 *   m, v    fp32 | bf16 | 8-bit codes   bf16: as the master; codes: see [Note: 8-bit moment codes]
 *
 * A step loads each stored value, widens it to fp32, updates it, and rounds it back, in one pass:
 * no fp32 copy of a low-precision state exists outside registers (and, for 8-bit codes, one
 * block of ZERO_Q8_BLOCK fp32 values on the stack while its scale is found).
 *
 * [Note: stochastic rounding]
 * A bf16 master loses every update smaller than half a bf16 ulp (2^-9 to 2^-8 of the weight):
 * with round-to-nearest a small learning rate stops training. Rounding x stochastically to one of
 * its two bf16 neighbours, up with probability (x - lower) / (upper - lower), keeps the expected
 * stored value equal to x. In bits: add 16 uniform random bits to the low half of x's fp32
 * pattern and truncate (sign-magnitude, so negative values round the same way in magnitude);
 * exactly representable values (low half 0) never move. The 16 random bits come from a
 * counter-based generator: word(i) = H(lo32(i) ^ (k0 + hi32(i) * 0x9e3779b9)) for the element's
 * global index i, with H the "lowbias32" integer hash (a bijection with full avalanche) and
 * (k0, k2) derived from (seed, step) by splitmix64. The result depends on (seed, step, index)
 * alone: not on the thread count, the SIMD width, or how a buffer is split into calls. The
 * engine's index is the element's place in its stage's layout (stages 0-2: the flat buffer, the
 * same on every rank, so ranks holding replicated values round them identically; stage 3: its
 * unit and rank's shard), unique per element; a run is reproducible. The master uses bits 0-15 of word(i), m
 * bits 16-31, v bits 16-31 of (word(i) ^ k2) * 0x9e3779b9 (one multiply: the vector paths' integer
 * multiplies share a port with division and square root, so the generator is kept to three).
 *
 * [Note: 8-bit moment codes]
 * m and v are stored one byte per element with one fp32 scale per block of ZERO_Q8_BLOCK
 * elements (blocks start at the buffer's start). The scale is a power of two, 2^e, chosen per
 * block from its largest magnitude; each byte is a small float relative to it, so dividing by
 * the scale and coding are exact and cheap (bit operations, no table):
 *   m: sign + 4 exponent + 3 mantissa bits; magnitudes 2^-17 .. 1.875 of the scale
 *   v: 5 exponent + 3 mantissa bits (v >= 0);  values    2^-33 .. 1.875 of the scale
 * Within a block this is a float format whose exponent bias is the block's (a dynamic,
 * block-wise quantization as in the 8-bit-optimizer literature). v's range is the square of m's,
 * so a v small enough to matter next to its m is never flushed to zero (a linear code would make
 * m / sqrt(v) explode). Codes are rounded to nearest: rounded stochastically, an exponential
 * average with beta2 = 0.999 would accumulate the rounding noise of ~1000 steps (a random walk
 * of ~20x one code step); rounded to nearest it changes only when the new value moves by half a
 * code step, as in bitsandbytes' 8-bit Adam. e is chosen from the block's largest magnitude
 * rounded to 3 mantissa bits, so that value, and every other, fits the codes. A block of zeros
 * has scale 0. Decoding: code -> relative value (exact) -> times the scale (exact). */
#ifndef ZERO_ADAM_ADAM_FORMATS_H
#define ZERO_ADAM_ADAM_FORMATS_H

#include <stdint.h>

#include "adam/adam_math.h"
#include "common/dtypes.h"

/* State format codes beyond common/dtypes.h's element types (kernel arguments only). */
enum { ZERO_Q8 = 8 };
enum { ZERO_Q8_BLOCK = 256 };
/* Exponent bits of the codes: m (signed, 7-bit magnitude) and v (unsigned, 8-bit). */
enum { ZERO_Q8_M_EBITS = 4, ZERO_Q8_V_EBITS = 5 };

/* How one call stores its state (see [Note: state formats]). */
typedef struct {
    int32_t master_dtype; /* ZERO_F32 or ZERO_BF16 */
    int32_t state_dtype;  /* ZERO_F32, ZERO_BF16 or ZERO_Q8 */
    int32_t stochastic;   /* 1: bf16 master and bf16 moments rounded stochastically; 0: nearest even */
    uint64_t seed;        /* the generator's seed */
    uint64_t index;       /* global index of the buffer's element 0 (the generator's counter) */
} zero_adam_format;

/* The generator's per-step keys, derived from (seed, step) by splitmix64. */
typedef struct {
    uint32_t k0, k2;
} zero_sr_key;

static inline ZERO_HD uint64_t zero_splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline ZERO_HD zero_sr_key zero_sr_key_of(uint64_t seed, int64_t step) {
    const uint64_t a = zero_splitmix64(zero_splitmix64(seed) ^ (uint64_t)step);
    const uint64_t b = zero_splitmix64(a);
    zero_sr_key k;
    k.k0 = (uint32_t)a;
    k.k2 = (uint32_t)b;
    return k;
}

/* "lowbias32": a 32-bit integer hash with low bias (C. Wellons' hash-prospector). */
static inline ZERO_HD uint32_t zero_hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The random word of the element with global index i; see [Note: stochastic rounding]. */
static inline ZERO_HD uint32_t zero_sr_word(const zero_sr_key *k, uint64_t i) {
    return zero_hash32((uint32_t)i ^ (k->k0 + (uint32_t)(i >> 32) * 0x9e3779b9u));
}

/* The second moment's random bits (in the high half), from the element's word. */
static inline ZERO_HD uint32_t zero_sr_word2(const zero_sr_key *k, uint32_t word) {
    return (word ^ k->k2) * 0x9e3779b9u;
}

/* fp32 -> bf16 rounded stochastically with the 16 random bits r (low half of r). NaN -> 0x7fc0;
 * infinities stay; a value beyond bf16's largest finite may round to infinity. */
static inline ZERO_HD uint16_t zero_f32_to_bf16_sr(float f, uint32_t r) {
    const uint32_t u = zero_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

/* ---------------------------------------------------------------- 8-bit codes, per block */

/* The block's exponent from its largest magnitude `a` (>= 0, finite): the biased fp32 exponent
 * field E of `a` rounded to 3 mantissa bits, clamped to [1, 253]; the scale is 2^(E-127).
 * Returns 0 when a == 0 (a block of zeros). */
static inline ZERO_HD uint32_t zero_q8_exponent(float a) {
    if (!(a > 0.0f)) return 0;
    uint32_t e = (zero_f32_bits(a) + 0x80000u) >> 23;
    return e < 1 ? 1 : e > 253 ? 253 : e;
}

static inline ZERO_HD float zero_q8_scale(uint32_t e) { return e ? zero_bits_f32(e << 23) : 0.0f; }
/* 1 / scale, exact (a power of two); 0 for a block of zeros. */
static inline ZERO_HD float zero_q8_inv_scale(uint32_t e) { return e ? zero_bits_f32((254u - e) << 23) : 0.0f; }

/* The code of a magnitude r = |x| / scale in [0, 1.875], with `ebits` exponent bits and 3
 * mantissa bits, rounded to nearest (ties away from zero). */
static inline ZERO_HD uint32_t zero_q8_encode_mag(float r, int ebits) {
    const uint32_t fmax = (1u << ebits) - 1u, top = (fmax << 3) | 7u;
    const uint32_t u = zero_f32_bits(r);
    uint32_t c;
    if ((u >> 23) >= 128u - fmax) {
        c = ((u + 0x80000u) >> 20) - ((127u - fmax) << 3); /* normal: rebias, keep 3 bits */
    } else {
        const float t = r * zero_bits_f32((127u + fmax + 2u) << 23); /* r / 2^(-fmax-2), exact */
        c = (uint32_t)(int32_t)(t + 0.5f);                        /* subnormal: 0 .. 8 */
    }
    return c < top ? c : top;
}

/* The magnitude a code stands for, relative to the scale (exact). */
static inline ZERO_HD float zero_q8_decode_mag(uint32_t c, int ebits) {
    const uint32_t fmax = (1u << ebits) - 1u;
    if (c >= 8u) return zero_bits_f32((c + ((127u - fmax) << 3)) << 20);
    return (float)(int32_t)c * zero_bits_f32((127u - fmax - 2u) << 23);
}

static inline ZERO_HD float zero_q8_decode_m(uint8_t c, float scale) {
    const float mag = zero_q8_decode_mag(c & 0x7fu, ZERO_Q8_M_EBITS) * scale;
    return (c & 0x80u) ? -mag : mag;
}

static inline ZERO_HD float zero_q8_decode_v(uint8_t c, float scale) { return zero_q8_decode_mag(c, ZERO_Q8_V_EBITS) * scale; }

static inline ZERO_HD uint8_t zero_q8_encode_m(float m, float inv_scale) {
    const uint32_t sign = (zero_f32_bits(m) >> 24) & 0x80u;
    return (uint8_t)(sign | zero_q8_encode_mag(fabsf(m) * inv_scale, ZERO_Q8_M_EBITS));
}

static inline ZERO_HD uint8_t zero_q8_encode_v(float v, float inv_scale) {
    return (uint8_t)zero_q8_encode_mag(v * inv_scale, ZERO_Q8_V_EBITS);
}

/* ---------------------------------------------------------------- one element, any format */

/* Load element i of a master / moment buffer of the given format as fp32 (8-bit: with its
 * block's scale). */
static inline ZERO_HD float zero_load_master(const void *p, int dtype, int64_t i) {
    return dtype == ZERO_BF16 ? zero_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Store the updated master element i; returns the value stored (what the model's 16-bit copy
 * is made from: for a bf16 master, exactly its bits). */
static inline ZERO_HD float zero_store_master(void *p, int dtype, int64_t i, float x, int stochastic, uint32_t word) {
    if (dtype != ZERO_BF16) {
        ((float *)p)[i] = x;
        return x;
    }
    const uint16_t h = stochastic ? zero_f32_to_bf16_sr(x, word) : zero_f32_to_bf16(x);
    ((uint16_t *)p)[i] = h;
    return zero_bf16_to_f32(h);
}

/* Element i of a step in any format: the update of [Note: adam math] on the widened values,
 * the master stored (and copied to `out`), and the moments stored, except 8-bit ones, whose new
 * fp32 values go to *mq and *vq until their block's scale is known (zero_q8_block_store).
 * ms / vs: the block's scales before the step (8-bit states only). */
static inline ZERO_HD void zero_adam_fmt_element(int64_t i, void *p, const void *g, int gd, void *m, void *v,
                                                 float ms, float vs, void *out, int od, const zero_adam_coeffs *c,
                                                 const zero_adam_format *fmt, const zero_sr_key *key, float *mq,
                                                 float *vq) {
    const int pd = fmt->master_dtype, sd = fmt->state_dtype, sr = fmt->stochastic;
    float pi = zero_load_master(p, pd, i), mi, vi;
    if (sd == ZERO_Q8) {
        mi = zero_q8_decode_m(((const uint8_t *)m)[i], ms);
        vi = zero_q8_decode_v(((const uint8_t *)v)[i], vs);
    } else {
        mi = zero_load_master(m, sd, i);
        vi = zero_load_master(v, sd, i);
    }
    zero_adam_element(&pi, &mi, &vi, zero_load_f32(g, gd, i), c);
    const int need_word = sr && (pd == ZERO_BF16 || sd == ZERO_BF16);
    const uint32_t w = need_word ? zero_sr_word(key, fmt->index + (uint64_t)i) : 0u;
    const float stored = zero_store_master(p, pd, i, pi, sr, w);
    if (od != ZERO_F32) zero_store_f32(out, od, i, stored);
    if (sd == ZERO_Q8) {
        *mq = mi;
        *vq = vi;
    } else if (sd == ZERO_BF16) {
        ((uint16_t *)m)[i] = sr ? zero_f32_to_bf16_sr(mi, w >> 16) : zero_f32_to_bf16(mi);
        ((uint16_t *)v)[i] = sr ? zero_f32_to_bf16_sr(vi, zero_sr_word2(key, w) >> 16) : zero_f32_to_bf16(vi);
    } else {
        ((float *)m)[i] = mi;
        ((float *)v)[i] = vi;
    }
}

/* The 8-bit block of n elements at element `at`: its scales from the largest new magnitudes
 * (mmax = max |m|, vmax = max v), then its codes from the new values mq, vq. */
static inline ZERO_HD void zero_q8_block_store(int64_t n, int64_t at, void *m, void *v, float *ms, float *vs,
                                               const float *mq, const float *vq, float mmax, float vmax) {
    const uint32_t me = zero_q8_exponent(mmax), ve = zero_q8_exponent(vmax);
    *ms = zero_q8_scale(me);
    *vs = zero_q8_scale(ve);
    const float m_inv = zero_q8_inv_scale(me), v_inv = zero_q8_inv_scale(ve);
    for (int64_t j = 0; j < n; j++) {
        ((uint8_t *)m)[at + j] = zero_q8_encode_m(mq[j], m_inv);
        ((uint8_t *)v)[at + j] = zero_q8_encode_v(vq[j], v_inv);
    }
}

/* One Adam step over one block of n <= ZERO_Q8_BLOCK elements starting at element `at` of the
 * buffers, in any format: the scalar reference every other path reproduces bit for bit.
 * ms / vs: the block's scales (8-bit states only). out: NULL or the model's 16-bit copy. */
static inline ZERO_HD void zero_adam_block_ref(int64_t n, int64_t at, void *p, const void *g, int gd, void *m,
                                               void *v, float *ms, float *vs, void *out, int od,
                                               const zero_adam_coeffs *c, const zero_adam_format *fmt,
                                               const zero_sr_key *key) {
    const int q8 = fmt->state_dtype == ZERO_Q8;
    float mq[ZERO_Q8_BLOCK], vq[ZERO_Q8_BLOCK];
    float mmax = 0.0f, vmax = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        zero_adam_fmt_element(at + j, p, g, gd, m, v, q8 ? *ms : 0.0f, q8 ? *vs : 0.0f, out, od, c, fmt, key, &mq[j],
                              &vq[j]);
        if (q8) {
            mmax = fmaxf(mmax, fabsf(mq[j]));
            vmax = fmaxf(vmax, vq[j]);
        }
    }
    if (q8) zero_q8_block_store(n, at, m, v, ms, vs, mq, vq, mmax, vmax);
}

#endif

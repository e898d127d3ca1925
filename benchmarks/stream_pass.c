/* The memory-bandwidth ceiling of a CPU Adam step, for benchmarks/bench_adam.py only (it is not
 * part of zero's native ops). The benchmark builds it with the C compiler and flags zero's ops use
 * and calls it through ctypes.
 *
 * zero_stream_pass_sized has the memory traffic of an Adam step in any state format (see
 * [Note: state formats] in csrc/adam/adam_formats.h) and almost no arithmetic. Its streams are the
 * step's buffers, each with its own element size:
 *
 *   grad                   read                   2 or 4 bytes per element
 *   param                  read and written back  2 or 4
 *   exp_avg, exp_avg_sq    read and written back  1, 2 or 4 each
 *   m_scale, v_scale       read and written back  4 per block of BLOCK elements each (8-bit moments)
 *   out16                  written only           2 (the 16-bit copy-out)
 *
 * Each read-modify-write stream gets grad added (integer adds in the stream's own width: the
 * values mean nothing, only the bytes moved count). The work is split into the same tiles over the
 * same OpenMP threads as zero_cpu_adam_step and zero_cpu_adam_step_fmt (csrc/adam/cpu_adam.c), and
 * each tile is walked block by block, as the 8-bit path walks it: one fused loop over grad, param
 * and the moments (so all of them stream at once, as they do in the step), then the block's scales,
 * then its copy-out. The copy-out is written with non-temporal stores where it is aligned
 * (x86-64; see [Note: streaming stores] in csrc/adam/cpu_adam.c): an ordinary store would first
 * read each destination line, and the stream would cost twice its bytes. The ceiling is the pass
 * that moves only the useful bytes.
 *
 * zero_stream_pass is the fp32 traffic the benchmark has always used: read param, grad, exp_avg
 * and exp_avg_sq, write param, exp_avg and exp_avg_sq (28 bytes per element, no copy-out).
 *
 * The loops are plain C, compiled without -march: even 16-byte vectors issue loads and stores far
 * faster than DRAM delivers them, so at the sizes the benchmark uses (buffers much larger than the
 * caches) the pass runs at memory speed. */
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

enum { TILE = 1 << 14 }; /* as in cpu_adam.c */
enum { BLOCK = 256 };    /* ZERO_Q8_BLOCK, the 8-bit scales' block; TILE is a multiple of it */

/* Unsigned integers of 1, 2 and 4 bytes, named by their size for the token pasting below. */
typedef uint8_t u1;
typedef uint16_t u2;
typedef uint32_t u4;

/* One block of len elements, with G-byte grad, P-byte param and S-byte moments (pointers at the
 * block's start): param, exp_avg and exp_avg_sq get grad added; `copy`, unless NULL, receives the
 * new param's low 16 bits (what the copy-out writes). One fused loop, so every stream is in flight
 * at once. */
typedef void (*block_fn)(int64_t len, void *param, const void *grad, void *exp_avg, void *exp_avg_sq, u2 *copy);

#define DEFINE_BLOCK(G, P, S)                                                                                   \
    static void block_g##G##_p##P##_s##S(int64_t len, void *param, const void *grad, void *exp_avg,              \
                                         void *exp_avg_sq, u2 *restrict copy) {                                 \
        u##P *restrict p = param;                                                                               \
        const u##G *restrict g = grad;                                                                          \
        u##S *restrict m = exp_avg, *restrict v = exp_avg_sq;                                                   \
        for (int64_t j = 0; j < len; j++) {                                                                     \
            p[j] += g[j];                                                                                       \
            m[j] += g[j];                                                                                       \
            v[j] += g[j];                                                                                       \
            if (copy != NULL) copy[j] = (u2)p[j];                                                               \
        }                                                                                                       \
    }
DEFINE_BLOCK(2, 2, 1)
DEFINE_BLOCK(2, 2, 2)
DEFINE_BLOCK(2, 2, 4)
DEFINE_BLOCK(2, 4, 1)
DEFINE_BLOCK(2, 4, 2)
DEFINE_BLOCK(2, 4, 4)
DEFINE_BLOCK(4, 2, 1)
DEFINE_BLOCK(4, 2, 2)
DEFINE_BLOCK(4, 2, 4)
DEFINE_BLOCK(4, 4, 1)
DEFINE_BLOCK(4, 4, 2)
DEFINE_BLOCK(4, 4, 4)

/* BLOCKS[grad is 4 bytes][param is 4 bytes][moments are 1, 2, 4 bytes] */
static const block_fn BLOCKS[2][2][3] = {
    {{block_g2_p2_s1, block_g2_p2_s2, block_g2_p2_s4}, {block_g2_p4_s1, block_g2_p4_s2, block_g2_p4_s4}},
    {{block_g4_p2_s1, block_g4_p2_s2, block_g4_p2_s4}, {block_g4_p4_s1, block_g4_p4_s2, block_g4_p4_s4}},
};

/* out = copy (`bytes` bytes), streamed past the caches where out is aligned. */
static void write_copy(void *restrict out, const u2 *restrict copy, int64_t bytes) {
    int64_t k = 0;
#if defined(__SSE2__)
    if ((uintptr_t)out % 16 == 0)
        for (; k + 16 <= bytes; k += 16)
            _mm_stream_si128((__m128i *)((char *)out + k), _mm_load_si128((const __m128i *)((const char *)copy + k)));
#endif
    memcpy((char *)out + k, (const char *)copy + k, (size_t)(bytes - k));
}

/* n elements; sizes in bytes as in the table above. m_scale and v_scale: both NULL (no 8-bit
 * scales) or both set; out16: NULL (no copy-out) or 2 bytes per element. num_threads <= 0: the
 * OpenMP default. Returns 0, or -1 for a bad argument. */
int zero_stream_pass_sized(int64_t n, void *param, int param_size, const void *grad, int grad_size, void *exp_avg,
                           void *exp_avg_sq, int state_size, void *m_scale, void *v_scale, void *out16,
                           int num_threads) {
    if (n < 0 || (param_size != 2 && param_size != 4) || (grad_size != 2 && grad_size != 4)) return -1;
    if (state_size != 1 && state_size != 2 && state_size != 4) return -1;
    if ((m_scale == NULL) != (v_scale == NULL)) return -1;
    if (n > 0 && (param == NULL || grad == NULL || exp_avg == NULL || exp_avg_sq == NULL)) return -1;
    const block_fn block = BLOCKS[grad_size == 4][param_size == 4][state_size == 1 ? 0 : state_size == 2 ? 1 : 2];
    const int64_t ntiles = (n + TILE - 1) / TILE;
#ifdef _OPENMP
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#else
    const int threads = 1;
    (void)num_threads;
#endif
    (void)threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ntiles > 1 && threads > 1)
    for (int64_t t = 0; t < ntiles; t++) {
        _Alignas(64) u2 copy[BLOCK];
        const int64_t end = n - t * TILE < TILE ? n : (t + 1) * TILE;
        for (int64_t b = t * TILE; b < end; b += BLOCK) {
            const int64_t len = end - b < BLOCK ? end - b : BLOCK;
            block(len, (char *)param + b * param_size, (const char *)grad + b * grad_size,
                  (char *)exp_avg + b * state_size, (char *)exp_avg_sq + b * state_size, out16 ? copy : NULL);
            if (m_scale != NULL) {
                ((u4 *)m_scale)[b / BLOCK] += 1;
                ((u4 *)v_scale)[b / BLOCK] += 1;
            }
            if (out16 != NULL) write_copy((u2 *)out16 + b, copy, len * 2);
        }
#if defined(__SSE2__)
        _mm_sfence(); /* the streamed copy-out is visible before the tile is reported done */
#endif
    }
    return 0;
}

/* The fp32 Adam traffic: four float32 buffers of n elements; grad is read, the others are read
 * and written back (28 bytes per element). Returns 0, or -1 for n < 0. */
int zero_stream_pass(int64_t n, float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                     int num_threads) {
    return zero_stream_pass_sized(n, param, 4, grad, 4, exp_avg, exp_avg_sq, 4, NULL, NULL, NULL, num_threads);
}

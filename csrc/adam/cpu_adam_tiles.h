/* What the translation units of the CPU Adam step share: adam/cpu_adam.c (the scalar path and
 * the dispatch) and adam/cpu_adam_avx2.c, adam/cpu_adam_avx512.c (one vector width each, built in
 * parallel; see [Note: op builds] in zero/ops/builder.py). Internal to the op's library. */
#ifndef ZERO_ADAM_CPU_ADAM_TILES_H
#define ZERO_ADAM_CPU_ADAM_TILES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "adam/adam_formats.h"
#include "adam/adam_math.h"
#include "common/dtypes.h"
#include "common/simd.h"

/* Work is handed to threads in tiles of TILE elements. One tile of param, grad, exp_avg and
 * exp_avg_sq is 16K x 16 bytes = 256 KB: it stays in a core's L2 while it is read and written
 * back, each of its four streams is 64 KB long (plenty for the hardware prefetchers), and one
 * tile is ~10 us of work, so handing tiles out dynamically costs nothing measurable. Dynamic
 * rather than static scheduling matters on a busy host: when another process takes a core away
 * from one of our threads, the others take over its remaining tiles instead of waiting for it at
 * the end of the loop. TILE is a multiple of every vector width, so only the last tile of a
 * buffer has a partial vector at its end. */
enum { TILE = 1 << 14 };

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Every path updates a tile through a function of this shape; od == ZERO_F32 means "no copy-out". */
#define TILE_PARAMS \
    int64_t n, float *p, const void *g, int gd, float *m, float *v, void *out, int od, const zero_adam_coeffs *c

/* Inside a tile function: call TYPED(n, p, g, GD, m, v, out, OD, c) with the grad dtype GD and the
 * copy-out dtype OD as constants, one instantiation per pair, so the always-inlined TYPED has no
 * dtype switch left in its inner loop. */
#define DISPATCH_OUT(TYPED, GD)                           \
    if (out == NULL)                                      \
        TYPED(n, p, g, GD, m, v, NULL, ZERO_F32, c);      \
    else if (od == ZERO_BF16)                             \
        TYPED(n, p, g, GD, m, v, out, ZERO_BF16, c);      \
    else                                                  \
        TYPED(n, p, g, GD, m, v, out, ZERO_F16, c);
#define DISPATCH_DTYPES(TYPED)        \
    if (gd == ZERO_F32) {             \
        DISPATCH_OUT(TYPED, ZERO_F32)  \
    } else if (gd == ZERO_BF16) {     \
        DISPATCH_OUT(TYPED, ZERO_BF16) \
    } else {                          \
        DISPATCH_OUT(TYPED, ZERO_F16)  \
    }

/* The shape of a tile function of the low-precision formats (see adam_fmt_tile_scalar). */
#define FMT_TILE_PARAMS                                                                                      \
    int64_t n, int64_t at, void *p, const void *g, int gd, void *m, void *v, float *ms, float *vs, void *out, \
        int od, const zero_adam_coeffs *c, const zero_adam_format *f, const zero_sr_key *key

#if ZERO_HAVE_X86_SIMD
#include "common/simd_width.h"

/* [Note: streaming stores]
 * param, exp_avg and exp_avg_sq are read and written back in the same pass, so their cache lines
 * are already present when written: ordinary stores are right for them (streaming stores measured
 * ~15% slower on them). The 16-bit copy-out is write-only: an ordinary store would first read
 * each destination line into the cache (2 more bytes per element of traffic), so it is written
 * with non-temporal stores when aligned, which skip that read (~5% faster end to end). */

/* Finish an fp16 copy-out whose vector conversion met a NaN: the hardware keeps NaN payloads,
 * torch and dtypes.h write a canonical quiet NaN. Rare, so done element by element. */
static inline void fix_f16_nans(uint16_t *out, const float *x, int w) {
    for (int k = 0; k < w; k++)
        if (x[k] != x[k]) out[k] = zero_f32_to_f16(x[k]);
}

/* The partial last vector of a tile (rest < W <= 16 elements), zero-padded to a full vector. */
typedef struct {
    float p[16], m[16], v[16];
    uint16_t out[16];
    _Alignas(64) unsigned char g[64];
} partial_vec;

static inline void partial_in(partial_vec *t, int64_t rest, const float *p, const void *g, int gd,
                              const float *m, const float *v) {
    memset(t, 0, sizeof *t);
    memcpy(t->p, p, (size_t)rest * 4);
    memcpy(t->m, m, (size_t)rest * 4);
    memcpy(t->v, v, (size_t)rest * 4);
    memcpy(t->g, g, (size_t)rest * (size_t)zero_dtype_size(gd));
}

static inline void partial_out(const partial_vec *t, int64_t rest, float *p, float *m, float *v, uint16_t *out) {
    memcpy(p, t->p, (size_t)rest * 4);
    memcpy(m, t->m, (size_t)rest * 4);
    memcpy(v, t->v, (size_t)rest * 4);
    if (out != NULL) memcpy(out, t->out, (size_t)rest * 2);
}

/* The vector tiles, one translation unit per width (ZV_ENTRY functions of the bodies), hidden:
 * the library exports its zero_* entry points only. */
#define ZERO_INTERNAL __attribute__((visibility("hidden")))
ZERO_INTERNAL void adam_tile_avx2(TILE_PARAMS);
ZERO_INTERNAL void adam_tile_avx512(TILE_PARAMS);
ZERO_INTERNAL void adam_fmt_tile_avx2(FMT_TILE_PARAMS);
ZERO_INTERNAL void adam_fmt_tile_avx512(FMT_TILE_PARAMS);
#endif /* ZERO_HAVE_X86_SIMD */

#endif /* ZERO_ADAM_CPU_ADAM_TILES_H */

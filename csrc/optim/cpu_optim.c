/* CPU Lion and Adagrad steps: see cpu_optim.h. One tile function per optimizer, instantiated per
 * (grad dtype, copy-out dtype) pair so the inner loops have no dtype switch left and vectorise. */
#include "optim/cpu_optim.h"

#include <math.h>
#include <stddef.h>

#include "common/dtypes.h"
#include "common/simd.h"

enum { TILE = 1 << 14 }; /* elements a thread takes at a time, as cpu_adam.c's */

#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef struct {
    float lr, beta1, beta2, weight_decay, grad_scale;
} lion_coeffs;

static ALWAYS_INLINE void lion_typed(int64_t n, float *p, const void *g, int gd, float *m, void *out, int od,
                                     const lion_coeffs *c) {
    const float lr = c->lr, b1 = c->beta1, b2 = c->beta2, scale = c->grad_scale;
    const float decay = 1.0f - lr * c->weight_decay, one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
    for (int64_t i = 0; i < n; i++) {
        const float gi = zero_load_f32(g, gd, i) / scale;
        const float mi = m[i];
        const float blend = mi * b1 + one_b1 * gi;
        const float sign = blend > 0.0f ? 1.0f : (blend < 0.0f ? -1.0f : blend); /* torch's sign: NaN stays NaN */
        const float pi = p[i] * decay + (-lr) * sign;
        p[i] = pi;
        m[i] = mi * b2 + one_b2 * gi;
        if (od != ZERO_F32) zero_store_f32(out, od, i, pi);
    }
}

typedef struct {
    float clr, eps, weight_decay, grad_scale;
} adagrad_coeffs;

static ALWAYS_INLINE void adagrad_typed(int64_t n, float *p, const void *g, int gd, float *s, void *out, int od,
                                        const adagrad_coeffs *c) {
    const float neg_clr = -c->clr, eps = c->eps, wd = c->weight_decay, scale = c->grad_scale;
    for (int64_t i = 0; i < n; i++) {
        float gi = zero_load_f32(g, gd, i) / scale;
        const float pi = p[i];
        if (wd != 0.0f) gi = gi + wd * pi;
        const float si = s[i] + gi * gi;
        s[i] = si;
        const float updated = pi + neg_clr * (gi / (sqrtf(si) + eps));
        p[i] = updated;
        if (od != ZERO_F32) zero_store_f32(out, od, i, updated);
    }
}

/* one instantiation per (grad dtype, copy-out dtype): the dtypes are constants inside */
#define DISPATCH(TYPED, N, P, G, GD, S, OUT, OD, C)                                                     \
    do {                                                                                                \
        if ((GD) == ZERO_F32) {                                                                         \
            if ((OD) == ZERO_F32) TYPED(N, P, G, ZERO_F32, S, OUT, ZERO_F32, C);                        \
            else if ((OD) == ZERO_BF16) TYPED(N, P, G, ZERO_F32, S, OUT, ZERO_BF16, C);                 \
            else TYPED(N, P, G, ZERO_F32, S, OUT, ZERO_F16, C);                                         \
        } else if ((GD) == ZERO_BF16) {                                                                 \
            if ((OD) == ZERO_F32) TYPED(N, P, G, ZERO_BF16, S, OUT, ZERO_F32, C);                       \
            else if ((OD) == ZERO_BF16) TYPED(N, P, G, ZERO_BF16, S, OUT, ZERO_BF16, C);                \
            else TYPED(N, P, G, ZERO_BF16, S, OUT, ZERO_F16, C);                                        \
        } else {                                                                                        \
            if ((OD) == ZERO_F32) TYPED(N, P, G, ZERO_F16, S, OUT, ZERO_F32, C);                        \
            else if ((OD) == ZERO_BF16) TYPED(N, P, G, ZERO_F16, S, OUT, ZERO_BF16, C);                 \
            else TYPED(N, P, G, ZERO_F16, S, OUT, ZERO_F16, C);                                         \
        }                                                                                               \
    } while (0)

/* a tile of either optimizer: `coeffs` is its lion_coeffs or adagrad_coeffs */
typedef void (*tile_fn)(int64_t n, float *p, const void *g, int gd, float *state, void *out, int od, const void *coeffs);

static void lion_tile(int64_t n, float *p, const void *g, int gd, float *m, void *out, int od, const void *coeffs) {
    const lion_coeffs *c = coeffs;
    DISPATCH(lion_typed, n, p, g, gd, m, out, od, c);
}

static void adagrad_tile(int64_t n, float *p, const void *g, int gd, float *s, void *out, int od, const void *coeffs) {
    const adagrad_coeffs *c = coeffs;
    DISPATCH(adagrad_typed, n, p, g, gd, s, out, od, c);
}

/* The step over n elements in tiles of TILE, handed to OpenMP threads as cpu_adam.c does. */
static void run_tiles(tile_fn tile, int64_t n, float *param, const void *grad, int32_t grad_dtype, float *state,
                      void *out16, int32_t out16_dtype, const void *coeffs, int num_threads) {
    const int od = out16 ? out16_dtype : ZERO_F32;
    const size_t gsz = (size_t)zero_dtype_size(grad_dtype);
    const int64_t ntiles = (n + TILE - 1) / TILE;
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ntiles > 1 && threads > 1)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t b = t * TILE, cnt = n - b < TILE ? n - b : TILE;
        tile(cnt, param + b, (const char *)grad + (size_t)b * gsz, grad_dtype, state + b,
             out16 ? (void *)((uint16_t *)out16 + b) : NULL, od, coeffs);
    }
}

static int bad_dtypes(int32_t grad_dtype, const void *out16, int32_t out16_dtype) {
    const int grad_ok = grad_dtype == ZERO_F32 || grad_dtype == ZERO_BF16 || grad_dtype == ZERO_F16;
    const int out_ok = out16 == NULL || out16_dtype == ZERO_BF16 || out16_dtype == ZERO_F16;
    return !grad_ok || !out_ok;
}

int zero_cpu_lion_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *exp_avg, void *out16,
                       int32_t out16_dtype, float lr, float beta1, float beta2, float weight_decay, float grad_scale,
                       int num_threads) {
    if (n < 0 || (n > 0 && (!param || !grad || !exp_avg)) || bad_dtypes(grad_dtype, out16, out16_dtype) ||
        !(grad_scale > 0.0f) || !(lr >= 0.0f) || !(weight_decay >= 0.0f))
        return ZERO_BAD_ARGUMENT;
    const lion_coeffs c = {lr, beta1, beta2, weight_decay, grad_scale};
    run_tiles(lion_tile, n, param, grad, grad_dtype, exp_avg, out16, out16_dtype, &c, num_threads);
    return ZERO_OK;
}

int zero_cpu_adagrad_step(int64_t n, float *param, const void *grad, int32_t grad_dtype, float *state_sum,
                          void *out16, int32_t out16_dtype, float clr, float eps, float weight_decay, float grad_scale,
                          int num_threads) {
    if (n < 0 || (n > 0 && (!param || !grad || !state_sum)) || bad_dtypes(grad_dtype, out16, out16_dtype) ||
        !(grad_scale > 0.0f) || !(clr >= 0.0f) || !(eps >= 0.0f) || !(weight_decay >= 0.0f))
        return ZERO_BAD_ARGUMENT;
    const adagrad_coeffs c = {clr, eps, weight_decay, grad_scale};
    run_tiles(adagrad_tile, n, param, grad, grad_dtype, state_sum, out16, out16_dtype, &c, num_threads);
    return ZERO_OK;
}

/* qwZ's weight blocks on the CPU (see quant.h): OpenMP over blocks; the loops are plain C that
 * the compiler vectorizes (division and rint are IEEE operations in every lane). */
#include "quant/quant.h"

#include <string.h>

#include "common/simd.h"

int zero_qw_quantize(int64_t n, const void *x, int dtype, uint8_t *msg, int num_threads) {
    if (n < 0 || (n && (!x || !msg)) || dtype < ZERO_F32 || dtype > ZERO_BF16) return ZERO_BAD_ARGUMENT;
    const int64_t blocks = zero_qw_blocks(n), codes = zero_qw_codes_bytes(n);
    float *scales = (float *)(msg + codes); /* msg comes from torch's allocator: 4-byte aligned */
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;
    for (int64_t i = n; i < codes; i++) msg[i] = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 16)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * ZERO_QW_BLOCK, len = lo + ZERO_QW_BLOCK <= n ? ZERO_QW_BLOCK : n - lo;
        float v[ZERO_QW_BLOCK], m = 0.0f;
        for (int64_t i = 0; i < len; i++) v[i] = zero_load_f32(x, dtype, lo + i);
        for (int64_t i = 0; i < len; i++) m = zero_qw_amax(m, fabsf(v[i]));
        const float s = m / 127.0f;
        scales[b] = s;
        int8_t *out = (int8_t *)msg + lo;
        for (int64_t i = 0; i < len; i++) out[i] = zero_qw_code(v[i], s);
    }
    return ZERO_OK;
}

int zero_qw_dequantize(int64_t k, int64_t n, const uint8_t *msgs, void *out, int dtype, int num_threads) {
    if (k < 0 || n < 0 || ((k && n) && (!msgs || !out)) || dtype < ZERO_F32 || dtype > ZERO_BF16)
        return ZERO_BAD_ARGUMENT;
    const int64_t blocks = zero_qw_blocks(n), row = zero_qw_message_bytes(n), codes = zero_qw_codes_bytes(n);
    const int threads = zero_cpu_thread_count(num_threads);
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (k * blocks > 16)
    for (int64_t rb = 0; rb < k * blocks; rb++) {
        const int64_t r = rb / blocks, b = rb % blocks;
        const int64_t lo = b * ZERO_QW_BLOCK, len = lo + ZERO_QW_BLOCK <= n ? ZERO_QW_BLOCK : n - lo;
        const uint8_t *msg = msgs + r * row;
        float s;
        memcpy(&s, msg + codes + 4 * b, 4);
        const int8_t *c = (const int8_t *)msg + lo;
        for (int64_t i = 0; i < len; i++) zero_store_f32(out, dtype, r * n + lo + i, (float)c[i] * s);
    }
    return ZERO_OK;
}

/* The vector path of the 1-bit pack and unpack-mean, written once over the width macros of
 * common/simd_width.h; onebit/onebit.c includes it once per width (see [Note: one body per vector
 * width]) and gets block_scale_avx2, block_bits_avx2, unpack_block_avx2 and their _avx512 twins.
 * No include guard, on purpose. */

/* y = y + x over a block, and its scale sqrt(mean(y^2)): the squares summed in ZV_W fp32 lanes,
 * the lanes added by lane_sum (onebit.c), then the tail. */
ZV_FN float ZV_NAME(block_scale)(int64_t len, const float *x, float *y) {
    zv acc = zv_zero();
    int64_t i = 0;
    for (; i + ZV_W <= len; i += ZV_W) {
        const zv v = zv_add(zv_loadu(y + i), zv_loadu(x + i));
        zv_storeu(y + i, v);
        acc = zv_fmadd(v, v, acc);
    }
    return finish_scale(ZV_(lane_sum_)(acc), i, len, x, y);
}

/* The bits of a block (bit l of a byte: y >= 0) and its new error y - (bit ? s : -s); ZV_W / 8
 * whole bytes per vector, the rest by the scalar path. */
ZV_FN void ZV_NAME(block_bits)(int64_t len, float *y, float s, uint8_t *bits) {
    const zv zero = zv_zero(), pos = zv_set1(s), neg = zv_set1(-s);
    int64_t j = 0;
    for (; 8 * j + ZV_W <= len; j += ZV_W / 8) {
        const zv v = zv_loadu(y + 8 * j);
        const zv_mask ge = zv_cmpge(v, zero);
        const unsigned m = zv_mask_bits(ge);
        for (int b = 0; b < ZV_W / 8; b++) bits[j + b] = (uint8_t)(m >> (8 * b));
        zv_storeu(y + 8 * j, zv_sub(v, zv_blend(neg, pos, ge)));
    }
    if (8 * j < len) block_bits_scalar(len - 8 * j, y + 8 * j, s, bits + j);
}

/* The mean over k messages of (bit ? s : -s) for one block: per vector, the k signed scales added
 * in message order, then divided by k, as the scalar path does per element. */
ZV_FN void ZV_NAME(unpack_block)(int64_t k, int64_t len, const uint8_t *bits, int64_t row_bytes, const float *scales,
                                 int64_t row_scales, float *out) {
    const int64_t full = len / ZV_W * ZV_W;
    for (int64_t i = 0; i < full; i += ZV_W) {
        zv acc = zv_zero();
        for (int64_t r = 0; r < k; r++) {
            const float s = scales[r * row_scales];
            const uint8_t *b = bits + r * row_bytes + (i >> 3);
            const zv_mask on = zv_mask_of_bits(b);
            acc = zv_add(acc, zv_blend(zv_set1(-s), zv_set1(s), on));
        }
        zv_storeu(out + i, zv_div(acc, zv_set1((float)k)));
    }
    if (full < len) /* the tail, from a byte boundary: the same sums in the same order */
        unpack_block_scalar(k, len - full, bits + full / 8, row_bytes, scales, row_scales, out + full);
}

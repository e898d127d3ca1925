/* The vector path of the CPU Adam step, written once over the width macros of
 * common/simd_width.h; adam/cpu_adam.c includes it once per width (see [Note: one body per vector
 * width]) and gets adam_tile_avx2 and adam_tile_avx512. No include guard, on purpose.
 *
 * The vector body updates exactly one vector of ZV_W elements at index i, with the operations of
 * [Note: adam math] in its order (the same fmas, IEEE sqrt and division), so each lane computes
 * what zero_adam_element computes. A tile runs the body over its full vectors; its last partial
 * vector (at most ZV_W - 1 elements, only in the last tile of a buffer) goes through the same body
 * via zero-padded local copies (partial_vec), so every element of a buffer gets the same
 * arithmetic. */

/* ZV_W gradient elements of dtype gd, widened to fp32. bf16 -> fp32 is a 16-bit left shift. */
ZV_INLINE zv ZV_NAME(adam_load)(const void *g, int gd, int64_t i) {
    if (gd == ZERO_F32) return zv_loadu((const float *)g + i);
    const zvh h = zvh_loadu((const uint16_t *)g + i);
    if (gd == ZERO_BF16) return zvi_as_float(zvi_slli32(zvh_widen32(h), 16));
    return zvh_f16_to_zv(h);
}

/* Store ZV_W 16-bit values; `nt`: with a non-temporal store (o must then be aligned to a whole
 * zvh). See [Note: streaming stores]. */
ZV_INLINE void ZV_NAME(adam_put16)(uint16_t *o, zvh h, int nt) {
    if (nt)
        zvh_stream(o, h);
    else
        zvh_storeu(o, h);
}

/* Round ZV_W fp32 values to bf16/fp16 (nearest even, as common/dtypes.h) and store them. */
ZV_INLINE void ZV_NAME(adam_store16)(void *out, int od, int64_t i, zv x, int nt) {
    uint16_t *o = (uint16_t *)out + i;
    const zv_mask nan = zv_isnan(x);
    if (od == ZERO_BF16) {
        /* bits + 0x7fff + (bit 16 of bits), then keep the top half; NaN -> 0x7fc0 */
        const zvi u = zv_as_int(x);
        const zvi lsb = zvi_and(zvi_srli32(u, 16), zvi_set1(1));
        zvi r = zvi_srli32(zvi_add32(u, zvi_add32(lsb, zvi_set1(0x7fff))), 16);
        r = zvi_blend(r, zvi_set1(0x7fc0), nan);
        ZV_NAME(adam_put16)(o, zvi_narrow16(r), nt);
    } else {
        ZV_NAME(adam_put16)(o, zv_to_f16(x), nt);
        if (zv_mask_any(nan)) {
            float tmp[ZV_W];
            zv_storeu(tmp, x);
            fix_f16_nans(o, tmp, ZV_W);
        }
    }
}

/* The per-step constants of zero_adam_coeffs, one per lane. */
typedef struct {
    zv grad_scale, decay, l2, beta2, one_minus_beta1, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps;
} ZV_NAME(adam_coeffs);

ZV_INLINE void ZV_NAME(adam_vec)(float *p, const void *g, int gd, float *m, float *v, void *out, int od, int nt,
                                 int64_t i, const zero_adam_coeffs *c, const ZV_NAME(adam_coeffs) *k) {
    zv grad = ZV_NAME(adam_load)(g, gd, i);
    if (c->scale_grad) grad = zv_div(grad, k->grad_scale);
    zv param = zv_loadu(p + i);
    if (c->adamw)
        param = zv_mul(param, k->decay);
    else
        grad = zv_fmadd(k->l2, param, grad);
    zv mi = zv_loadu(m + i);
    mi = zv_fmadd(k->one_minus_beta1, zv_sub(grad, mi), mi);
    zv vi = zv_mul(zv_loadu(v + i), k->beta2);
    vi = zv_fmadd(zv_mul(k->one_minus_beta2, grad), grad, vi);
    const zv denom = zv_fmadd(zv_sqrt(vi), k->inv_bc2_sqrt, k->eps);
    param = zv_add(param, zv_div(zv_mul(k->neg_step_size, mi), denom));
    zv_storeu(p + i, param);
    zv_storeu(m + i, mi);
    zv_storeu(v + i, vi);
    if (od != ZERO_F32) ZV_NAME(adam_store16)(out, od, i, param, nt);
}

ZV_INLINE void ZV_NAME(adam_tile_typed)(TILE_PARAMS) {
    const ZV_NAME(adam_coeffs) k = {
        zv_set1(c->grad_scale),      zv_set1(c->decay),
        zv_set1(c->l2),              zv_set1(c->beta2),
        zv_set1(c->one_minus_beta1), zv_set1(c->one_minus_beta2),
        zv_set1(c->neg_step_size),   zv_set1(c->inv_bc2_sqrt),
        zv_set1(c->eps),
    };
    const int64_t full = n - n % ZV_W;
    const int nt = od != ZERO_F32 && ((uintptr_t)out % sizeof(zvh)) == 0;
    for (int64_t i = 0; i < full; i += ZV_W) ZV_NAME(adam_vec)(p, g, gd, m, v, out, od, nt, i, c, &k);
    if (nt) _mm_sfence(); /* make the streamed copy-out visible before the tile is reported done */
    if (full == n) return;
    partial_vec t;
    partial_in(&t, n - full, p + full, (const char *)g + full * zero_dtype_size(gd), gd, m + full, v + full);
    ZV_NAME(adam_vec)(t.p, t.g, gd, t.m, t.v, t.out, od, 0, 0, c, &k);
    partial_out(&t, n - full, p + full, m + full, v + full, od == ZERO_F32 ? NULL : (uint16_t *)out + full);
}

ZV_ENTRY void ZV_NAME(adam_tile)(TILE_PARAMS) { DISPATCH_DTYPES(ZV_NAME(adam_tile_typed)) }

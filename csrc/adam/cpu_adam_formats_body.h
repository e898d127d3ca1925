/* The vector path of the CPU Adam step in the low-precision state formats of adam/adam_formats.h
 * (a bf16 master, bf16 or 8-bit moments, stochastic rounding), written once over the width
 * macros of common/simd_width.h; adam/cpu_adam.c includes it once per width, after
 * adam/cpu_adam_body.h (whose adam_store16 it uses), and gets adam_fmt_tile_avx2 and
 * adam_fmt_tile_avx512. No include guard, on purpose.
 *
 * Each lane performs the operations of zero_adam_fmt_element (adam/adam_formats.h) in its order:
 * the same widening, the same update (adam_vec's arithmetic), the same random words and roundings,
 * the same 8-bit codes, so every lane gives the scalar reference's bits. A block's elements past
 * its last full vector go through zero_adam_fmt_element itself. */

/* lowbias32 on every lane (zero_hash32). */
ZV_INLINE zvi ZV_NAME(fmt_hash)(zvi x) {
    x = zvi_xor(x, zvi_srli32(x, 16));
    x = zvi_mullo32(x, zvi_set1(0x7feb352d));
    x = zvi_xor(x, zvi_srli32(x, 15));
    x = zvi_mullo32(x, zvi_set1((int32_t)0x846ca68bu));
    return zvi_xor(x, zvi_srli32(x, 16));
}

/* zero_sr_word for the ZV_W elements with global indices i0, i0 + 1, ...: the high half of the
 * index changes inside a vector only where its low half wraps. */
ZV_INLINE zvi ZV_NAME(fmt_word)(const zero_sr_key *k, uint64_t i0) {
    const zvi lo0 = zvi_set1((int32_t)(uint32_t)i0);
    const zvi lo = zvi_add32(lo0, zvi_iota());
    const uint32_t hi = (uint32_t)(i0 >> 32);
    const zvi key = zvi_set1((int32_t)(k->k0 + hi * 0x9e3779b9u));
    if ((uint32_t)i0 <= UINT32_MAX - (ZV_W - 1)) return ZV_NAME(fmt_hash)(zvi_xor(lo, key)); /* no wrap inside */
    const zvi next = zvi_set1((int32_t)(k->k0 + (hi + 1u) * 0x9e3779b9u));
    return ZV_NAME(fmt_hash)(zvi_xor(lo, zvi_blend(key, next, zvi_cmplt_u32(lo, lo0))));
}

/* zero_sr_word for elements i0 + 2 l + odd of lane l (the even or odd elements of 2 ZV_W). */
ZV_INLINE zvi ZV_NAME(fmt_word_paired)(const zero_sr_key *k, uint64_t i0, int odd) {
    const zvi lo0 = zvi_set1((int32_t)(uint32_t)i0);
    const zvi lo = zvi_add32(lo0, zvi_add32(zvi_slli32(zvi_iota(), 1), zvi_set1(odd)));
    const uint32_t hi = (uint32_t)(i0 >> 32);
    const zvi key = zvi_set1((int32_t)(k->k0 + hi * 0x9e3779b9u));
    if ((uint32_t)i0 <= UINT32_MAX - (2 * ZV_W - 1)) return ZV_NAME(fmt_hash)(zvi_xor(lo, key));
    const zvi next = zvi_set1((int32_t)(k->k0 + (hi + 1u) * 0x9e3779b9u));
    return ZV_NAME(fmt_hash)(zvi_xor(lo, zvi_blend(key, next, zvi_cmplt_u32(lo, lo0))));
}

/* ZV_W fp32 or bf16 values at p + i, widened. */
ZV_INLINE zv ZV_NAME(fmt_load)(const void *p, int dtype, int64_t i) {
    if (dtype != ZERO_BF16) return zv_loadu((const float *)p + i);
    return zvi_as_float(zvi_slli32(zvh_widen32(zvh_loadu((const uint16_t *)p + i)), 16));
}

/* x rounded to bf16 (stochastically with the low 16 bits of r, else to nearest even; NaN ->
 * 0x7fc0), in the high half of each 32-bit lane (the low half is not cleared). */
ZV_INLINE zvi ZV_NAME(fmt_bf16_high)(zv x, int stochastic, zvi r) {
    const zvi u = zv_as_int(x);
    zvi h;
    if (stochastic) {
        h = zvi_add32(u, zvi_and(r, zvi_set1(0xffff)));
    } else {
        const zvi lsb = zvi_and(zvi_srli32(u, 16), zvi_set1(1));
        h = zvi_add32(u, zvi_add32(lsb, zvi_set1(0x7fff)));
    }
    return zvi_blend(h, zvi_set1(0x7fc00000), zv_isnan(x));
}

/* The same, as 32-bit lanes holding the 16 bits. */
ZV_INLINE zvi ZV_NAME(fmt_bf16)(zv x, int stochastic, zvi r) {
    return zvi_srli32(ZV_NAME(fmt_bf16_high)(x, stochastic, r), 16);
}

/* Decode ZV_W 8-bit codes (zero_q8_decode_m / _v): `ebits` exponent bits, `signed_` codes keep
 * the sign in bit 7. */
ZV_INLINE zv ZV_NAME(fmt_q8_decode)(const uint8_t *p, int ebits, int signed_, float scale) {
    const int32_t fmax = (1 << ebits) - 1;
    const zvi c = zvb_load(p);
    const zvi mag = signed_ ? zvi_and(c, zvi_set1(0x7f)) : c;
    zv x = zvi_as_float(zvi_slli32(zvi_add32(mag, zvi_set1((127 - fmax) << 3)), 20));
    const zv_mask small = zvi_cmpgt32(zvi_set1(8), mag);
    if (zv_mask_any(small)) /* the few codes below the normal range (usually none in a vector) */
        x = zv_blend(x, zv_mul(zvi_to_float(mag), zvi_as_float(zvi_set1((127 - fmax - 2) << 23))), small);
    x = zv_mul(x, zv_set1(scale));
    if (signed_) x = zvi_as_float(zvi_or(zv_as_int(x), zvi_slli32(zvi_and(c, zvi_set1(0x80)), 24)));
    return x;
}

/* Encode ZV_W values (zero_q8_encode_m / _v) with the block's 1 / scale, and store the bytes. */
ZV_INLINE void ZV_NAME(fmt_q8_encode)(uint8_t *p, zv x, int ebits, int signed_, zv inv) {
    const int32_t fmax = (1 << ebits) - 1;
    const zvi bits = zv_as_int(x);
    const zv r = zv_mul(signed_ ? zvi_as_float(zvi_and(bits, zvi_set1(0x7fffffff))) : x, inv);
    const zvi u = zv_as_int(r);
    zvi c = zvi_sub32(zvi_srli32(zvi_add32(u, zvi_set1(0x80000)), 20), zvi_set1((127 - fmax) << 3));
    const zv_mask normal = zvi_cmpgt32(zvi_srli32(u, 23), zvi_set1(127 - fmax));
    if (zv_mask_bits(normal) != (1u << ZV_W) - 1u) { /* some lane below the normal range (zeros, tiny values) */
        const zv t = zv_mul(r, zvi_as_float(zvi_set1((127 + fmax + 2) << 23)));
        c = zvi_blend(zv_trunc_int(zv_add(t, zv_set1(0.5f))), c, normal);
    }
    c = zvi_min_u32(c, zvi_set1((fmax << 3) | 7));
    if (signed_) c = zvi_or(c, zvi_and(zvi_srli32(bits, 24), zvi_set1(0x80)));
    zvb_store(p, c);
}

/* ZV_W elements at index i of the step in the formats `f` (zero_adam_fmt_element, one lane each);
 * 8-bit moments go to mq / vq and raise the running maxima. */
ZV_INLINE void ZV_NAME(fmt_vec)(int64_t i, void *p, const void *g, int gd, int pd, int sd, int sr, void *m, void *v,
                                float ms, float vs, void *out, int od, int nt, const zero_adam_coeffs *c,
                                const ZV_NAME(adam_coeffs) *k, const zero_adam_format *f, const zero_sr_key *key,
                                float *mq, float *vq, zv *mmax, zv *vmax) {
    zv grad = ZV_NAME(adam_load)(g, gd, i);
    if (c->scale_grad) grad = zv_div(grad, k->grad_scale);
    zv param = ZV_NAME(fmt_load)(p, pd, i);
    zv mi, vi;
    if (sd == ZERO_Q8) {
        mi = ZV_NAME(fmt_q8_decode)((const uint8_t *)m + i, ZERO_Q8_M_EBITS, 1, ms);
        vi = ZV_NAME(fmt_q8_decode)((const uint8_t *)v + i, ZERO_Q8_V_EBITS, 0, vs);
    } else {
        mi = ZV_NAME(fmt_load)(m, sd, i);
        vi = ZV_NAME(fmt_load)(v, sd, i);
    }
    if (c->adamw)
        param = zv_mul(param, k->decay);
    else
        grad = zv_fmadd(k->l2, param, grad);
    mi = zv_fmadd(k->one_minus_beta1, zv_sub(grad, mi), mi);
    vi = zv_fmadd(zv_mul(k->one_minus_beta2, grad), grad, zv_mul(vi, k->beta2));
    const zv denom = zv_fmadd(zv_sqrt(vi), k->inv_bc2_sqrt, k->eps);
    param = zv_add(param, zv_div(zv_mul(k->neg_step_size, mi), denom));

    const int need_word = sr && (pd == ZERO_BF16 || sd == ZERO_BF16);
    const zvi w = need_word ? ZV_NAME(fmt_word)(key, f->index + (uint64_t)i) : zvi_set1(0);
    if (pd == ZERO_BF16) {
        const zvh h = zvi_narrow16(ZV_NAME(fmt_bf16)(param, sr, w));
        zvh_storeu((uint16_t *)p + i, h);
        if (od == ZERO_BF16) /* the model's copy is the master's bits */
            ZV_NAME(adam_put16)((uint16_t *)out + i, h, nt);
        else if (od == ZERO_F16)
            ZV_NAME(adam_store16)(out, od, i, zvi_as_float(zvi_slli32(zvh_widen32(h), 16)), nt);
    } else {
        zv_storeu((float *)p + i, param);
        if (od != ZERO_F32) ZV_NAME(adam_store16)(out, od, i, param, nt);
    }
    if (sd == ZERO_Q8) {
        zv_storeu(mq, mi);
        zv_storeu(vq, vi);
        *mmax = zv_max(*mmax, zvi_as_float(zvi_and(zv_as_int(mi), zvi_set1(0x7fffffff))));
        *vmax = zv_max(*vmax, vi);
    } else if (sd == ZERO_BF16) {
        zvh_storeu((uint16_t *)m + i, zvi_narrow16(ZV_NAME(fmt_bf16)(mi, sr, zvi_srli32(w, 16))));
        const zvi w2 = sr ? zvi_srli32(zvi_mullo32(zvi_xor(w, zvi_set1((int32_t)key->k2)),
                                                   zvi_set1((int32_t)0x9e3779b9u)), 16) : w;
        zvh_storeu((uint16_t *)v + i, zvi_narrow16(ZV_NAME(fmt_bf16)(vi, sr, w2)));
    } else {
        zv_storeu((float *)m + i, mi);
        zv_storeu((float *)v + i, vi);
    }
}

/* [Note: paired 16-bit lanes]
 * With a bf16 master, bf16 moments and a bf16 gradient every stream is 16-bit, and the element
 * order inside a step does not matter (each element's update is its own). So 2 ZV_W elements are
 * loaded as ZV_W 32-bit lanes and split without a shuffle: the even elements are the low halves
 * (shifted up), the odd ones the high halves (masked); they are stored back the same way. Widening
 * and narrowing shuffles run on one vector port of the two that 512-bit code has; this leaves
 * them out. Each element still gets exactly zero_adam_fmt_element's operations and random word. */
ZV_INLINE void ZV_NAME(fmt_half16)(zv grad, zv *param, zv *mi, zv *vi, const zero_adam_coeffs *c,
                                   const ZV_NAME(adam_coeffs) *k) {
    if (c->scale_grad) grad = zv_div(grad, k->grad_scale);
    if (c->adamw)
        *param = zv_mul(*param, k->decay);
    else
        grad = zv_fmadd(k->l2, *param, grad);
    *mi = zv_fmadd(k->one_minus_beta1, zv_sub(grad, *mi), *mi);
    *vi = zv_fmadd(zv_mul(k->one_minus_beta2, grad), grad, zv_mul(*vi, k->beta2));
    const zv denom = zv_fmadd(zv_sqrt(*vi), k->inv_bc2_sqrt, k->eps);
    *param = zv_add(*param, zv_div(zv_mul(k->neg_step_size, *mi), denom));
}

ZV_INLINE void ZV_NAME(fmt_pair16)(int64_t i, uint16_t *p, const uint16_t *g, uint16_t *m, uint16_t *v,
                                   uint16_t *out, int nt, int sr, const zero_adam_coeffs *c,
                                   const ZV_NAME(adam_coeffs) *k, const zero_adam_format *f, const zero_sr_key *key) {
    const zvi high = zvi_set1((int32_t)0xffff0000u);
    const zvi G = zvi_loadu(g + i), P = zvi_loadu(p + i), M = zvi_loadu(m + i), V = zvi_loadu(v + i);
    zv ge = zvi_as_float(zvi_slli32(G, 16)), go = zvi_as_float(zvi_and(G, high));
    zv pe = zvi_as_float(zvi_slli32(P, 16)), po = zvi_as_float(zvi_and(P, high));
    zv me = zvi_as_float(zvi_slli32(M, 16)), mo = zvi_as_float(zvi_and(M, high));
    zv ve = zvi_as_float(zvi_slli32(V, 16)), vo = zvi_as_float(zvi_and(V, high));
    ZV_NAME(fmt_half16)(ge, &pe, &me, &ve, c, k);
    ZV_NAME(fmt_half16)(go, &po, &mo, &vo, c, k);
    zvi we = zvi_set1(0), wo = zvi_set1(0), we2 = we, wo2 = wo;
    if (sr) {
        const uint64_t i0 = f->index + (uint64_t)i;
        we = ZV_NAME(fmt_word_paired)(key, i0, 0);
        wo = ZV_NAME(fmt_word_paired)(key, i0, 1);
        const zvi k2 = zvi_set1((int32_t)key->k2), golden = zvi_set1((int32_t)0x9e3779b9u);
        we2 = zvi_srli32(zvi_mullo32(zvi_xor(we, k2), golden), 16);
        wo2 = zvi_srli32(zvi_mullo32(zvi_xor(wo, k2), golden), 16);
    }
    /* even results in the low halves (shifted down), odd ones in the high halves */
#define PAIR16(E, O, RE, RO) \
    zvi_or(zvi_srli32(ZV_NAME(fmt_bf16_high)(E, sr, RE), 16), zvi_and(ZV_NAME(fmt_bf16_high)(O, sr, RO), high))
    const zvi Pn = PAIR16(pe, po, we, wo);
    zvi_storeu(p + i, Pn);
    if (out != NULL) {
        if (nt)
            zvi_stream(out + i, Pn);
        else
            zvi_storeu(out + i, Pn);
    }
    zvi_storeu(m + i, PAIR16(me, mo, zvi_srli32(we, 16), zvi_srli32(wo, 16)));
    zvi_storeu(v + i, PAIR16(ve, vo, we2, wo2));
#undef PAIR16
}

/* One tile: n elements from element `at` (a multiple of ZERO_Q8_BLOCK), block by block. gd, pd, sd
 * and sr are f's dtypes and rounding as constants (one instantiation each, no switch left inside). */
ZV_INLINE void ZV_NAME(adam_fmt_tile_typed)(int64_t n, int64_t at, void *p, const void *g, int gd, int pd, int sd,
                                            int sr, void *m, void *v, float *ms, float *vs, void *out, int od,
                                            const zero_adam_coeffs *c, const zero_adam_format *f,
                                            const zero_sr_key *key) {
    const ZV_NAME(adam_coeffs) k = {
        zv_set1(c->grad_scale),      zv_set1(c->decay),
        zv_set1(c->l2),              zv_set1(c->beta2),
        zv_set1(c->one_minus_beta1), zv_set1(c->one_minus_beta2),
        zv_set1(c->neg_step_size),   zv_set1(c->inv_bc2_sqrt),
        zv_set1(c->eps),
    };
    const int q8 = sd == ZERO_Q8;
    /* the model's copy is write-only: streamed when aligned (see [Note: streaming stores]) */
    const int nt = od != ZERO_F32 && ((uintptr_t)((uint16_t *)out + at) % sizeof(zvh)) == 0;
    const int nt_pair = od != ZERO_F32 && ((uintptr_t)((uint16_t *)out + at) % sizeof(zvi)) == 0;
    _Alignas(64) float mq[ZERO_Q8_BLOCK], vq[ZERO_Q8_BLOCK];
    for (int64_t b0 = 0; b0 < n; b0 += ZERO_Q8_BLOCK) {
        const int64_t nb = n - b0 < ZERO_Q8_BLOCK ? n - b0 : ZERO_Q8_BLOCK;
        const int64_t full = nb - nb % ZV_W, first = at + b0;
        float *bms = q8 ? ms + first / ZERO_Q8_BLOCK : NULL, *bvs = q8 ? vs + first / ZERO_Q8_BLOCK : NULL;
        const float msc = q8 ? *bms : 0.0f, vsc = q8 ? *bvs : 0.0f;
        zv mmax = zv_zero(), vmax = zv_zero();
        int64_t j0 = 0;
        if (pd == ZERO_BF16 && sd == ZERO_BF16 && gd == ZERO_BF16 && od != ZERO_F16) /* [Note: paired 16-bit lanes] */
            for (; j0 + 2 * ZV_W <= full; j0 += 2 * ZV_W)
                ZV_NAME(fmt_pair16)(first + j0, (uint16_t *)p, (const uint16_t *)g, (uint16_t *)m, (uint16_t *)v,
                                    od == ZERO_BF16 ? (uint16_t *)out : NULL, nt_pair, sr, c, &k, f, key);
        for (int64_t j = j0; j < full; j += ZV_W)
            ZV_NAME(fmt_vec)(first + j, p, g, gd, pd, sd, sr, m, v, msc, vsc, out, od, nt, c, &k, f, key, mq + j, vq + j,
                             &mmax, &vmax);
        float mtop = 0.0f, vtop = 0.0f;
        for (int64_t j = full; j < nb; j++) {
            zero_adam_fmt_element(first + j, p, g, gd, m, v, msc, vsc, out, od, c, f, key, &mq[j], &vq[j]);
            if (q8) {
                mtop = fmaxf(mtop, fabsf(mq[j]));
                vtop = fmaxf(vtop, vq[j]);
            }
        }
        if (!q8) continue;
        mtop = fmaxf(mtop, zv_reduce_max(mmax));
        vtop = fmaxf(vtop, zv_reduce_max(vmax));
        const uint32_t me = zero_q8_exponent(mtop), ve = zero_q8_exponent(vtop);
        *bms = zero_q8_scale(me);
        *bvs = zero_q8_scale(ve);
        const zv m_inv = zv_set1(zero_q8_inv_scale(me)), v_inv = zv_set1(zero_q8_inv_scale(ve));
        for (int64_t j = 0; j < full; j += ZV_W) {
            ZV_NAME(fmt_q8_encode)((uint8_t *)m + first + j, zv_loadu(mq + j), ZERO_Q8_M_EBITS, 1, m_inv);
            ZV_NAME(fmt_q8_encode)((uint8_t *)v + first + j, zv_loadu(vq + j), ZERO_Q8_V_EBITS, 0, v_inv);
        }
        for (int64_t j = full; j < nb; j++) {
            ((uint8_t *)m)[first + j] = zero_q8_encode_m(mq[j], zero_q8_inv_scale(me));
            ((uint8_t *)v)[first + j] = zero_q8_encode_v(vq[j], zero_q8_inv_scale(ve));
        }
    }
    if (nt) _mm_sfence(); /* make the streamed copy visible before the tile is reported done */
}

#define FMT_TYPED(GD, PD, SD, SR) ZV_NAME(adam_fmt_tile_typed)(n, at, p, g, GD, PD, SD, SR, m, v, ms, vs, out, od, c, f, key)
#define FMT_SR(GD, PD, SD)          \
    if (f->stochastic)              \
        FMT_TYPED(GD, PD, SD, 1);   \
    else                            \
        FMT_TYPED(GD, PD, SD, 0);
#define FMT_STATE(GD, PD)                      \
    if (f->state_dtype == ZERO_Q8) {           \
        FMT_SR(GD, PD, ZERO_Q8)                \
    } else if (f->state_dtype == ZERO_BF16) {  \
        FMT_SR(GD, PD, ZERO_BF16)              \
    } else {                                   \
        FMT_SR(GD, PD, ZERO_F32)               \
    }
#define FMT_MASTER(GD)                     \
    if (f->master_dtype == ZERO_BF16) {    \
        FMT_STATE(GD, ZERO_BF16)           \
    } else {                               \
        FMT_STATE(GD, ZERO_F32)            \
    }

ZV_ENTRY void ZV_NAME(adam_fmt_tile)(FMT_TILE_PARAMS) {
    if (gd == ZERO_F32) {
        FMT_MASTER(ZERO_F32)
    } else if (gd == ZERO_BF16) {
        FMT_MASTER(ZERO_BF16)
    } else {
        FMT_MASTER(ZERO_F16)
    }
}
#undef FMT_TYPED
#undef FMT_SR
#undef FMT_STATE
#undef FMT_MASTER

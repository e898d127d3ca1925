/* The vector operations of the CPU block-sparse attention (a vec_ops table), written once over the
 * width macros of common/simd_width.h; sparse_attention/sparse_attention.c includes it once per
 * width (see [Note: one body per vector width]) and gets ops_avx2 and ops_avx512. No include
 * guard, on purpose.
 *
 * The GEMM is a register-blocked micro-kernel: a tile of mr <= 6 rows x 2 vectors of C stays in
 * registers over the whole K loop, each step broadcasting one element of A per row against a row
 * of B (12 accumulators: AVX2 has 16 registers, AVX-512 32). Whole tiles first, then one vector,
 * then (AVX-512 only, with a lane mask) half a vector, then a scalar tail. */

/* exp(x) for x <= 88: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact to fp32),
 * exp(r) by its degree-7 Taylor polynomial (relative error < 1e-8 on that interval), times 2^n
 * built in the exponent bits. Below ln(FLT_MIN) (and for -inf) the result is 0. */
ZV_INLINE zv ZV_NAME(exp)(zv x) {
    const zv_mask under = zv_cmplt(x, zv_set1(EXP_LO));
    /* operands in this order: max/min return their second operand when either is NaN, so a NaN
       score stays NaN (as in the scalar path) instead of becoming a clamp bound */
    x = zv_min(zv_set1(EXP_HI), zv_max(zv_set1(EXP_LO), x));
    const zv n = zv_round(zv_mul(x, zv_set1(EXP_LOG2E)));
    zv r = zv_fnmadd(n, zv_set1(EXP_LN2_HI), x);
    r = zv_fnmadd(n, zv_set1(EXP_LN2_LO), r);
    zv y = zv_set1(1.0f / 5040);
    y = zv_fmadd(y, r, zv_set1(1.0f / 720));
    y = zv_fmadd(y, r, zv_set1(1.0f / 120));
    y = zv_fmadd(y, r, zv_set1(1.0f / 24));
    y = zv_fmadd(y, r, zv_set1(1.0f / 6));
    y = zv_fmadd(y, r, zv_set1(0.5f));
    y = zv_fmadd(y, r, zv_set1(1.0f));
    y = zv_fmadd(y, r, zv_set1(1.0f));
    const zvi e = zvi_slli32(zvi_add32(zv_to_int(n), zvi_set1(127)), 23);
    return zv_zero_where(under, zv_mul(y, zvi_as_float(e)));
}

/* mr rows x (2 vectors if wide, else the `lanes` of one vector) columns of C, kept in registers
 * over the whole K loop. */
ZV_INLINE void ZV_NAME(tile)(const int mr, const int wide, const zv_lanes lanes, int64_t K, const float *A,
                             int64_t a_rs, int64_t a_cs, const float *B, int64_t ldb, float *C, int64_t ldc,
                             int accumulate) {
    zv c0[6], c1[6];
    for (int r = 0; r < mr; r++) {
        c0[r] = accumulate ? zv_loadu_lanes(lanes, C + r * ldc) : zv_zero();
        c1[r] = (accumulate && wide) ? zv_loadu(C + r * ldc + ZV_W) : zv_zero();
    }
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * ldb, *a = A + k * a_cs;
        const zv b0 = zv_loadu_lanes(lanes, b);
        const zv b1 = wide ? zv_loadu(b + ZV_W) : b0;
        for (int r = 0; r < mr; r++) {
            const zv x = zv_broadcast(a + r * a_rs);
            c0[r] = zv_fmadd(x, b0, c0[r]);
            if (wide) c1[r] = zv_fmadd(x, b1, c1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        zv_storeu_lanes(C + r * ldc, lanes, c0[r]);
        if (wide) zv_storeu(C + r * ldc + ZV_W, c1[r]);
    }
}

/* Rows i .. i+mr of C: two-vector tiles, a one-vector tile, a masked half-vector tile (AVX-512),
 * then a scalar tail. */
ZV_INLINE void ZV_NAME(panel)(const int mr, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs,
                              const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t j = 0;
    for (; j + 2 * ZV_W <= N; j += 2 * ZV_W)
        ZV_NAME(tile)(mr, 1, ZV_ALL_LANES, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
    if (j + ZV_W <= N) {
        ZV_NAME(tile)(mr, 0, ZV_ALL_LANES, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
        j += ZV_W;
    }
    if (ZV_HAS_LANE_MASKS && j + ZV_W / 2 <= N) {
        ZV_NAME(tile)(mr, 0, ZV_LOW_HALF, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
        j += ZV_W / 2;
    }
    if (j < N) gemm_scalar(mr, N - j, K, A, a_rs, a_cs, B + j, ldb, C + j, ldc, accumulate);
}

ZV_FN void ZV_NAME(gemm)(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_rs, int64_t a_cs, const float *B,
                         int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t i = 0;
    for (; i + 6 <= M; i += 6)
        ZV_NAME(panel)(6, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
    if (i + 4 <= M) {
        ZV_NAME(panel)(4, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
        i += 4;
    }
    if (i + 2 <= M) {
        ZV_NAME(panel)(2, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
        i += 2;
    }
    if (i < M) ZV_NAME(panel)(1, N, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc, accumulate);
}

/* A NaN anywhere makes the row's max NaN (see nan_max). */
ZV_FN float ZV_NAME(row_max)(int64_t n, const float *x) {
    zv m = zv_set1(-INFINITY);
    zv_mask nan = ZV_NO_LANES;
    int64_t j = 0;
    for (; j + ZV_W <= n; j += ZV_W) {
        const zv v = zv_loadu(x + j);
        m = zv_max(m, v);
        nan = zv_mask_or(nan, zv_isnan(v));
    }
    if (zv_mask_any(nan)) return NAN;
    float r = zv_reduce_max(m);
    for (; j < n; j++) r = nan_max(r, x[j]);
    return r;
}

ZV_FN float ZV_NAME(exp_sub_sum)(int64_t n, float *x, float sub) {
    const zv s = zv_set1(sub);
    zv acc = zv_zero();
    int64_t j = 0;
    for (; j + ZV_W <= n; j += ZV_W) {
        const zv e = ZV_NAME(exp)(zv_sub(zv_loadu(x + j), s));
        zv_storeu(x + j, e);
        acc = zv_add(acc, e);
    }
    return zv_reduce_add(acc) + exp_sub_sum_scalar(n - j, x + j, sub);
}

ZV_FN void ZV_NAME(scale_row)(int64_t n, float *x, float a) {
    const zv va = zv_set1(a);
    int64_t j = 0;
    for (; j + ZV_W <= n; j += ZV_W) zv_storeu(x + j, zv_mul(zv_loadu(x + j), va));
    scale_row_scalar(n - j, x + j, a);
}

ZV_FN void ZV_NAME(ds_row)(int64_t n, float *dp, const float *p, float delta) {
    const zv d = zv_set1(delta);
    int64_t j = 0;
    for (; j + ZV_W <= n; j += ZV_W) zv_storeu(dp + j, zv_mul(zv_loadu(p + j), zv_sub(zv_loadu(dp + j), d)));
    ds_row_scalar(n - j, dp + j, p + j, delta);
}

static const vec_ops ZV_NAME(ops) = {ZV_NAME(gemm), ZV_NAME(row_max), ZV_NAME(exp_sub_sum), ZV_NAME(scale_row),
                                     ZV_NAME(ds_row)};

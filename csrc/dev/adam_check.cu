/* adam_check: the CUDA Adam kernels against the shared scalar references, without Python.
 *
 * Runs zero_fused_adam (adam/fused_adam.cu) and, on the host, zero_adam_element (the function the
 * CPU kernel's scalar path calls, adam/adam_math.h) over the same inputs for a few steps, for
 * every grad dtype and copy-out dtype, at sizes and offsets that reach each path of the kernel:
 * the four-wide path, a misaligned 16-bit copy and gradient inside it, the element-by-element
 * path, several chunks, and tails. Both sides compute [Note: adam math] with IEEE operations, so
 * every result must match bit for bit.
 *
 * Then zero_fused_adam_step_fmt against zero_adam_block_ref (adam/adam_formats.h) run block by
 * block on the host, for every master format (fp32, bf16), state format (fp32, bf16, 8-bit
 * codes), rounding (nearest, stochastic), grad dtype (fp32, bf16) and copy-out (none, bf16,
 * fp16), at sizes that are not a multiple of the 8-bit block: every stored byte (master,
 * moments, block scales, copy) must match. Prints one line per case and exits 1 on any mismatch.
 *
 * Build and run on a GPU machine, from the repository root:
 *   nvcc -O3 -arch=native -I csrc csrc/dev/adam_check.cu csrc/adam/fused_adam.cu -o adam_check && ./adam_check
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "adam/adam_formats.h"
#include "adam/adam_math.h"
#include "adam/fused_adam.h"
#include "common/dtypes.h"

#define CUDA_CHECK(call)                                                                              \
    do {                                                                                              \
        cudaError_t err_ = (call);                                                                    \
        if (err_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            exit(2);                                                                                  \
        }                                                                                             \
    } while (0)

static const char *dtype_name(int dtype) {
    return dtype == ZERO_F32 ? "fp32" : dtype == ZERO_F16 ? "fp16" : dtype == ZERO_BF16 ? "bf16" : "none";
}

/* A deterministic uniform value in [-1, 1). */
static float uniform(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*state >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

/* One case: n elements; param and the moments at element `offset` (0 = aligned) of their
 * allocations, the gradient and the 16-bit copy at `offset + skew`. Returns the number of
 * mismatching elements. */
static int64_t check_case(int64_t n, int offset, int skew, int gd, int od, int adamw, double grad_scale) {
    const int gsize = zero_dtype_size(gd);
    const int steps = 5;
    uint64_t seed = 0x5eed + (uint64_t)n;
    float *p = (float *)malloc(n * 4), *m = (float *)calloc(n, 4), *v = (float *)calloc(n, 4);
    unsigned char *g = (unsigned char *)malloc(n * gsize);
    uint16_t *out = (uint16_t *)malloc(n * 2);
    float *got_p = (float *)malloc(n * 4), *got_m = (float *)malloc(n * 4), *got_v = (float *)malloc(n * 4);
    uint16_t *got_out = (uint16_t *)malloc(n * 2);
    for (int64_t i = 0; i < n; i++) p[i] = uniform(&seed);

    float *dp, *dm, *dv;
    unsigned char *dg;
    uint16_t *dout;
    CUDA_CHECK(cudaMalloc(&dp, (n + offset) * 4));
    CUDA_CHECK(cudaMalloc(&dm, (n + offset) * 4));
    CUDA_CHECK(cudaMalloc(&dv, (n + offset) * 4));
    CUDA_CHECK(cudaMalloc(&dg, (n + offset + skew) * gsize));
    CUDA_CHECK(cudaMalloc(&dout, (n + offset + skew) * 2));
    float *pp = dp + offset, *pm = dm + offset, *pv = dv + offset;
    void *pg = dg + (size_t)(offset + skew) * gsize;
    void *pout = dout + offset + skew;
    CUDA_CHECK(cudaMemcpy(pp, p, n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(pm, m, n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(pv, v, n * 4, cudaMemcpyHostToDevice));

    zero_adam_config cfg = {1e-2, 0.9, 0.999, 1e-8, 0.1, grad_scale, 1, adamw, 1};
    for (int step = 1; step <= steps; step++) {
        for (int64_t i = 0; i < n; i++) zero_store_f32(g, gd, i, uniform(&seed) * (float)grad_scale);
        CUDA_CHECK(cudaMemcpy(pg, g, n * gsize, cudaMemcpyHostToDevice));
        cfg.step = step;
        const int rc = zero_fused_adam(1, &pp, (const void *const *)&pg, gd, &pm, &pv, od == ZERO_F32 ? NULL : &pout,
                                       od, &n, &cfg, 0);
        if (rc != 0) {
            fprintf(stderr, "zero_fused_adam returned %d\n", rc);
            exit(2);
        }
        const zero_adam_coeffs c = zero_adam_coeffs_of(&cfg);
        for (int64_t i = 0; i < n; i++) {
            zero_adam_element(&p[i], &m[i], &v[i], zero_load_f32(g, gd, i), &c);
            if (od != ZERO_F32) zero_store_f32(out, od, i, p[i]);
        }
    }
    CUDA_CHECK(cudaMemcpy(got_p, pp, n * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_m, pm, n * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_v, pv, n * 4, cudaMemcpyDeviceToHost));
    if (od != ZERO_F32) CUDA_CHECK(cudaMemcpy(got_out, pout, n * 2, cudaMemcpyDeviceToHost));

    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int same = memcmp(&p[i], &got_p[i], 4) == 0 && memcmp(&m[i], &got_m[i], 4) == 0 &&
                         memcmp(&v[i], &got_v[i], 4) == 0 && (od == ZERO_F32 || out[i] == got_out[i]);
        if (!same && bad++ == 0)
            fprintf(stderr, "  first mismatch at %lld: p %.9g vs %.9g, m %.9g vs %.9g, v %.9g vs %.9g\n", (long long)i,
                    p[i], got_p[i], m[i], got_m[i], v[i], got_v[i]);
    }
    printf("n=%-8lld offset=%d skew=%d grad=%s out=%s %s grad_scale=%g: %s\n", (long long)n, offset, skew,
           dtype_name(gd), dtype_name(od), adamw ? "adamw" : "adam_l2", grad_scale, bad ? "MISMATCH" : "ok");

    CUDA_CHECK(cudaFree(dp));
    CUDA_CHECK(cudaFree(dm));
    CUDA_CHECK(cudaFree(dv));
    CUDA_CHECK(cudaFree(dg));
    CUDA_CHECK(cudaFree(dout));
    free(p), free(m), free(v), free(g), free(out), free(got_p), free(got_m), free(got_v), free(got_out);
    return bad;
}

/* ---------------------------------------------------------------- state formats */

static const char *format_name(int dtype) { return dtype == ZERO_Q8 ? "int8" : dtype_name(dtype); }

/* Element i's gradient: uniform, with magnitudes spread over 2^-23 .. 1 so that a block's
 * 8-bit codes reach their subnormal range, and zero in the whole second block (whose scales then
 * stay 0). */
static float fmt_grad(uint64_t *state, int64_t i, double grad_scale) {
    const float u = uniform(state);
    if (i / ZERO_Q8_BLOCK == 1) return 0.0f;
    return u * ldexpf(1.0f, -(int)(i % 24)) * (float)grad_scale;
}

static int same_bytes(const void *a, const void *b, int64_t i, int size) {
    return memcmp((const char *)a + i * size, (const char *)b + i * size, size) == 0;
}

/* One case: n elements in the formats (pd, sd, sr), a few steps of zero_fused_adam_step_fmt on
 * the GPU against zero_adam_block_ref on the host. Returns the number of mismatching elements
 * and block scales. */
static int64_t check_fmt_case(int64_t n, int pd, int sd, int sr, int gd, int od) {
    const int adamw = gd == ZERO_F32;
    const double grad_scale = adamw ? 1.0 : 8.0;
    const int steps = 5;
    const int psize = zero_dtype_size(pd), ssize = sd == ZERO_Q8 ? 1 : zero_dtype_size(sd), gsize = zero_dtype_size(gd);
    const int q8 = sd == ZERO_Q8;
    const int64_t blocks = (n + ZERO_Q8_BLOCK - 1) / ZERO_Q8_BLOCK;
    /* an index range that crosses 2^32, so both halves of the generator's counter change */
    const zero_adam_format fmt = {pd, sd, sr, 0x5eed0000ull + (uint64_t)n, (1ull << 32) - 300};
    uint64_t seed = 0xf0f0 + (uint64_t)n;

    /* host state and what comes back from the GPU; moments and scales start at zero */
    void *p = malloc(n * psize), *m = calloc(n, ssize), *v = calloc(n, ssize), *g = malloc(n * gsize);
    void *out = calloc(n, 2), *got_p = malloc(n * psize), *got_m = malloc(n * ssize), *got_v = malloc(n * ssize);
    void *got_out = calloc(n, 2);
    float *ms = (float *)calloc(blocks, 4), *vs = (float *)calloc(blocks, 4);
    float *got_ms = (float *)calloc(blocks, 4), *got_vs = (float *)calloc(blocks, 4);
    for (int64_t i = 0; i < n; i++) zero_store_f32(p, pd, i, uniform(&seed));

    void *dp, *dm, *dv, *dg, *dout;
    float *dms = NULL, *dvs = NULL;
    CUDA_CHECK(cudaMalloc(&dp, n * psize));
    CUDA_CHECK(cudaMalloc(&dm, n * ssize));
    CUDA_CHECK(cudaMalloc(&dv, n * ssize));
    CUDA_CHECK(cudaMalloc(&dg, n * gsize));
    CUDA_CHECK(cudaMalloc(&dout, n * 2));
    CUDA_CHECK(cudaMemcpy(dp, p, n * psize, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dm, m, n * ssize, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dv, v, n * ssize, cudaMemcpyHostToDevice));
    if (q8) {
        CUDA_CHECK(cudaMalloc(&dms, blocks * 4));
        CUDA_CHECK(cudaMalloc(&dvs, blocks * 4));
        CUDA_CHECK(cudaMemcpy(dms, ms, blocks * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(dvs, vs, blocks * 4, cudaMemcpyHostToDevice));
    }

    zero_adam_config cfg = {1e-3, 0.9, 0.999, 1e-8, 0.1, grad_scale, 1, adamw, 1};
    for (int step = 1; step <= steps; step++) {
        for (int64_t i = 0; i < n; i++) zero_store_f32(g, gd, i, fmt_grad(&seed, i, grad_scale));
        CUDA_CHECK(cudaMemcpy(dg, g, n * gsize, cudaMemcpyHostToDevice));
        cfg.step = step;
        const int rc = zero_fused_adam_step_fmt(n, dp, dg, gd, dm, dv, dms, dvs, od == ZERO_F32 ? NULL : dout, od, &cfg,
                                                &fmt, 0);
        if (rc != 0) {
            fprintf(stderr, "zero_fused_adam_step_fmt returned %d\n", rc);
            exit(2);
        }
        const zero_adam_coeffs c = zero_adam_coeffs_of(&cfg);
        const zero_sr_key key = zero_sr_key_of(fmt.seed, cfg.step);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = b * ZERO_Q8_BLOCK, len = n - at < (int64_t)ZERO_Q8_BLOCK ? n - at : (int64_t)ZERO_Q8_BLOCK;
            zero_adam_block_ref(len, at, p, g, gd, m, v, q8 ? &ms[b] : NULL, q8 ? &vs[b] : NULL,
                                od == ZERO_F32 ? NULL : out, od, &c, &fmt, &key);
        }
    }
    CUDA_CHECK(cudaMemcpy(got_p, dp, n * psize, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_m, dm, n * ssize, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_v, dv, n * ssize, cudaMemcpyDeviceToHost));
    if (od != ZERO_F32) CUDA_CHECK(cudaMemcpy(got_out, dout, n * 2, cudaMemcpyDeviceToHost));
    if (q8) {
        CUDA_CHECK(cudaMemcpy(got_ms, dms, blocks * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(got_vs, dvs, blocks * 4, cudaMemcpyDeviceToHost));
    }

    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int same = same_bytes(p, got_p, i, psize) && same_bytes(m, got_m, i, ssize) &&
                         same_bytes(v, got_v, i, ssize) && (od == ZERO_F32 || same_bytes(out, got_out, i, 2));
        if (!same && bad++ == 0)
            fprintf(stderr, "  first mismatch at element %lld: p %.9g vs %.9g, m %.9g vs %.9g, v %.9g vs %.9g\n",
                    (long long)i, zero_load_master(p, pd, i), zero_load_master(got_p, pd, i),
                    q8 ? (double)((uint8_t *)m)[i] : zero_load_master(m, sd, i),
                    q8 ? (double)((uint8_t *)got_m)[i] : zero_load_master(got_m, sd, i),
                    q8 ? (double)((uint8_t *)v)[i] : zero_load_master(v, sd, i),
                    q8 ? (double)((uint8_t *)got_v)[i] : zero_load_master(got_v, sd, i));
    }
    for (int64_t b = 0; q8 && b < blocks; b++) {
        if (!(same_bytes(ms, got_ms, b, 4) && same_bytes(vs, got_vs, b, 4)) && bad++ == 0)
            fprintf(stderr, "  first mismatch in the scales of block %lld: m %g vs %g, v %g vs %g\n", (long long)b,
                    ms[b], got_ms[b], vs[b], got_vs[b]);
    }
    printf("n=%-8lld master=%s state=%s %s grad=%s out=%s %s: %s\n", (long long)n, format_name(pd), format_name(sd),
           sr ? "stochastic" : "nearest   ", dtype_name(gd), dtype_name(od), adamw ? "adamw  " : "adam_l2",
           bad ? "MISMATCH" : "ok");

    CUDA_CHECK(cudaFree(dp));
    CUDA_CHECK(cudaFree(dm));
    CUDA_CHECK(cudaFree(dv));
    CUDA_CHECK(cudaFree(dg));
    CUDA_CHECK(cudaFree(dout));
    if (q8) {
        CUDA_CHECK(cudaFree(dms));
        CUDA_CHECK(cudaFree(dvs));
    }
    free(p), free(m), free(v), free(g), free(out), free(got_p), free(got_m), free(got_v), free(got_out);
    free(ms), free(vs), free(got_ms), free(got_vs);
    return bad;
}

/* The entry refuses what it cannot do before launching anything. Returns the number of calls
 * that were not refused. */
static int64_t check_fmt_refusals(void) {
    const zero_adam_config cfg = {1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, 1, 1};
    const zero_adam_format good = {ZERO_BF16, ZERO_Q8, 1, 0, 0};
    zero_adam_format bad_state = good, bad_master = good;
    bad_state.state_dtype = ZERO_F16;
    bad_master.master_dtype = ZERO_Q8;
    static char dummy[16]; /* never dereferenced: every call below is refused first */
    float *s = (float *)dummy;
    const int rcs[] = {
        zero_fused_adam_step_fmt(4, dummy, dummy, ZERO_F32, dummy, dummy, s, s, NULL, 0, &cfg, &bad_state, 0),
        zero_fused_adam_step_fmt(4, dummy, dummy, ZERO_F32, dummy, dummy, s, s, NULL, 0, &cfg, &bad_master, 0),
        zero_fused_adam_step_fmt(4, dummy, dummy, ZERO_F32, dummy, dummy, NULL, NULL, NULL, 0, &cfg, &good, 0),
        zero_fused_adam_step_fmt(4, dummy, dummy, ZERO_BYTES, dummy, dummy, s, s, NULL, 0, &cfg, &good, 0),
        zero_fused_adam_step_fmt(4, dummy, dummy, ZERO_F32, dummy, dummy, s, s, dummy, ZERO_F32, &cfg, &good, 0),
        zero_fused_adam_step_fmt(4, dummy, dummy, ZERO_F32, dummy, dummy, s, s, NULL, 0, &cfg, NULL, 0),
        zero_fused_adam_step_fmt(-1, dummy, dummy, ZERO_F32, dummy, dummy, s, s, NULL, 0, &cfg, &good, 0),
    };
    int64_t accepted = 0;
    for (size_t k = 0; k < sizeof rcs / sizeof rcs[0]; k++) accepted += rcs[k] != -1;
    printf("bad formats, missing scales, bad dtypes and sizes are refused: %s\n", accepted ? "NO" : "ok");
    return accepted;
}

int main(void) {
    /* (n, offset of every buffer, extra offset of the gradient and the 16-bit copy) */
    const struct { int64_t n; int offset, skew; } shapes[] = {
        {3, 0, 0},             /* tail only */
        {1000, 0, 0},          /* four-wide path */
        {1000, 0, 1},          /* four-wide path, misaligned gradient and copy-out */
        {1001, 1, 0},          /* misaligned fp32 buffers: element by element */
        {3 * 16384 + 5, 0, 3}, /* several chunks, a tail, misaligned gradient and copy-out */
    };
    const int grads[] = {ZERO_F32, ZERO_BF16, ZERO_F16};
    const int outs[] = {ZERO_F32 /* no copy-out */, ZERO_BF16, ZERO_F16};
    int64_t bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int gi = 0; gi < 3; gi++)
            for (int oi = 0; oi < 3; oi++)
                for (int adamw = 0; adamw <= 1; adamw++)
                    bad += check_case(shapes[s].n, shapes[s].offset, shapes[s].skew, grads[gi], outs[oi], adamw,
                                      adamw ? 1.0 : 8.0);

    /* state formats: 4 blocks (the second all zeros, the last of 232 elements), then 193 */
    const int64_t fmt_sizes[] = {1000, 3 * 16384 + 77};
    const int masters[] = {ZERO_F32, ZERO_BF16}, states[] = {ZERO_F32, ZERO_BF16, ZERO_Q8};
    const int fmt_grads[] = {ZERO_F32, ZERO_BF16};
    for (int si = 0; si < 2; si++)
        for (int pi = 0; pi < 2; pi++)
            for (int ti = 0; ti < 3; ti++)
                for (int sr = 0; sr <= 1; sr++)
                    for (int gi = 0; gi < 2; gi++)
                        for (int oi = 0; oi < 3; oi++)
                            bad += check_fmt_case(fmt_sizes[si], masters[pi], states[ti], sr, fmt_grads[gi], outs[oi]);
    bad += check_fmt_refusals();
    printf(bad ? "FAILED: %lld mismatching elements\n" : "all cases match bit for bit\n", (long long)bad);
    return bad ? 1 : 0;
}

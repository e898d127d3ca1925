/* adam_check: the CUDA Adam kernel against the shared scalar reference, without Python.
 *
 * Runs zero_fused_adam (adam/fused_adam.cu) and, on the host, zero_adam_element (the function the
 * CPU kernel's scalar path calls, adam/adam_math.h) over the same inputs for a few steps, for
 * every grad dtype and copy-out dtype, at sizes and offsets that reach each path of the kernel:
 * the four-wide path, a misaligned 16-bit copy and gradient inside it, the element-by-element
 * path, several chunks, and tails. Both sides compute [Note: adam math] with IEEE operations, so
 * every result must match bit for bit. Prints one line per case and exits 1 on any mismatch.
 *
 * Build and run on a GPU machine, from the repository root:
 *   nvcc -O3 -arch=native -I csrc csrc/dev/adam_check.cu csrc/adam/fused_adam.cu -o adam_check && ./adam_check
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

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
    printf(bad ? "FAILED: %lld mismatching elements\n" : "all cases match bit for bit\n", (long long)bad);
    return bad ? 1 : 0;
}

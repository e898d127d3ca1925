/* The memory-bandwidth ceiling of a CPU Adam step, for benchmarks/bench_adam.py only (it is not
 * part of zero's native ops). The benchmark builds it with the C compiler and flags zero's ops use
 * and calls it through ctypes.
 *
 * zero_stream_pass has the memory traffic of an fp32 Adam step and almost no arithmetic: it reads
 * param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq (28 bytes per
 * element; each written buffer gets grad added), split into the same tiles over the same OpenMP
 * threads as zero_cpu_adam_step (csrc/adam/cpu_adam.c). The loop is plain C, compiled without
 * -march: even 16-byte vectors issue loads and stores far faster than DRAM delivers them, so at
 * the sizes the benchmark uses (buffers much larger than the caches) it runs at memory speed. */
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

enum { TILE = 1 << 14 }; /* as in cpu_adam.c */

/* num_threads <= 0: the OpenMP default. Returns 0, or -1 for n < 0. */
int zero_stream_pass(int64_t n, float *restrict param, const float *restrict grad, float *restrict exp_avg,
                     float *restrict exp_avg_sq, int num_threads) {
    if (n < 0) return -1;
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
        const int64_t b = t * TILE, end = n - b < TILE ? n : b + TILE;
        for (int64_t i = b; i < end; i++) {
            param[i] += grad[i];
            exp_avg[i] += grad[i];
            exp_avg_sq[i] += grad[i];
        }
    }
    return 0;
}

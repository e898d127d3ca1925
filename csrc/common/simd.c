/* The one run-time SIMD detection of the CPU kernels; see [Note: SIMD levels] in simd.h. */
#include "common/simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if ZERO_HAVE_X86_SIMD
#include <cpuid.h>
#endif

static int detect(int level) {
    if (level == ZERO_SIMD_SCALAR) return 1;
#if ZERO_HAVE_X86_SIMD
    __builtin_cpu_init();
    if (level == ZERO_SIMD_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (level == ZERO_SIMD_AVX2) {
        /* F16C is CPUID leaf 1, ECX bit 29; read directly as not every compiler names it */
        unsigned a, b, c, d;
        int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
#endif
    return 0;
}

/* Every kernel call resolves its level, and CPUID is slow under a hypervisor (each one exits to
 * it: several microseconds per call measured in this project's VM), so the answers are asked once
 * and kept: bit `level` of `known` set when `level` was asked, of `have` when it runs here. Two
 * threads asking at once both store the same bits. */
static unsigned known, have;

int zero_simd_available(int level) {
    if (level < 0 || level >= ZERO_SIMD_LEVELS) return 0;
    const unsigned bit = 1u << level;
    if (!(__atomic_load_n(&known, __ATOMIC_ACQUIRE) & bit)) {
        if (detect(level)) __atomic_fetch_or(&have, bit, __ATOMIC_RELAXED);
        __atomic_fetch_or(&known, bit, __ATOMIC_RELEASE);
    }
    return (__atomic_load_n(&have, __ATOMIC_RELAXED) & bit) != 0;
}

int zero_simd_best(void) {
    for (int level = ZERO_SIMD_LEVELS - 1; level > ZERO_SIMD_SCALAR; level--)
        if (zero_simd_available(level)) return level;
    return ZERO_SIMD_SCALAR;
}

int zero_simd_resolve(int simd) {
    if (simd == ZERO_SIMD_BEST) return zero_simd_best();
    if (simd < ZERO_SIMD_SCALAR || simd >= ZERO_SIMD_LEVELS || !zero_simd_available(simd))
        return ZERO_SIMD_UNAVAILABLE;
    return simd;
}

const char *zero_simd_name(int level) {
    switch (level) {
    case ZERO_SIMD_SCALAR: return "scalar";
    case ZERO_SIMD_AVX2: return "avx2";
    case ZERO_SIMD_AVX512: return "avx512";
    default: return "unknown";
    }
}

int zero_cpu_thread_count(int num_threads) {
#ifdef _OPENMP
    return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
    (void)num_threads;
    return 1;
#endif
}

/* Run-time SIMD choice shared by every CPU kernel (adam/cpu_adam.c, onebit/onebit.c,
 * sparse_attention/sparse_attention.c), their thread count, and their return codes.
 *
 * [Note: SIMD levels]
 * Each CPU kernel has a portable scalar path, the reference, and on x86-64 (GCC or Clang) an AVX2
 * and an AVX-512 path. The SIMD paths are compiled with function target attributes
 * (ZERO_TARGET_AVX2, ZERO_TARGET_AVX512), never with -march=native, so one build runs on any
 * x86-64 host; which path a call takes is decided per call by zero_simd_resolve(), from what the
 * CPU reports (common/simd.c, the one place that asks it). Elsewhere (ARM, MSVC), and with
 * -DZERO_NO_X86_SIMD, only the scalar path is compiled and the SIMD levels report unavailable.
 * A kernel writes its vector code once for both widths: see [Note: one body per vector width] in
 * common/simd_width.h. */
#ifndef ZERO_COMMON_SIMD_H
#define ZERO_COMMON_SIMD_H

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ZERO_NO_X86_SIMD)
#define ZERO_HAVE_X86_SIMD 1
#else
#define ZERO_HAVE_X86_SIMD 0
#endif

/* What each x86 level's functions are compiled for; zero_simd_available() checks the same
 * features at run time. */
#define ZERO_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZERO_TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

#ifdef __cplusplus
extern "C" {
#endif

/* Instruction-set levels, lowest to highest. ZERO_SIMD_BEST asks for the best one available. */
enum {
    ZERO_SIMD_BEST = -1,
    ZERO_SIMD_SCALAR = 0, /* portable C: every CPU */
    ZERO_SIMD_AVX2 = 1,   /* x86-64 with AVX2 + FMA + F16C */
    ZERO_SIMD_AVX512 = 2, /* x86-64 with AVX-512 F + BW */
    ZERO_SIMD_LEVELS = 3
};

/* Return codes of every CPU kernel entry point; a negative code means nothing was written. */
enum {
    ZERO_OK = 0,
    ZERO_BAD_ARGUMENT = -1,    /* a null pointer, a bad size or dtype, a config torch refuses */
    ZERO_SIMD_UNAVAILABLE = -2 /* the forced SIMD level does not run on this CPU / build */
};

/* 1 when `level` runs on this CPU and was compiled into this build, else 0. */
int zero_simd_available(int level);

/* The highest available level. */
int zero_simd_best(void);

/* The level a kernel runs for its `simd` argument: the best one for ZERO_SIMD_BEST, a forced
 * level itself when it is available, else ZERO_SIMD_UNAVAILABLE. */
int zero_simd_resolve(int simd);

/* "scalar", "avx2", "avx512"; "unknown" for anything else. */
const char *zero_simd_name(int level);

/* The OpenMP threads a kernel uses: num_threads when > 0, else OpenMP's default (1 without
 * OpenMP). */
int zero_cpu_thread_count(int num_threads);

#ifdef __cplusplus
}
#endif
#endif

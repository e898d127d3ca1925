/* The AVX2 tiles of the CPU Adam step (adam_tile_avx2, adam_fmt_tile_avx2): the bodies of
 * [Note: one body per vector width] at this width, in a translation unit of their own so that the
 * widths compile in parallel. The portable path and the dispatch are in adam/cpu_adam.c. */
#include "adam/cpu_adam_tiles.h"

#if ZERO_HAVE_X86_SIMD
#define ZV_BITS 256
#include "adam/cpu_adam_body.h"
#include "adam/cpu_adam_formats_body.h"
#endif

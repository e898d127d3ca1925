// What every CPU op's binding shares about SIMD levels (common/simd.h): the levels this CPU runs,
// which each op exports as `simd_levels()` so that zero/ops/simd.py asks the op it is about to run
// (and builds no other), and the one way a kernel's return code becomes a RuntimeError.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "common/simd.h"

// Available levels, best first, by name ("avx512", "avx2", "scalar").
inline std::vector<std::string> zero_simd_level_names() {
  std::vector<std::string> names;
  for (int level = ZERO_SIMD_LEVELS - 1; level >= ZERO_SIMD_SCALAR; level--)
    if (zero_simd_available(level)) names.emplace_back(zero_simd_name(level));
  return names;
}

// Raise unless the kernel `kernel` returned ZERO_OK for the level `simd` it was asked to run.
inline void zero_check_kernel(int rc, const char* kernel, int64_t simd) {
  TORCH_CHECK(rc != ZERO_SIMD_UNAVAILABLE, kernel, ": SIMD level ", zero_simd_name((int)simd),
              " is not available on this CPU");
  TORCH_CHECK(rc == ZERO_OK, kernel, " rejected its arguments (code ", rc, ")");
}

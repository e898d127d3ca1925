// Helpers shared by the bindings: map torch dtypes onto the kernels' zero_dtype codes and
// check the shape of the arguments. The Python layer validates user input with friendly
// messages first; these checks are the last line of defence before raw pointers are taken.
#pragma once

#include <torch/extension.h>

extern "C" {
#include "common/dtypes.h"
}

inline int32_t zero_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ZERO_F32;
    case at::kHalf: return ZERO_F16;
    case at::kBFloat16: return ZERO_BF16;
    default: return ZERO_BYTES;
  }
}

// Float formats are converted element by element; anything else is moved as opaque bytes.
inline bool zero_is_float_code(int32_t code) { return code != ZERO_BYTES; }

inline void zero_check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

// Helpers shared by the bindings: map torch dtypes onto the kernels' zero_dtype codes and fill
// the kernels' config struct.
//
// The bindings check nothing the Python layer checks (zero/ops/adam_common.py and friends,
// which name the offending argument); they turn tensors into pointers and the C return codes
// into a RuntimeError, the last line of defence.
#pragma once

#include <torch/extension.h>

#include "adam/adam_math.h"
#include "common/dtypes.h"

inline int32_t zero_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ZERO_F32;
    case at::kHalf: return ZERO_F16;
    case at::kBFloat16: return ZERO_BF16;
    default: return ZERO_BYTES;  // refused by the kernels
  }
}

// One step's hyperparameters as the kernels' config struct (adam/adam_math.h).
inline zero_adam_config zero_adam_config_of(double lr, double beta1, double beta2, double eps, double weight_decay,
                                            double grad_scale, int64_t step, bool adamw_mode, bool bias_correction) {
  zero_adam_config cfg;
  cfg.lr = lr;
  cfg.beta1 = beta1;
  cfg.beta2 = beta2;
  cfg.eps = eps;
  cfg.weight_decay = weight_decay;
  cfg.grad_scale = grad_scale;
  cfg.step = step;
  cfg.adamw_mode = adamw_mode ? 1 : 0;
  cfg.bias_correction = bias_correction ? 1 : 0;
  return cfg;
}

// Helpers shared by the bindings: map torch dtypes onto the kernels' zero_dtype codes, check the
// shape of the arguments, and marshal what the CPU and CUDA twins of an op pass alike (Adam's
// hyperparameters, a bucket's layout). The Python layer validates user input with friendly
// messages first; these checks are the last line of defence before raw pointers are taken.
#pragma once

#include <vector>

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

// ----------------------------------------------------------------------------- Adam

// One step's hyperparameters as the kernel's config struct: zero_adam_config (CPU) and
// zero_fused_adam_config (CUDA) have the same fields, filled here by name.
template <typename Config>
Config zero_adam_config_of(double lr, double beta1, double beta2, double eps, double weight_decay, double grad_scale,
                           int64_t step, bool adamw_mode, bool bias_correction) {
  Config cfg;
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

// ----------------------------------------------------------------------------- bucket pack/unpack

// Where each tensor goes in a bucket: its zero_dtype code, its size and its offset. Byte tensors
// (int, fp64, ...) travel through a byte bucket, so for them sizes and offsets count bytes.
struct ZeroBucketLayout {
  std::vector<int32_t> dtypes;
  std::vector<int64_t> numels, offsets;
  int32_t bucket_dtype;
};

// Lay `ts` out in `bucket` at element `offsets`, checking that each one casts to the bucket's
// dtype and fits. The caller has checked the bucket's device; `check_placement(ts[i], i)` checks
// tensor i's device and contiguity, before its dtype and size are checked.
template <typename CheckPlacement>
ZeroBucketLayout zero_bucket_layout(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets,
                                    const at::Tensor& bucket, CheckPlacement check_placement) {
  TORCH_CHECK(ts.size() == offsets.size(), "got ", ts.size(), " tensors but ", offsets.size(), " offsets");
  ZeroBucketLayout l;
  l.bucket_dtype = zero_dtype_of(bucket);
  const int64_t scale = zero_is_float_code(l.bucket_dtype) ? 1 : bucket.element_size();
  for (size_t i = 0; i < ts.size(); i++) {
    check_placement(ts[i], i);
    const int32_t d = zero_dtype_of(ts[i]);
    TORCH_CHECK(zero_is_float_code(d) == zero_is_float_code(l.bucket_dtype) &&
                    (zero_is_float_code(d) || ts[i].scalar_type() == bucket.scalar_type()),
                "tensor ", i, " (", ts[i].scalar_type(), ") cannot be cast to the bucket dtype ", bucket.scalar_type());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + ts[i].numel() <= bucket.numel(), "tensor ", i, " (", ts[i].numel(),
                " elements at offset ", offsets[i], ") does not fit the bucket of ", bucket.numel());
    l.dtypes.push_back(d);
    l.numels.push_back(ts[i].numel() * scale);
    l.offsets.push_back(offsets[i] * scale);
  }
  return l;
}

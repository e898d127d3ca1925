// torch entry points for the CPU Adam kernel (csrc/adam/cpu_adam.c).
// zero/ops/cpu_adam.py validates the arguments; see bindings/tensor_args.h.
#include <optional>

#include "adam/cpu_adam.h"
#include "bindings/simd_args.h"
#include "bindings/tensor_args.h"

namespace {

// param, exp_avg and exp_avg_sq: contiguous fp32 CPU tensors; grad and out16: contiguous, with
// param's number of elements. The caller guarantees all of that.
void adam_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               const std::optional<at::Tensor>& out16, double lr, double beta1, double beta2, double eps,
               double weight_decay, double grad_scale, int64_t step, bool adamw_mode, bool bias_correction,
               int64_t simd, int64_t num_threads) {
  const auto cfg = zero_adam_config_of(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode,
                                       bias_correction);
  const int rc = zero_cpu_adam_step(param.numel(), param.data_ptr<float>(), grad.data_ptr(), zero_dtype_of(grad),
                                    exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                                    out16 ? out16->data_ptr() : nullptr, out16 ? zero_dtype_of(*out16) : ZERO_F32,
                                    &cfg, (int)simd, (int)num_threads);
  zero_check_kernel(rc, "zero_cpu_adam_step", simd);
}

// The low-precision formats (adam/adam_formats.h): param fp32 or bf16 (master_dtype), exp_avg and
// exp_avg_sq fp32, bf16 or uint8 codes (state_dtype, a ZERO_* code), m_scale / v_scale fp32 with
// one element per 256-element block (8-bit states only). The caller guarantees shapes and dtypes.
void adam_step_fmt(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                   const std::optional<at::Tensor>& m_scale, const std::optional<at::Tensor>& v_scale,
                   const std::optional<at::Tensor>& out16, double lr, double beta1, double beta2, double eps,
                   double weight_decay, double grad_scale, int64_t step, bool adamw_mode, bool bias_correction,
                   int64_t master_dtype, int64_t state_dtype, bool stochastic, uint64_t seed, uint64_t index,
                   int64_t simd, int64_t num_threads) {
  const auto cfg = zero_adam_config_of(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode,
                                       bias_correction);
  const zero_adam_format fmt{(int32_t)master_dtype, (int32_t)state_dtype, stochastic ? 1 : 0, seed, index};
  const int rc = zero_cpu_adam_step_fmt(
      param.numel(), param.data_ptr(), grad.data_ptr(), zero_dtype_of(grad), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
      m_scale ? m_scale->data_ptr<float>() : nullptr, v_scale ? v_scale->data_ptr<float>() : nullptr,
      out16 ? out16->data_ptr() : nullptr, out16 ? zero_dtype_of(*out16) : ZERO_F32, &cfg, &fmt, (int)simd,
      (int)num_threads);
  zero_check_kernel(rc, "zero_cpu_adam_step_fmt", simd);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "one Adam/AdamW step in place over flat fp32 param/exp_avg/exp_avg_sq",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out16"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"),
        py::arg("step"), py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("simd"), py::arg("num_threads"));
  m.def("adam_step_fmt", &adam_step_fmt, "one Adam/AdamW step in place with low-precision master and/or moments",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("m_scale"),
        py::arg("v_scale"), py::arg("out16"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("grad_scale"), py::arg("step"), py::arg("adamw_mode"),
        py::arg("bias_correction"), py::arg("master_dtype"), py::arg("state_dtype"), py::arg("stochastic"),
        py::arg("seed"), py::arg("index"), py::arg("simd"), py::arg("num_threads"));
  m.def("simd_levels", &zero_simd_level_names, "SIMD levels this CPU runs, best first");
}

// torch entry points for the CPU Adam kernel (csrc/adam/cpu_adam.c).
// zero/ops/cpu_adam.py validates arguments with friendly messages first; the TORCH_CHECKs here
// are the last line of defence before raw pointers reach the kernel.
#include <optional>
#include <string>
#include <vector>

#include "bindings/tensor_args.h"

extern "C" {
#include "adam/cpu_adam.h"
}

namespace {

void check_fp32_buffer(const at::Tensor& t, const char* what, int64_t n) {
  zero_check_cpu_contiguous(t, what);
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == n, what, " has ", t.numel(), " elements, param has ", n);
}

void adam_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               const std::optional<at::Tensor>& out16, double lr, double beta1, double beta2, double eps,
               double weight_decay, double grad_scale, int64_t step, bool adamw_mode, bool bias_correction,
               int64_t simd, int64_t num_threads) {
  const int64_t n = param.numel();
  check_fp32_buffer(param, "param", n);
  check_fp32_buffer(exp_avg, "exp_avg", n);
  check_fp32_buffer(exp_avg_sq, "exp_avg_sq", n);
  zero_check_cpu_contiguous(grad, "grad");
  const int32_t grad_dtype = zero_dtype_of(grad);
  TORCH_CHECK(grad_dtype != ZERO_BYTES, "grad must be float32, bfloat16 or float16, got ", grad.scalar_type());
  TORCH_CHECK(grad.numel() == n, "grad has ", grad.numel(), " elements, param has ", n);
  void* out_ptr = nullptr;
  int32_t out_dtype = ZERO_F32;
  if (out16.has_value()) {
    zero_check_cpu_contiguous(*out16, "out16");
    out_dtype = zero_dtype_of(*out16);
    TORCH_CHECK(out_dtype == ZERO_BF16 || out_dtype == ZERO_F16, "out16 must be bfloat16 or float16, got ",
                out16->scalar_type());
    TORCH_CHECK(out16->numel() == n, "out16 has ", out16->numel(), " elements, param has ", n);
    out_ptr = out16->data_ptr();
  }
  const auto cfg = zero_adam_config_of<zero_adam_config>(lr, beta1, beta2, eps, weight_decay, grad_scale, step,
                                                         adamw_mode, bias_correction);
  const int rc = zero_cpu_adam_step(n, param.data_ptr<float>(), grad.data_ptr(), grad_dtype, exp_avg.data_ptr<float>(),
                                    exp_avg_sq.data_ptr<float>(), out_ptr, out_dtype, &cfg, (int)simd, (int)num_threads);
  TORCH_CHECK(rc != ZERO_ADAM_SIMD_UNAVAILABLE, "SIMD level ", zero_cpu_adam_simd_name((int)simd),
              " is not available on this CPU");
  TORCH_CHECK(rc == ZERO_ADAM_OK, "zero_cpu_adam_step failed with code ", rc);
}

void stream_pass(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, int64_t simd,
                 int64_t num_threads) {
  const int64_t n = param.numel();
  check_fp32_buffer(param, "param", n);
  check_fp32_buffer(grad, "grad", n);
  check_fp32_buffer(exp_avg, "exp_avg", n);
  check_fp32_buffer(exp_avg_sq, "exp_avg_sq", n);
  const int rc = zero_cpu_stream_pass(n, param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                      exp_avg_sq.data_ptr<float>(), (int)simd, (int)num_threads);
  TORCH_CHECK(rc == ZERO_ADAM_OK, "zero_cpu_stream_pass failed with code ", rc);
}

// Available levels, best first, by name ("avx512", "avx2", "scalar").
std::vector<std::string> simd_levels() {
  std::vector<std::string> names;
  for (int level = ZERO_SIMD_LEVELS - 1; level >= ZERO_SIMD_SCALAR; level--)
    if (zero_cpu_adam_simd_available(level)) names.emplace_back(zero_cpu_adam_simd_name(level));
  return names;
}

// Every level this build knows, by name -> code, whether or not this CPU runs it.
std::vector<std::pair<std::string, int64_t>> simd_codes() {
  std::vector<std::pair<std::string, int64_t>> codes;
  for (int level = ZERO_SIMD_SCALAR; level < ZERO_SIMD_LEVELS; level++)
    codes.emplace_back(zero_cpu_adam_simd_name(level), level);
  return codes;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "one Adam/AdamW step in place over flat fp32 param/exp_avg/exp_avg_sq",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out16"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"),
        py::arg("step"), py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("simd"), py::arg("num_threads"));
  m.def("stream_pass", &stream_pass, "bandwidth probe with Adam's memory traffic (28 bytes per element)");
  m.def("simd_levels", &simd_levels, "SIMD levels this CPU runs, best first");
  m.def("best_simd", []() { return std::string(zero_cpu_adam_simd_name(zero_cpu_adam_best_simd())); },
        "the best SIMD level on this CPU");
  m.def("simd_codes", &simd_codes, "name -> code of every SIMD level this build knows");
  m.attr("SIMD_BEST") = (int64_t)ZERO_SIMD_BEST;
}

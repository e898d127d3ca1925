// torch entry points for the CPU Lion and Adagrad kernels (csrc/optim/cpu_optim.c).
// zero/ops/cpu_optim.py validates the arguments; see bindings/tensor_args.h.
#include <optional>

#include "bindings/simd_args.h"
#include "bindings/tensor_args.h"
#include "optim/cpu_optim.h"

namespace {

// param and the state: contiguous fp32 CPU tensors; grad and out16: contiguous, with param's
// number of elements. The caller guarantees all of that.
void lion_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, const std::optional<at::Tensor>& out16,
               double lr, double beta1, double beta2, double weight_decay, double grad_scale, int64_t num_threads) {
  const int rc = zero_cpu_lion_step(param.numel(), param.data_ptr<float>(), grad.data_ptr(), zero_dtype_of(grad),
                                    exp_avg.data_ptr<float>(), out16 ? out16->data_ptr() : nullptr,
                                    out16 ? zero_dtype_of(*out16) : ZERO_F32, (float)lr, (float)beta1, (float)beta2,
                                    (float)weight_decay, (float)grad_scale, (int)num_threads);
  zero_check_kernel(rc, "zero_cpu_lion_step", ZERO_SIMD_SCALAR);
}

void adagrad_step(at::Tensor param, const at::Tensor& grad, at::Tensor state_sum, const std::optional<at::Tensor>& out16,
                  double clr, double eps, double weight_decay, double grad_scale, int64_t num_threads) {
  const int rc = zero_cpu_adagrad_step(param.numel(), param.data_ptr<float>(), grad.data_ptr(), zero_dtype_of(grad),
                                       state_sum.data_ptr<float>(), out16 ? out16->data_ptr() : nullptr,
                                       out16 ? zero_dtype_of(*out16) : ZERO_F32, (float)clr, (float)eps,
                                       (float)weight_decay, (float)grad_scale, (int)num_threads);
  zero_check_kernel(rc, "zero_cpu_adagrad_step", ZERO_SIMD_SCALAR);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lion_step", &lion_step, "one Lion step in place over flat fp32 param and exp_avg", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("out16"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("weight_decay"), py::arg("grad_scale"), py::arg("num_threads"));
  m.def("adagrad_step", &adagrad_step, "one Adagrad step in place over flat fp32 param and state_sum",
        py::arg("param"), py::arg("grad"), py::arg("state_sum"), py::arg("out16"), py::arg("clr"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("grad_scale"), py::arg("num_threads"));
  m.def("simd_levels", &zero_simd_level_names, "SIMD levels this CPU runs, best first");
}

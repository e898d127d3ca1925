// torch entry points for the fused GPU Adam (csrc/adam/fused_adam.cu): the multi-tensor step
// over fp32 state, and the one-buffer step over the low-precision state formats.
// zero/ops/fused_adam.py validates the arguments and groups the tensors; see
// bindings/tensor_args.h.
#include <optional>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam/fused_adam.h"
#include "bindings/tensor_args.h"

namespace {

// One launch (or a few, for very long lists) over every tensor, on the current stream of
// params[0]'s device. The caller guarantees: lists of equal length (out16 may be empty, for no
// copy-out); every tensor contiguous, on that device, with its param's number of elements;
// params and moments fp32; one grad dtype and one out16 dtype per call.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& out16, double lr, double beta1, double beta2, double eps,
               double weight_decay, double grad_scale, int64_t step, bool adamw_mode, bool bias_correction) {
  const size_t n = params.size();
  if (n == 0) return;
  std::vector<float*> p(n), m(n), v(n);
  std::vector<const void*> g(n);
  std::vector<void*> o(out16.size());
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; i++) {
    p[i] = params[i].data_ptr<float>();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
    numels[i] = params[i].numel();
    if (!out16.empty()) o[i] = out16[i].data_ptr();
  }
  const auto cfg = zero_adam_config_of(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode,
                                       bias_correction);
  const at::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  const int rc = zero_fused_adam((int)n, p.data(), g.data(), zero_dtype_of(grads[0]), m.data(), v.data(),
                                 out16.empty() ? nullptr : o.data(), out16.empty() ? ZERO_F32 : zero_dtype_of(out16[0]),
                                 numels.data(), &cfg, stream);
  TORCH_CHECK(rc != -1, "zero_fused_adam rejected its arguments (lr=", lr, ", betas=(", beta1, ", ", beta2,
              "), eps=", eps, ", weight_decay=", weight_decay, ", grad_scale=", grad_scale, ", step=", step, ")");
  TORCH_CHECK(rc == 0, "zero_fused_adam: kernel launch failed: ", cudaGetErrorString((cudaError_t)rc));
}

// One step over one flat buffer in the state formats of adam/adam_formats.h, on the current stream
// of param's device; the GPU twin of the CPU op's adam_step_fmt, with the same arguments less
// simd/num_threads. The caller guarantees: every tensor contiguous, on param's device, with
// param's number of elements; param fp32 or bf16 (master_dtype: ZERO_F32 = 0, ZERO_BF16 = 2),
// exp_avg / exp_avg_sq fp32, bf16 or uint8 (state_dtype: 0, 2 or ZERO_Q8 = 8); m_scale / v_scale
// fp32 with ceil(numel / 256) elements, given exactly when state_dtype is 8.
void adam_step_fmt(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                   const std::optional<at::Tensor>& m_scale, const std::optional<at::Tensor>& v_scale,
                   const std::optional<at::Tensor>& out16, double lr, double beta1, double beta2, double eps,
                   double weight_decay, double grad_scale, int64_t step, bool adamw_mode, bool bias_correction,
                   int64_t master_dtype, int64_t state_dtype, bool stochastic, uint64_t seed, uint64_t index) {
  const auto cfg = zero_adam_config_of(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode,
                                       bias_correction);
  const zero_adam_format fmt{(int32_t)master_dtype, (int32_t)state_dtype, stochastic ? 1 : 0, seed, index};
  const at::Device device = param.device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  const int rc = zero_fused_adam_step_fmt(
      param.numel(), param.data_ptr(), grad.data_ptr(), zero_dtype_of(grad), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
      m_scale ? m_scale->data_ptr<float>() : nullptr, v_scale ? v_scale->data_ptr<float>() : nullptr,
      out16 ? out16->data_ptr() : nullptr, out16 ? zero_dtype_of(*out16) : ZERO_F32, &cfg, &fmt, stream);
  TORCH_CHECK(rc != -1, "zero_fused_adam_step_fmt rejected its arguments (lr=", lr, ", betas=(", beta1, ", ", beta2,
              "), eps=", eps, ", weight_decay=", weight_decay, ", grad_scale=", grad_scale, ", step=", step,
              ", master_dtype=", master_dtype, ", state_dtype=", state_dtype, ", grad dtype ", grad.scalar_type(),
              ", scales given: ", m_scale.has_value() && v_scale.has_value(), ")");
  TORCH_CHECK(rc == 0, "zero_fused_adam_step_fmt: kernel launch failed: ", cudaGetErrorString((cudaError_t)rc));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step,
        "one Adam/AdamW step in place over lists of CUDA fp32 params/exp_avgs/exp_avg_sqs, in one fused launch",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("out16"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale"), py::arg("step"), py::arg("adamw_mode"), py::arg("bias_correction"));
  m.def("adam_step_fmt", &adam_step_fmt,
        "one Adam/AdamW step in place over one flat CUDA buffer whose master and moments are stored in the "
        "formats of adam/adam_formats.h (fp32/bf16 master; fp32, bf16 or 8-bit moments)",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("m_scale"),
        py::arg("v_scale"), py::arg("out16"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("grad_scale"), py::arg("step"), py::arg("adamw_mode"),
        py::arg("bias_correction"), py::arg("master_dtype"), py::arg("state_dtype"), py::arg("stochastic"),
        py::arg("seed"), py::arg("index"));
}

// torch entry point for the fused multi-tensor GPU Adam (csrc/adam/fused_adam.cu).
// zero/ops/fused_adam.py validates the arguments and groups the tensors; see
// bindings/tensor_args.h.
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step,
        "one Adam/AdamW step in place over lists of CUDA fp32 params/exp_avgs/exp_avg_sqs, in one fused launch",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("out16"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale"), py::arg("step"), py::arg("adamw_mode"), py::arg("bias_correction"));
}

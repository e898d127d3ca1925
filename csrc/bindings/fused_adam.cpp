// torch entry point for the fused multi-tensor GPU Adam (csrc/adam/fused_adam.cu).
// zero/ops/fused_adam.py validates arguments with friendly messages and groups tensors by
// device and dtype first; the TORCH_CHECKs here are the last line of defence before raw
// pointers reach the kernel.
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam/fused_adam.h"
#include "bindings/tensor_args.h"

namespace {

void check_cuda_buffer(const at::Tensor& t, const at::Tensor& param, const char* what, size_t i) {
  TORCH_CHECK(t.device() == param.device(), what, "[", i, "] is on ", t.device(), ", params[", i, "] on ",
              param.device());
  TORCH_CHECK(t.is_contiguous(), what, "[", i, "] must be contiguous");
  TORCH_CHECK(t.numel() == param.numel(), what, "[", i, "] has ", t.numel(), " elements, params[", i, "] has ",
              param.numel());
}

// One launch (or a few, for very long lists) over every tensor. All grads share one dtype and
// all out16 buffers one dtype; an empty out16 list means no 16-bit copy.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& out16, double lr, double beta1, double beta2, double eps,
               double weight_decay, double grad_scale, int64_t step, bool adamw_mode, bool bias_correction) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "params, grads, exp_avgs and exp_avg_sqs must have the same length");
  TORCH_CHECK(out16.empty() || out16.size() == n, "out16 must be empty or have one tensor per param");
  if (n == 0) return;

  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "params[0] must be a CUDA tensor, got ", device);
  const int32_t grad_dtype = zero_dtype_of(grads[0]);
  TORCH_CHECK(grad_dtype != ZERO_BYTES, "grads must be float32, bfloat16 or float16, got ", grads[0].scalar_type());
  const int32_t out_dtype = out16.empty() ? ZERO_F32 : zero_dtype_of(out16[0]);
  TORCH_CHECK(out16.empty() || out_dtype == ZERO_F16 || out_dtype == ZERO_BF16,
              "out16 must be bfloat16 or float16, got ", out16[0].scalar_type());

  std::vector<float*> p(n), m(n), v(n);
  std::vector<const void*> g(n);
  std::vector<void*> o(out16.empty() ? 0 : n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; i++) {
    TORCH_CHECK(params[i].device() == device, "params[", i, "] is on ", params[i].device(), ", params[0] on ", device);
    TORCH_CHECK(params[i].scalar_type() == at::kFloat, "params[", i, "] must be float32, got ", params[i].scalar_type());
    TORCH_CHECK(params[i].is_contiguous(), "params[", i, "] must be contiguous");
    check_cuda_buffer(grads[i], params[i], "grads", i);
    TORCH_CHECK(zero_dtype_of(grads[i]) == grad_dtype, "grads[", i, "] is ", grads[i].scalar_type(), ", grads[0] is ",
                grads[0].scalar_type(), " (one grad dtype per call)");
    check_cuda_buffer(exp_avgs[i], params[i], "exp_avgs", i);
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat, "exp_avgs[", i, "] must be float32");
    check_cuda_buffer(exp_avg_sqs[i], params[i], "exp_avg_sqs", i);
    TORCH_CHECK(exp_avg_sqs[i].scalar_type() == at::kFloat, "exp_avg_sqs[", i, "] must be float32");
    p[i] = params[i].data_ptr<float>();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
    numels[i] = params[i].numel();
    if (!out16.empty()) {
      check_cuda_buffer(out16[i], params[i], "out16", i);
      TORCH_CHECK(zero_dtype_of(out16[i]) == out_dtype, "out16[", i, "] is ", out16[i].scalar_type(),
                  ", out16[0] is ", out16[0].scalar_type(), " (one out16 dtype per call)");
      o[i] = out16[i].data_ptr();
    }
  }

  const auto cfg = zero_adam_config_of<zero_fused_adam_config>(lr, beta1, beta2, eps, weight_decay, grad_scale,
                                                               step, adamw_mode, bias_correction);

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  const int rc = zero_fused_adam((int)n, p.data(), g.data(), grad_dtype, m.data(), v.data(),
                                 out16.empty() ? nullptr : o.data(), out_dtype, numels.data(), &cfg, stream);
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

// torch entry points for qwZ's GPU weight-block kernels (csrc/quant/quant.cu), on the tensors'
// device and its current stream. zero/ops/quant.py validates the arguments.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings/tensor_args.h"
#include "quant/quant_cuda.h"

namespace {

void quantize(const at::Tensor& x, int64_t dtype, at::Tensor msg) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const int rc = zero_qw_quantize_cuda(x.numel(), x.data_ptr(), (int)dtype, msg.data_ptr<uint8_t>(), stream);
  TORCH_CHECK(rc == 0, "zero_qw_quantize_cuda failed (code ", rc, ")");
}

void dequantize(const at::Tensor& msgs, int64_t n, at::Tensor out, int64_t dtype) {
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(out.device().index()).stream();
  const int rc = zero_qw_dequantize_cuda(msgs.size(0), n, msgs.data_ptr<uint8_t>(), out.data_ptr(), (int)dtype, stream);
  TORCH_CHECK(rc == 0, "zero_qw_dequantize_cuda failed (code ", rc, ")");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize", &quantize, "qwZ int8 weight blocks (CUDA)", py::arg("x"), py::arg("dtype"), py::arg("msg"));
  m.def("dequantize", &dequantize, "qwZ int8 weight blocks back (CUDA)", py::arg("msgs"), py::arg("n"),
        py::arg("out"), py::arg("dtype"));
}

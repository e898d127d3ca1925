// torch entry points for the GPU 1-bit pack/unpack kernels (csrc/onebit/onebit.cu), on the
// tensors' device and its current stream. zero/ops/onebit.py validates the arguments.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings/tensor_args.h"
#include "onebit/onebit_cuda.h"

namespace {

void pack(const at::Tensor& x, at::Tensor err, at::Tensor bits, at::Tensor scales, int64_t block) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const int rc = zero_onebit_pack_cuda(x.numel(), x.data_ptr<float>(), err.data_ptr<float>(), block,
                                       bits.data_ptr<uint8_t>(), scales.data_ptr<float>(), stream);
  TORCH_CHECK(rc == 0, "zero_onebit_pack_cuda failed (code ", rc, ")");
}

void unpack_mean(const at::Tensor& bits, const at::Tensor& scales, at::Tensor out, int64_t block) {
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(out.device().index()).stream();
  const int rc = zero_onebit_unpack_mean_cuda(bits.size(0), out.numel(), bits.data_ptr<uint8_t>(),
                                              scales.data_ptr<float>(), block, out.data_ptr<float>(), stream);
  TORCH_CHECK(rc == 0, "zero_onebit_unpack_mean_cuda failed (code ", rc, ")");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "1-bit pack with error feedback (CUDA)", py::arg("x"), py::arg("err"), py::arg("bits"),
        py::arg("scales"), py::arg("block"));
  m.def("unpack_mean", &unpack_mean, "mean of k 1-bit messages (CUDA)", py::arg("bits"), py::arg("scales"),
        py::arg("out"), py::arg("block"));
}

// torch entry points for the 1-bit pack/unpack kernels (csrc/onebit/onebit.c).
// zero/ops/onebit.py validates the arguments.
#include "bindings/simd_args.h"
#include "onebit/onebit.h"

namespace {

// x, err: contiguous fp32 CPU tensors of n elements; bits: ceil(n/8) uint8; scales: ceil(n/block) fp32.
void pack(const at::Tensor& x, at::Tensor err, at::Tensor bits, at::Tensor scales, int64_t block, int64_t simd,
          int64_t num_threads) {
  const int rc = zero_onebit_pack(x.numel(), x.data_ptr<float>(), err.data_ptr<float>(), block,
                                  bits.data_ptr<uint8_t>(), scales.data_ptr<float>(), (int)simd, (int)num_threads);
  zero_check_kernel(rc, "zero_onebit_pack", simd);
}

// bits: (k, ceil(n/8)) uint8; scales: (k, ceil(n/block)) fp32; out: n fp32; all contiguous CPU tensors.
void unpack_mean(const at::Tensor& bits, const at::Tensor& scales, at::Tensor out, int64_t block, int64_t simd,
                 int64_t num_threads) {
  const int rc = zero_onebit_unpack_mean(bits.size(0), out.numel(), bits.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                         block, out.data_ptr<float>(), (int)simd, (int)num_threads);
  zero_check_kernel(rc, "zero_onebit_unpack_mean", simd);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "1-bit pack with error feedback", py::arg("x"), py::arg("err"), py::arg("bits"),
        py::arg("scales"), py::arg("block"), py::arg("simd"), py::arg("num_threads"));
  m.def("unpack_mean", &unpack_mean, "mean of k 1-bit messages", py::arg("bits"), py::arg("scales"), py::arg("out"),
        py::arg("block"), py::arg("simd"), py::arg("num_threads"));
  m.def("simd_levels", &zero_simd_level_names, "SIMD levels this CPU runs, best first");
}

// torch entry points for the CUDA bucket pack/unpack kernels (csrc/comm/pack.cu). The Python
// signatures are exactly those of the CPU op (bindings/pack.cpp), so zero/ops/pack.py calls
// either one; num_threads is accepted and ignored here.
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings/tensor_args.h"
#include "comm/pack_cuda.h"

namespace {

struct Layout {
  std::vector<int32_t> dtypes;
  std::vector<int64_t> numels, offsets;
  int32_t bucket_dtype;
};

// Byte tensors (int, fp64, ...) travel through a byte bucket with sizes counted in bytes.
Layout layout(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets, const at::Tensor& bucket) {
  TORCH_CHECK(ts.size() == offsets.size(), "got ", ts.size(), " tensors but ", offsets.size(), " offsets");
  TORCH_CHECK(bucket.device().is_cuda(), "bucket must be a CUDA tensor, got ", bucket.device());
  TORCH_CHECK(bucket.is_contiguous(), "bucket must be contiguous");
  Layout l;
  l.bucket_dtype = zero_dtype_of(bucket);
  const int64_t scale = zero_is_float_code(l.bucket_dtype) ? 1 : bucket.element_size();
  for (size_t i = 0; i < ts.size(); i++) {
    TORCH_CHECK(ts[i].device() == bucket.device(), "tensor ", i, " is on ", ts[i].device(), " but the bucket is on ",
                bucket.device());
    TORCH_CHECK(ts[i].is_contiguous(), "tensor ", i, " must be contiguous");
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

void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc != -1, what, " rejected its arguments (unsupported dtype pair or negative size)");
  TORCH_CHECK(rc == 0, what, ": kernel launch failed: ", cudaGetErrorString((cudaError_t)rc));
}

void pack(const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets, at::Tensor bucket,
          int64_t num_threads) {
  (void)num_threads;
  Layout l = layout(srcs, offsets, bucket);
  std::vector<const void*> ptrs;
  for (auto& t : srcs) ptrs.push_back(t.data_ptr());
  const c10::cuda::CUDAGuard guard(bucket.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(bucket.device().index()).stream();
  check_rc(zero_pack_cuda((int)srcs.size(), ptrs.data(), l.dtypes.data(), l.numels.data(), l.offsets.data(),
                          bucket.data_ptr(), l.bucket_dtype, stream),
           "zero_pack_cuda");
}

void unpack(const at::Tensor& bucket, const std::vector<int64_t>& offsets, std::vector<at::Tensor> dsts,
            int64_t num_threads) {
  (void)num_threads;
  Layout l = layout(dsts, offsets, bucket);
  std::vector<void*> ptrs;
  for (auto& t : dsts) ptrs.push_back(t.data_ptr());
  const c10::cuda::CUDAGuard guard(bucket.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(bucket.device().index()).stream();
  check_rc(zero_unpack_cuda((int)dsts.size(), ptrs.data(), l.dtypes.data(), l.numels.data(), l.offsets.data(),
                            bucket.data_ptr(), l.bucket_dtype, stream),
           "zero_unpack_cuda");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "copy CUDA tensors into a CUDA bucket at the given element offsets, casting to its dtype");
  m.def("unpack", &unpack, "copy slices of a CUDA bucket back into CUDA tensors, casting to each tensor's dtype");
}

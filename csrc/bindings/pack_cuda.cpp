// torch entry points for the CUDA bucket pack/unpack kernels (csrc/comm/pack.cu). The Python
// signatures are exactly those of the CPU op (bindings/pack.cpp), so zero/ops/pack.py calls
// either one; num_threads is accepted and ignored here.
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings/tensor_args.h"
#include "comm/pack_cuda.h"

namespace {

// The bucket and every tensor live on one CUDA device, contiguous.
ZeroBucketLayout layout(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets,
                        const at::Tensor& bucket) {
  TORCH_CHECK(bucket.device().is_cuda(), "bucket must be a CUDA tensor, got ", bucket.device());
  TORCH_CHECK(bucket.is_contiguous(), "bucket must be contiguous");
  return zero_bucket_layout(ts, offsets, bucket, [&](const at::Tensor& t, size_t i) {
    TORCH_CHECK(t.device() == bucket.device(), "tensor ", i, " is on ", t.device(), " but the bucket is on ",
                bucket.device());
    TORCH_CHECK(t.is_contiguous(), "tensor ", i, " must be contiguous");
  });
}

void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc != -1, what, " rejected its arguments (unsupported dtype pair or negative size)");
  TORCH_CHECK(rc == 0, what, ": kernel launch failed: ", cudaGetErrorString((cudaError_t)rc));
}

void pack(const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets, at::Tensor bucket,
          int64_t num_threads) {
  (void)num_threads;
  const ZeroBucketLayout l = layout(srcs, offsets, bucket);
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
  const ZeroBucketLayout l = layout(dsts, offsets, bucket);
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

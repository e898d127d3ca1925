// torch entry points for the CPU bucket pack/unpack kernels (csrc/comm/pack.c).
#include <vector>

#include "bindings/tensor_args.h"

extern "C" {
#include "comm/pack.h"
}

namespace {

// The bucket and every tensor live in CPU memory, contiguous.
ZeroBucketLayout layout(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets,
                        const at::Tensor& bucket) {
  zero_check_cpu_contiguous(bucket, "bucket");
  return zero_bucket_layout(ts, offsets, bucket,
                            [](const at::Tensor& t, size_t) { zero_check_cpu_contiguous(t, "every tensor"); });
}

void pack(const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets, at::Tensor bucket, int64_t num_threads) {
  const ZeroBucketLayout l = layout(srcs, offsets, bucket);
  std::vector<const void*> ptrs;
  for (auto& t : srcs) ptrs.push_back(t.data_ptr());
  int rc = zero_pack((int)srcs.size(), ptrs.data(), l.dtypes.data(), l.numels.data(), l.offsets.data(),
                     bucket.data_ptr(), l.bucket_dtype, (int)num_threads);
  TORCH_CHECK(rc == 0, "zero_pack failed with code ", rc);
}

void unpack(const at::Tensor& bucket, const std::vector<int64_t>& offsets, std::vector<at::Tensor> dsts, int64_t num_threads) {
  const ZeroBucketLayout l = layout(dsts, offsets, bucket);
  std::vector<void*> ptrs;
  for (auto& t : dsts) ptrs.push_back(t.data_ptr());
  int rc = zero_unpack((int)dsts.size(), ptrs.data(), l.dtypes.data(), l.numels.data(), l.offsets.data(),
                       bucket.data_ptr(), l.bucket_dtype, (int)num_threads);
  TORCH_CHECK(rc == 0, "zero_unpack failed with code ", rc);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "copy tensors into a bucket at the given element offsets, casting to its dtype");
  m.def("unpack", &unpack, "copy slices of a bucket back into tensors, casting to each tensor's dtype");
}

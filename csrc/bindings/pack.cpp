// torch entry points for the CPU bucket pack/unpack kernels (csrc/comm/pack.c).
#include <vector>

#include "bindings/tensor_args.h"

extern "C" {
#include "comm/pack.h"
}

namespace {

struct Layout {
  std::vector<int32_t> dtypes;
  std::vector<int64_t> numels, offsets;
  int32_t bucket_dtype;
};

// Byte tensors (int, fp64, ...) travel through a byte bucket with sizes counted in bytes.
Layout layout(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets, const at::Tensor& bucket) {
  TORCH_CHECK(ts.size() == offsets.size(), "got ", ts.size(), " tensors but ", offsets.size(), " offsets");
  zero_check_cpu_contiguous(bucket, "bucket");
  Layout l;
  l.bucket_dtype = zero_dtype_of(bucket);
  const int64_t scale = zero_is_float_code(l.bucket_dtype) ? 1 : bucket.element_size();
  for (size_t i = 0; i < ts.size(); i++) {
    zero_check_cpu_contiguous(ts[i], "every tensor");
    int32_t d = zero_dtype_of(ts[i]);
    TORCH_CHECK(zero_is_float_code(d) == zero_is_float_code(l.bucket_dtype) &&
                    (zero_is_float_code(d) || ts[i].scalar_type() == bucket.scalar_type()),
                "tensor ", i, " (", ts[i].scalar_type(), ") cannot be cast to the bucket dtype ", bucket.scalar_type());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + ts[i].numel() <= bucket.numel(), "tensor ", i, " (",
                ts[i].numel(), " elements at offset ", offsets[i], ") does not fit the bucket of ", bucket.numel());
    l.dtypes.push_back(d);
    l.numels.push_back(ts[i].numel() * scale);
    l.offsets.push_back(offsets[i] * scale);
  }
  return l;
}

void pack(const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets, at::Tensor bucket, int64_t num_threads) {
  Layout l = layout(srcs, offsets, bucket);
  std::vector<const void*> ptrs;
  for (auto& t : srcs) ptrs.push_back(t.data_ptr());
  int rc = zero_pack((int)srcs.size(), ptrs.data(), l.dtypes.data(), l.numels.data(), l.offsets.data(),
                     bucket.data_ptr(), l.bucket_dtype, (int)num_threads);
  TORCH_CHECK(rc == 0, "zero_pack failed with code ", rc);
}

void unpack(const at::Tensor& bucket, const std::vector<int64_t>& offsets, std::vector<at::Tensor> dsts, int64_t num_threads) {
  Layout l = layout(dsts, offsets, bucket);
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

// torch entry points for the GPU block-sparse attention kernels (csrc/sparse_attention/*.cu), on
// the tensors' device and its current stream. zero/ops/sparse_attention.py validates the
// arguments (shapes, dtypes, one device for everything, the index on that device).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "bindings/sparse_attention_args.h"
#include "sparse_attention/sparse_attention_cuda.h"

namespace {

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& row_ptr, const at::Tensor& col_idx, int64_t block, bool causal,
                                double scale, const std::optional<at::Tensor>& key_bias,
                                const std::optional<at::Tensor>& attn_bias) {
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(q.device().index()).stream();
  zero_sparse_attention_problem p =
      zero_sparse_problem_of(q, block, causal, scale, row_ptr.size(0), key_bias, attn_bias);
  p.row_ptr = row_ptr.data_ptr<int32_t>();
  p.col_idx = col_idx.data_ptr<int32_t>();
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({p.batch, p.heads, p.seq}, q.options().dtype(at::kFloat));
  const int rc = zero_sparse_attention_forward_cuda(&p, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                    lse.data_ptr<float>(), stream);
  TORCH_CHECK(rc == 0, "zero_sparse_attention_forward_cuda failed (code ", rc, ")");
  return {out, lse};
}

std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                                 const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& col_ptr,
                                 const at::Tensor& row_idx, int64_t block, bool causal, double scale,
                                 const std::optional<at::Tensor>& key_bias,
                                 const std::optional<at::Tensor>& attn_bias) {
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(q.device().index()).stream();
  zero_sparse_attention_problem p =
      zero_sparse_problem_of(q, block, causal, scale, row_ptr.size(0), key_bias, attn_bias);
  p.row_ptr = row_ptr.data_ptr<int32_t>();
  p.col_idx = col_idx.data_ptr<int32_t>();
  p.col_ptr = col_ptr.data_ptr<int32_t>();
  p.row_idx = row_idx.data_ptr<int32_t>();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor delta = at::empty({p.batch, p.heads, p.seq}, q.options().dtype(at::kFloat));
  const int rc = zero_sparse_attention_backward_cuda(&p, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                     dout.data_ptr(), lse.data_ptr<float>(), dq.data_ptr(),
                                                     dk.data_ptr(), dv.data_ptr(), delta.data_ptr<float>(), stream);
  TORCH_CHECK(rc == 0, "zero_sparse_attention_backward_cuda failed (code ", rc, ")");
  return {dq, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "block-sparse attention forward (CUDA)", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("row_ptr"), py::arg("col_idx"), py::arg("block"), py::arg("causal"), py::arg("scale"),
        py::arg("key_bias"), py::arg("attn_bias"));
  m.def("backward", &backward, "block-sparse attention backward (CUDA)", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("dout"), py::arg("lse"), py::arg("row_ptr"), py::arg("col_idx"), py::arg("col_ptr"),
        py::arg("row_idx"), py::arg("block"), py::arg("causal"), py::arg("scale"), py::arg("key_bias"),
        py::arg("attn_bias"));
}

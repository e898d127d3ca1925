// torch entry points for the CPU block-sparse attention kernels (csrc/sparse_attention/).
// zero/ops/sparse_attention.py validates the arguments; outputs and the kernels' work space are
// allocated here with torch's allocator, so memory measurements see them.
#include <vector>

#include "bindings/simd_args.h"
#include "bindings/sparse_attention_args.h"

namespace {

at::Tensor workspace(int64_t floats) {
  TORCH_CHECK(floats >= 0, "sparse attention: the kernel refused the problem's sizes");
  return at::empty({floats}, at::TensorOptions().dtype(at::kFloat));
}

// Returns (out, lse): out like q, lse (batch, heads, seq) fp32.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& row_ptr, const at::Tensor& col_idx, int64_t block, bool causal,
                                double scale, const std::optional<at::Tensor>& key_bias,
                                const std::optional<at::Tensor>& attn_bias, int64_t simd, int64_t num_threads) {
  zero_sparse_attention_problem p =
      zero_sparse_problem_of(q, block, causal, scale, row_ptr.size(0), key_bias, attn_bias);
  p.row_ptr = row_ptr.data_ptr<int32_t>();
  p.col_idx = col_idx.data_ptr<int32_t>();
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({p.batch, p.heads, p.seq}, q.options().dtype(at::kFloat));
  at::Tensor ws = workspace(zero_sparse_attention_forward_workspace(&p, (int)num_threads));
  const int rc = zero_sparse_attention_forward(&p, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                               lse.data_ptr<float>(), ws.data_ptr<float>(), (int)simd,
                                               (int)num_threads);
  zero_check_kernel(rc, "zero_sparse_attention_forward", simd);
  return {out, lse};
}

// Returns (dq, dk, dv), each like q.
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                                 const at::Tensor& col_ptr, const at::Tensor& row_idx, int64_t block, bool causal,
                                 double scale, const std::optional<at::Tensor>& key_bias,
                                 const std::optional<at::Tensor>& attn_bias, int64_t simd, int64_t num_threads) {
  zero_sparse_attention_problem p =
      zero_sparse_problem_of(q, block, causal, scale, col_ptr.size(0), key_bias, attn_bias);
  p.col_ptr = col_ptr.data_ptr<int32_t>();
  p.row_idx = row_idx.data_ptr<int32_t>();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor ws = workspace(zero_sparse_attention_backward_workspace(&p, (int)num_threads));
  const int rc = zero_sparse_attention_backward(&p, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                dout.data_ptr(), lse.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(),
                                                dv.data_ptr(), ws.data_ptr<float>(), (int)simd, (int)num_threads);
  zero_check_kernel(rc, "zero_sparse_attention_backward", simd);
  return {dq, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "block-sparse attention forward", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("row_ptr"), py::arg("col_idx"), py::arg("block"), py::arg("causal"), py::arg("scale"),
        py::arg("key_bias"), py::arg("attn_bias"), py::arg("simd"), py::arg("num_threads"));
  m.def("backward", &backward, "block-sparse attention backward", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("dout"), py::arg("lse"), py::arg("col_ptr"), py::arg("row_idx"), py::arg("block"),
        py::arg("causal"), py::arg("scale"), py::arg("key_bias"), py::arg("attn_bias"), py::arg("simd"),
        py::arg("num_threads"));
  m.def("simd_levels", &zero_simd_level_names, "SIMD levels this CPU runs, best first");
}

"""The CPU ops' entry points: the C kernels' own functions, called through ctypes.

[Note: CPU ops without C++]
A CPU op is a plain C shared library (`libzero_<op>.so`, built by zero.ops.builder) whose entry
points take sizes, scalars and pointers. This module is its binding: one class per op, with the
methods the rest of zero calls (`adam_step`, `pack`, `forward`, ...), which turn tensors into
pointers and a kernel's return code into a RuntimeError. There is no C++ binding to compile:
including torch's C++ headers was most of a cold build's time, and a library that does not link
torch works with every torch version, so its cache survives a torch upgrade. ctypes releases the
GIL for the length of each call, so an offloaded step overlaps with Python work on other threads.

The Python callers (zero/ops/cpu_adam.py, adam.py, cpu_optim.py, onebit.py, sparse_attention.py)
check every argument first, naming the bad one; here nothing is checked but what a C function
says back. The structs the kernels take (the Adam config and format, the sparse-attention problem)
are declared below field by field in the C order (ctypes lays them out as the C compiler does);
tests/test_ops_builder.py compares their sizes and field offsets with the library's.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_size_t, c_uint64, c_void_p
from pathlib import Path
from typing import Optional

import torch

# common/dtypes.h and common/simd.h
F32, F16, BF16, BYTES = 0, 1, 2, 3
DTYPE_CODES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
OK, BAD_ARGUMENT, SIMD_UNAVAILABLE = 0, -1, -2
SIMD_LEVELS = 3  # scalar, avx2, avx512


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES.get(t.dtype, BYTES)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class AdamConfig(ctypes.Structure):  # zero_adam_config, adam/adam_math.h
    _fields_ = [("lr", c_double), ("beta1", c_double), ("beta2", c_double), ("eps", c_double),
                ("weight_decay", c_double), ("grad_scale", c_double), ("step", c_int64), ("adamw_mode", c_int),
                ("bias_correction", c_int)]


class AdamFormat(ctypes.Structure):  # zero_adam_format, adam/adam_formats.h
    _fields_ = [("master_dtype", c_int32), ("state_dtype", c_int32), ("stochastic", c_int32), ("seed", c_uint64),
                ("index", c_uint64)]


class SparseProblem(ctypes.Structure):  # zero_sparse_attention_problem, sparse_attention/sparse_attention.h
    _fields_ = [("batch", c_int64), ("heads", c_int64), ("seq", c_int64), ("head_dim", c_int64), ("block", c_int64),
                ("dtype", c_int32), ("causal", c_int32), ("scale", c_float), ("layout_heads", c_int64),
                ("row_ptr", c_void_p), ("col_idx", c_void_p), ("col_ptr", c_void_p), ("row_idx", c_void_p),
                ("key_bias", c_void_p), ("attn_bias", c_void_p), ("attn_bias_len", c_int64)]


STRUCTS = {"adam_config": AdamConfig, "adam_format": AdamFormat, "sparse_problem": SparseProblem}

# Every entry point: (C name, result type, argument types).
_P, _I, _L, _D, _F = c_void_p, c_int, c_int64, c_double, c_float
_COMMON = (
    ("zero_simd_available", c_int, (c_int,)),
    ("zero_simd_name", c_char_p, (c_int,)),
    ("zero_abi_sizeof", c_size_t, (c_char_p,)),
    ("zero_abi_offsetof", ctypes.c_longlong, (c_char_p, c_char_p)),
)
_ENTRY_POINTS = {
    "cpu_adam": (
        ("zero_cpu_adam_step", _I, (_L, _P, _P, c_int32, _P, _P, _P, c_int32, POINTER(AdamConfig), _I, _I)),
        ("zero_cpu_adam_step_fmt", _I, (_L, _P, _P, c_int32, _P, _P, _P, _P, _P, c_int32, POINTER(AdamConfig),
                                        POINTER(AdamFormat), _I, _I)),
    ),
    "cpu_optim": (
        ("zero_cpu_lion_step", _I, (_L, _P, _P, c_int32, _P, _P, c_int32, _F, _F, _F, _F, _F, _I)),
        ("zero_cpu_adagrad_step", _I, (_L, _P, _P, c_int32, _P, _P, c_int32, _F, _F, _F, _F, _I)),
    ),
    "onebit": (
        ("zero_onebit_pack", _I, (_L, _P, _P, _L, _P, _P, _I, _I)),
        ("zero_onebit_unpack_mean", _I, (_L, _L, _P, _P, _L, _P, _I, _I)),
    ),
    "quant": (
        ("zero_qw_quantize", _I, (_L, _P, _I, _P, _I)),
        ("zero_qw_dequantize", _I, (_L, _L, _P, _P, _I, _I)),
    ),
    "aio": (
        ("zero_aio_create", _P, (_I, _I)),
        ("zero_aio_destroy", None, (_P,)),
        ("zero_aio_submit", _P, (_P, _I, _I, _I, _P, _L, _L, _L, _L)),
        ("zero_aio_done", _I, (_P, _P)),
        ("zero_aio_wait", _I, (_P, _P, POINTER(c_int64))),
        ("zero_aio_stats", None, (_P, POINTER(c_int64))),
    ),
    "sparse_attention": (
        ("zero_sparse_attention_forward_workspace", _L, (POINTER(SparseProblem), _I)),
        ("zero_sparse_attention_forward", _I, (POINTER(SparseProblem), _P, _P, _P, _P, _P, _P, _I, _I)),
        ("zero_sparse_attention_backward_workspace", _L, (POINTER(SparseProblem), _I)),
        ("zero_sparse_attention_backward", _I, (POINTER(SparseProblem), _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I,
                                                _I)),
    ),
}


class Library:
    """One CPU op's shared library with its entry points declared (`self.c.<C name>`)."""

    op = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.c = ctypes.CDLL(str(path))  # CDLL, not PyDLL: each call releases the GIL
        for name, restype, argtypes in _COMMON + _ENTRY_POINTS[self.op]:
            fn = getattr(self.c, name)
            fn.restype, fn.argtypes = restype, list(argtypes)

    def simd_levels(self) -> list[str]:
        """SIMD levels this CPU runs and this library holds, best first."""
        return [self.c.zero_simd_name(level).decode() for level in reversed(range(SIMD_LEVELS))
                if self.c.zero_simd_available(level)]

    def sizeof(self, struct: str) -> int:
        """The C compiler's size of one of STRUCTS (0 for a name the library does not know)."""
        return self.c.zero_abi_sizeof(struct.encode())

    def offsetof(self, struct: str, field: str) -> int:
        """The C compiler's offset of `field` in one of STRUCTS (-1 for a name it does not know)."""
        return self.c.zero_abi_offsetof(struct.encode(), field.encode())

    def check(self, rc: int, kernel: str, simd: int) -> None:
        if rc == SIMD_UNAVAILABLE:
            name = self.c.zero_simd_name(simd).decode()
            raise RuntimeError(f"{kernel}: SIMD level {name} is not available on this CPU")
        if rc != OK:
            raise RuntimeError(f"{kernel} rejected its arguments (code {rc})")


def _adam_config(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode, bias_correction) -> AdamConfig:
    return AdamConfig(lr, beta1, beta2, eps, weight_decay, grad_scale, step, int(bool(adamw_mode)),
                      int(bool(bias_correction)))


class CpuAdam(Library):
    """csrc/adam/cpu_adam.c: param, exp_avg and exp_avg_sq contiguous CPU tensors, grad and out16
    contiguous with param's number of elements (the callers guarantee it)."""

    op = "cpu_adam"

    def adam_step(self, param, grad, exp_avg, exp_avg_sq, out16, lr, beta1, beta2, eps, weight_decay, grad_scale,
                  step, adamw_mode, bias_correction, simd, num_threads) -> None:
        cfg = _adam_config(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode, bias_correction)
        rc = self.c.zero_cpu_adam_step(param.numel(), param.data_ptr(), grad.data_ptr(), dtype_code(grad),
                                       exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _ptr(out16),
                                       F32 if out16 is None else dtype_code(out16), ctypes.byref(cfg), simd,
                                       num_threads)
        self.check(rc, "zero_cpu_adam_step", simd)

    def adam_step_fmt(self, param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out16, lr, beta1, beta2, eps,
                      weight_decay, grad_scale, step, adamw_mode, bias_correction, master_dtype, state_dtype,
                      stochastic, seed, index, simd, num_threads) -> None:
        cfg = _adam_config(lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw_mode, bias_correction)
        fmt = AdamFormat(master_dtype, state_dtype, int(bool(stochastic)), seed, index)
        rc = self.c.zero_cpu_adam_step_fmt(param.numel(), param.data_ptr(), grad.data_ptr(), dtype_code(grad),
                                           exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _ptr(m_scale), _ptr(v_scale),
                                           _ptr(out16), F32 if out16 is None else dtype_code(out16),
                                           ctypes.byref(cfg), ctypes.byref(fmt), simd, num_threads)
        self.check(rc, "zero_cpu_adam_step_fmt", simd)


class CpuOptim(Library):
    """csrc/optim/cpu_optim.c: Lion and Adagrad on fp32 contiguous CPU tensors."""

    op = "cpu_optim"

    def lion_step(self, param, grad, exp_avg, out16, lr, beta1, beta2, weight_decay, grad_scale, num_threads) -> None:
        rc = self.c.zero_cpu_lion_step(param.numel(), param.data_ptr(), grad.data_ptr(), dtype_code(grad),
                                       exp_avg.data_ptr(), _ptr(out16), F32 if out16 is None else dtype_code(out16),
                                       lr, beta1, beta2, weight_decay, grad_scale, num_threads)
        self.check(rc, "zero_cpu_lion_step", 0)

    def adagrad_step(self, param, grad, state_sum, out16, clr, eps, weight_decay, grad_scale, num_threads) -> None:
        rc = self.c.zero_cpu_adagrad_step(param.numel(), param.data_ptr(), grad.data_ptr(), dtype_code(grad),
                                          state_sum.data_ptr(), _ptr(out16), F32 if out16 is None else dtype_code(out16),
                                          clr, eps, weight_decay, grad_scale, num_threads)
        self.check(rc, "zero_cpu_adagrad_step", 0)


class Onebit(Library):
    """csrc/onebit/onebit.c: x, err fp32 (n); bits uint8; scales fp32; all contiguous CPU tensors."""

    op = "onebit"

    def pack(self, x, err, bits, scales, block, simd, num_threads) -> None:
        rc = self.c.zero_onebit_pack(x.numel(), x.data_ptr(), err.data_ptr(), block, bits.data_ptr(),
                                     scales.data_ptr(), simd, num_threads)
        self.check(rc, "zero_onebit_pack", simd)

    def unpack_mean(self, bits, scales, out, block, simd, num_threads) -> None:
        rc = self.c.zero_onebit_unpack_mean(bits.size(0), out.numel(), bits.data_ptr(), scales.data_ptr(), block,
                                            out.data_ptr(), simd, num_threads)
        self.check(rc, "zero_onebit_unpack_mean", simd)


class Quant(Library):
    """csrc/quant/quant.c: qwZ's int8 weight blocks; contiguous CPU tensors."""

    op = "quant"

    def quantize(self, x, msg, num_threads) -> None:
        rc = self.c.zero_qw_quantize(x.numel(), x.data_ptr(), dtype_code(x), msg.data_ptr(), num_threads)
        self.check(rc, "zero_qw_quantize", 0)

    def dequantize(self, msgs, n, out, num_threads) -> None:
        rc = self.c.zero_qw_dequantize(msgs.size(0), n, msgs.data_ptr(), out.data_ptr(), dtype_code(out), num_threads)
        self.check(rc, "zero_qw_dequantize", 0)


class SparseAttention(Library):
    """csrc/sparse_attention/sparse_attention.c. Outputs and the kernels' work space come from
    torch's allocator, so memory measurements see them."""

    op = "sparse_attention"

    @staticmethod
    def _problem(q, block, causal, scale, layout_heads, key_bias, attn_bias) -> SparseProblem:
        batch, heads, seq, head_dim = q.shape
        return SparseProblem(batch=batch, heads=heads, seq=seq, head_dim=head_dim, block=block, dtype=dtype_code(q),
                             causal=int(bool(causal)), scale=scale, layout_heads=layout_heads,
                             key_bias=_ptr(key_bias), attn_bias=_ptr(attn_bias),
                             attn_bias_len=0 if attn_bias is None else attn_bias.size(0))

    @staticmethod
    def _workspace(floats: int) -> torch.Tensor:
        if floats < 0:
            raise RuntimeError("sparse attention: the kernel refused the problem's sizes")
        return torch.empty(floats, dtype=torch.float32)

    def forward(self, q, k, v, row_ptr, col_idx, block, causal, scale, key_bias, attn_bias, simd, num_threads):
        """Returns (out like q, lse: (batch, heads, seq) fp32)."""
        p = self._problem(q, block, causal, scale, row_ptr.size(0), key_bias, attn_bias)
        p.row_ptr, p.col_idx = row_ptr.data_ptr(), col_idx.data_ptr()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32)
        ws = self._workspace(self.c.zero_sparse_attention_forward_workspace(ctypes.byref(p), num_threads))
        rc = self.c.zero_sparse_attention_forward(ctypes.byref(p), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                  out.data_ptr(), lse.data_ptr(), ws.data_ptr(), simd, num_threads)
        self.check(rc, "zero_sparse_attention_forward", simd)
        return out, lse

    def backward(self, q, k, v, out, dout, lse, col_ptr, row_idx, block, causal, scale, key_bias, attn_bias, simd,
                 num_threads):
        """Returns (dq, dk, dv), each like q."""
        p = self._problem(q, block, causal, scale, col_ptr.size(0), key_bias, attn_bias)
        p.col_ptr, p.row_idx = col_ptr.data_ptr(), row_idx.data_ptr()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ws = self._workspace(self.c.zero_sparse_attention_backward_workspace(ctypes.byref(p), num_threads))
        rc = self.c.zero_sparse_attention_backward(ctypes.byref(p), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                   out.data_ptr(), dout.data_ptr(), lse.data_ptr(), dq.data_ptr(),
                                                   dk.data_ptr(), dv.data_ptr(), ws.data_ptr(), simd, num_threads)
        self.check(rc, "zero_sparse_attention_backward", simd)
        return dq, dk, dv


class Aio(Library):
    """csrc/aio/aio.c: a pool of I/O threads; zero/ops/aio.py holds the pool and the requests."""

    op = "aio"


BINDINGS: dict[str, type[Library]] = {cls.op: cls for cls in (CpuAdam, CpuOptim, Onebit, Quant, SparseAttention, Aio)}

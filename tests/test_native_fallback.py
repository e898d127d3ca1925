"""One rule for every caller of a native op ([Note: native-op fallback] in zero/ops/fallback.py):
the op is tried once; when it cannot be built the torch reference runs (warned once), or, where
there is none, an error names the op and why. And the CPU ops share one SIMD detection: forcing a
level for one op builds no other."""
import warnings

import pytest
import torch

from zero.onebit.compress import pack, pack_reference, unpack_mean, unpack_mean_reference
from zero.ops import builder, fallback
from zero.ops.fallback import run_native
from zero.sparse_attention import sparse_attention

STAND_IN = "a test's stand-in compile error"


def make_unbuildable(monkeypatch, *ops: str) -> list[str]:
    """Make every op of `ops` fail to build as a compile error would, although builder.missing()
    finds a compiler and the sources; returns the list of build attempts, which grows as they
    happen. Ops already loaded in this process stay loaded; the fallback warnings start afresh."""
    real = builder._load_once
    attempts: list[str] = []

    def load_once(name: str):
        if name in ops:
            attempts.append(name)
            raise builder.OpUnavailable(f"op '{name}' failed to build in /nowhere: ({STAND_IN})")
        return real(name)

    monkeypatch.setattr(builder, "_loaded", {k: v for k, v in builder._loaded.items() if k not in ops})
    monkeypatch.setattr(builder, "_failed", {})
    monkeypatch.setattr(builder, "_load_once", load_once)
    monkeypatch.setattr(fallback, "_warned", set())
    return attempts


def test_one_bit_pack_and_unpack_take_the_torch_reference_when_the_op_fails_to_build(monkeypatch):
    """Defect 4 of structure-review-2: the op was *predicted* to build (builder.missing() is None),
    so a compile failure raised out of pack() instead of taking the reference its docstring
    promises."""
    assert builder.missing("onebit") is None  # a compiler is found: only building can tell
    attempts = make_unbuildable(monkeypatch, "onebit")
    g = torch.Generator().manual_seed(0)
    n = 3000
    x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
    error = torch.randn(n, generator=g) * 0.1
    want_error = error.clone()
    want_bits, want_scales = pack_reference(x, want_error)
    with pytest.warns(UserWarning, match=rf"native op 'onebit' is unavailable, so 1-bit pack uses its slower torch "
                                         rf"reference.*{STAND_IN}"):
        bits, scales = pack(x, error)
    assert torch.equal(bits, want_bits) and torch.equal(scales, want_scales) and torch.equal(error, want_error)

    many, many_scales = torch.stack([bits, bits.roll(1)]), torch.stack([scales, scales * 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per op and process: no second warning
        mean = unpack_mean(many, many_scales, n)
        again = pack(x, error.clone())
    assert torch.equal(mean, unpack_mean_reference(many, many_scales, n))
    assert torch.equal(again[0], pack_reference(x, want_error.clone())[0])
    assert attempts == ["onebit"]  # tried once: the builder remembers the failure


def test_sparse_attention_without_its_op_is_an_error_naming_the_op_and_why(monkeypatch):
    """There is no torch fallback for block-sparse attention (a dense one would form the seq^2
    scores it exists to avoid): the error says who needed which op, why it is unavailable and
    where to look."""
    attempts = make_unbuildable(monkeypatch, "sparse_attention")
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    layout = torch.ones(2, 2, 2, dtype=torch.long)
    with pytest.raises(builder.OpUnavailable, match=rf"block-sparse attention \(forward\) needs the native op "
                                                    rf"'sparse_attention', which has no torch fallback.*{STAND_IN}"):
        sparse_attention(q, k, v, layout, block=16)
    with pytest.raises(builder.OpUnavailable, match=r"python -m zero\.env"):
        sparse_attention(q, k, v, layout, block=16)
    assert attempts == ["sparse_attention"]


def test_forcing_a_simd_level_of_the_one_bit_or_sparse_attention_op_builds_no_adam(monkeypatch):
    from zero.ops import sparse_attention as sparse_ops
    from zero.ops.onebit import pack_into, unpack_mean_into
    from zero.ops.simd import simd_levels

    levels = simd_levels("onebit")
    assert simd_levels("sparse_attention") == simd_levels("cpu_adam") == levels  # one detection
    monkeypatch.setattr(builder, "_loaded", {k: v for k, v in builder._loaded.items() if k != "cpu_adam"})
    monkeypatch.setattr(builder, "_failed", {"cpu_adam": builder.OpUnavailable("op 'cpu_adam': not in this test")})
    x, error = torch.randn(100), torch.zeros(100)
    bits, scales, out = torch.empty(13, dtype=torch.uint8), torch.empty(1), torch.empty(100)
    q = torch.randn(1, 1, 16, 4)
    index = sparse_ops.BlockSparseIndex.from_layout(torch.ones(1, 1, 1, dtype=torch.long), 16, False)
    for simd in levels:
        pack_into(x, error, bits, scales, 1024, simd=simd)
        unpack_mean_into(bits.view(1, -1), scales.view(1, -1), out, 1024, simd=simd)
        sparse_ops.forward(q, q, q, index, scale=0.5, simd=simd)
    assert "cpu_adam" not in builder._loaded


def test_run_native_passes_other_errors_through_and_runs_no_reference_when_the_op_works(monkeypatch):
    monkeypatch.setattr(fallback, "_warned", set())
    ran = []

    def reference():
        ran.append("reference")
        return "reference"

    assert run_native("onebit", lambda: "native", reference, what="a test") == "native"

    def refuses():
        raise ValueError("x must be contiguous")

    with pytest.raises(ValueError, match="contiguous"):  # a bad argument is the caller's error, not a fallback
        run_native("onebit", refuses, reference, what="a test")
    assert ran == [] and fallback._warned == set()

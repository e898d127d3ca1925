"""Bucket pack/unpack on CUDA: the same contract and the same bits as the CPU op, in one launch.

`zero.ops.pack` / `unpack` dispatch on the bucket's device; these tests run the CUDA op
(csrc/comm/pack.cu) and compare it with exact expectations and with the CPU op (csrc/comm/pack.c).
"""
import pytest
import torch

from zero.ops import pack, unpack
from zero.ops.pack import packed_offsets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN payloads compare too."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def special_values() -> torch.Tensor:
    """fp32 values that stress 16-bit rounding: ties, overflow edges, subnormals, inf, NaN, -0."""
    edges = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 65536.0, 1e-8, 6e-8, 3e-8, 5.96e-8, 6.1e-5,
             1e38, 3.4e38, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.00390625, 1.001953125,
             2.0**-24, 2.0**-25, 1e-40, -1e-45]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), dtype=torch.int64, generator=gen).to(torch.int32)
    return torch.cat([torch.tensor(edges), bits.view(torch.float32), torch.randn(5000, generator=gen) * 1e4])


def mixed_tensors(device="cuda"):
    gen = torch.Generator().manual_seed(1)
    ts = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen).to(torch.bfloat16), torch.randn(0),
          torch.randn(2, 0, 3), torch.randn(70000, generator=gen).half(), torch.randn(1, 1, 1, generator=gen),
          torch.randn(16384 * 3 + 1, generator=gen)]  # fmt: skip
    return [t.to(device) for t in ts]


@pytest.mark.parametrize("bucket_dtype", FLOATS)
def test_pack_then_unpack_round_trips_mixed_shapes_and_dtypes(bucket_dtype):
    tensors = mixed_tensors()
    bucket = pack(tensors, dtype=bucket_dtype)
    assert bucket.is_cuda and bucket.dtype == bucket_dtype and bucket.numel() == sum(t.numel() for t in tensors)
    for t, off in zip(tensors, packed_offsets(tensors)):
        assert torch.equal(bucket[off : off + t.numel()], t.reshape(-1).to(bucket_dtype))
    outs = [torch.full_like(t, 7) for t in tensors]
    unpack(bucket, outs)
    for t, out in zip(tensors, outs):
        assert torch.equal(out, t.to(bucket_dtype).to(t.dtype))  # exact when the bucket is as wide


@pytest.mark.parametrize("bucket_dtype", FLOATS)
def test_cuda_pack_and_unpack_give_the_cpu_ops_bits(bucket_dtype):
    cpu = [t.cpu() for t in mixed_tensors()]
    cpu += [special_values().to(d) for d in FLOATS]
    gpu = [t.cuda() for t in cpu]
    want = pack(cpu, dtype=bucket_dtype)
    got = pack(gpu, dtype=bucket_dtype)
    assert torch.equal(_bits(got.cpu()), _bits(want))
    cpu_outs = [torch.zeros_like(t) for t in cpu]
    gpu_outs = [torch.zeros_like(t) for t in gpu]
    unpack(want, cpu_outs)
    unpack(got, gpu_outs)
    for i, (a, b) in enumerate(zip(gpu_outs, cpu_outs)):
        assert torch.equal(_bits(a.cpu()), _bits(b)), f"tensor {i}"


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_matches_torch_for_every_non_nan_value(src, dst):
    x = special_values().to(src).cuda()
    got = pack([x], dtype=dst)
    want = x.to(dst)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))


def test_empty_tensors_and_empty_lists():
    bucket = torch.full((4,), 3.0, device="cuda")
    pack([torch.zeros(0, device="cuda"), torch.zeros(2, 0, device="cuda")], bucket, offsets=[0, 4])
    assert torch.equal(bucket, torch.full((4,), 3.0, device="cuda"))
    pack([], bucket)
    unpack(bucket, [torch.zeros(0, device="cuda", dtype=torch.bfloat16)])
    assert torch.equal(bucket, torch.full((4,), 3.0, device="cuda"))


def test_offsets_leave_padding_untouched():
    a, b = torch.randn(3, device="cuda"), torch.randn(4, device="cuda").half()
    bucket = torch.full((12,), -5.0, device="cuda")
    pack([a, b], bucket, offsets=[1, 7])
    assert torch.equal(bucket[1:4], a) and torch.equal(bucket[7:11], b.float())
    assert torch.equal(bucket[[0, 4, 5, 6, 11]], torch.full((5,), -5.0, device="cuda"))


@pytest.mark.parametrize("dtype", FLOATS + [torch.int8])
def test_unaligned_offsets_take_the_narrow_copy_paths(dtype):
    # Same-dtype moves are byte copies as wide as the alignment of both ends allows; across the
    # dtypes these offsets hit the 16-, 8-, 4-, 2- and 1-byte loops, each with a ragged tail.
    sizes, offsets = [33, 1000, 5, 4099], [1, 38, 1040, 1049]
    gen = torch.Generator().manual_seed(2)
    tensors = [(torch.randn(n, generator=gen) * 50).to(dtype).cuda() for n in sizes]
    bucket = torch.zeros(6000, dtype=dtype, device="cuda")
    pack(tensors, bucket, offsets=offsets)
    for t, off in zip(tensors, offsets):
        assert torch.equal(bucket[off : off + t.numel()], t)
    outs = [torch.zeros_like(t) for t in tensors]
    unpack(bucket, outs, offsets=offsets)
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))


def test_non_contiguous_tensors_are_copied_correctly():
    base = torch.randn(64, 33, device="cuda")
    src = base.t()[::2]  # transposed and strided
    bucket = pack([src], dtype=torch.bfloat16)
    assert torch.equal(bucket, src.reshape(-1).to(torch.bfloat16))
    dst_base = torch.zeros(33, 64, device="cuda")
    dst = dst_base.t()
    unpack(pack([base]), [dst])
    assert torch.equal(dst, base) and torch.equal(dst_base, base.t())


def test_many_small_tensors_and_one_large_need_several_launches():
    # More tensors than one chunk table holds, so the list is split across launches.
    tensors = [torch.randn(i % 17, device="cuda") for i in range(3000)] + [torch.randn(1 << 20, device="cuda")]
    bucket = pack(tensors, dtype=torch.bfloat16)
    assert torch.equal(bucket, torch.cat([t.reshape(-1) for t in tensors]).to(torch.bfloat16))
    outs = [torch.empty_like(t) for t in tensors]
    unpack(pack(tensors), outs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, outs))


def test_non_float_dtypes_travel_as_bytes_through_a_bucket_of_the_same_dtype():
    ints = [torch.arange(10, device="cuda"), torch.tensor([2**40, -3], device="cuda")]
    bucket = pack(ints)
    assert bucket.dtype == torch.int64 and torch.equal(bucket[10:], ints[1])
    outs = [torch.empty_like(t) for t in ints]
    unpack(bucket, outs)
    assert torch.equal(outs[0], ints[0]) and torch.equal(outs[1], ints[1])
    doubles = [torch.randn(7, dtype=torch.float64, device="cuda")]
    assert torch.equal(pack(doubles), doubles[0])


def test_runs_on_the_current_stream():
    side = torch.cuda.Stream()
    tensors = [torch.randn(100000, device="cuda"), torch.randn(3, device="cuda")]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bucket = torch.empty(100003, dtype=torch.float16, device="cuda")
        pack(tensors, bucket)
        outs = [torch.empty_like(t) for t in tensors]
        unpack(bucket, outs)
    side.synchronize()
    assert torch.equal(bucket, torch.cat(tensors).half())
    assert all(torch.equal(o, t.half().float()) for o, t in zip(outs, tensors))


def test_a_tensor_on_another_device_is_a_value_error():
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu"):
        pack([torch.zeros(2, device="cuda"), torch.zeros(2)], torch.zeros(4, device="cuda"))

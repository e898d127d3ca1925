"""Bucket pack/unpack on CPU: exact round trips, torch-identical casts, and clear errors."""
import pytest
import torch

from zero.ops import pack, unpack
from zero.ops.pack import packed_offsets

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def special_values() -> torch.Tensor:
    """fp32 values that stress 16-bit rounding: ties, overflow edges, subnormals, inf, NaN, -0."""
    edges = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 65536.0, 1e-8, 6e-8, 3e-8, 5.96e-8, 6.1e-5,
             1e38, 3.4e38, float("inf"), float("-inf"), float("nan"), 1.00390625, 1.001953125, 2.0**-24, 2.0**-25]
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), dtype=torch.int64).to(torch.int32)
    return torch.cat([torch.tensor(edges), bits.view(torch.float32), torch.randn(5000) * 1e4])


@pytest.mark.parametrize("bucket_dtype", FLOATS)
def test_pack_then_unpack_round_trips_mixed_shapes_and_dtypes(bucket_dtype):
    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(0), torch.randn(2, 0, 3),
               torch.randn(70000).half(), torch.randn(1, 1, 1)]
    bucket = pack(tensors, dtype=bucket_dtype)
    assert bucket.dtype == bucket_dtype and bucket.numel() == sum(t.numel() for t in tensors)
    for t, off in zip(tensors, packed_offsets(tensors)):
        assert torch.equal(bucket[off : off + t.numel()], t.reshape(-1).to(bucket_dtype))
    outs = [torch.full_like(t, 7) for t in tensors]
    unpack(bucket, outs)
    for t, out in zip(tensors, outs):
        assert torch.equal(out, t.to(bucket_dtype).to(t.dtype))  # exact when the bucket is as wide


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_is_bitwise_identical_to_torch_including_special_values(src, dst):
    x = special_values().to(src)
    got = pack([x], dtype=dst)
    want = x.to(dst)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16 if dst != torch.float32 else torch.int32),
                       want[~nan].view(torch.int16 if dst != torch.float32 else torch.int32))


def test_offsets_leave_padding_untouched():
    a, b = torch.randn(3), torch.randn(4)
    bucket = torch.full((12,), -5.0)
    pack([a, b], bucket, offsets=[1, 7])
    assert torch.equal(bucket[1:4], a) and torch.equal(bucket[7:11], b)
    assert torch.equal(bucket[[0, 4, 5, 6, 11]], torch.full((5,), -5.0))


def test_non_contiguous_tensors_are_copied_correctly():
    base = torch.randn(64, 33)
    src = base.t()[::2]  # transposed and strided
    bucket = pack([src], dtype=torch.bfloat16)
    assert torch.equal(bucket, src.reshape(-1).to(torch.bfloat16))
    dst_base = torch.zeros(33, 64)
    dst = dst_base.t()
    unpack(pack([base]), [dst])
    assert torch.equal(dst, base) and torch.equal(dst_base, base.t())


def test_many_small_tensors_and_one_large_use_every_thread_correctly():
    tensors = [torch.randn(i % 17) for i in range(3000)] + [torch.randn(1 << 20)]
    bucket = pack(tensors, num_threads=2)
    assert torch.equal(bucket, torch.cat([t.reshape(-1) for t in tensors]))
    outs = [torch.empty_like(t) for t in tensors]
    unpack(bucket, outs, num_threads=2)
    assert all(torch.equal(a, b) for a, b in zip(tensors, outs))


def test_non_float_dtypes_travel_as_bytes_through_a_bucket_of_the_same_dtype():
    ints = [torch.arange(10), torch.tensor([2**40, -3])]
    bucket = pack(ints)
    assert bucket.dtype == torch.int64 and torch.equal(bucket[10:], ints[1])
    outs = [torch.empty_like(t) for t in ints]
    unpack(bucket, outs)
    assert torch.equal(outs[0], ints[0]) and torch.equal(outs[1], ints[1])


@pytest.mark.parametrize(
    "tensors, bucket, offsets, message",
    [
        ([torch.arange(4)], torch.zeros(4), None, r"tensors\[0\] has dtype torch.int64"),
        ([torch.zeros(4)], torch.zeros(4, dtype=torch.int32), None, r"tensors\[0\] has dtype torch.float32"),
        ([torch.zeros(2), torch.zeros(5)], torch.zeros(6), None, r"tensors\[1\] \(5 elements at offset 2\) does not fit"),
        ([torch.zeros(2)], torch.zeros(6), [0, 2], "offsets has 2 entries but there are 1 tensors"),
        ([torch.zeros(2)], torch.zeros(6), [-1], r"tensors\[0\] .* does not fit"),
        ([torch.zeros(2)], torch.zeros(6, 2).t(), None, "bucket must be contiguous"),
        (["not a tensor"], torch.zeros(6), [0], r"tensors\[0\] is a str"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_tensor_and_nothing_is_written(tensors, bucket, offsets, message):
    before = bucket.clone()
    with pytest.raises(ValueError, match=message):
        pack(tensors, bucket, offsets=offsets)
    assert torch.equal(bucket, before)
    if all(isinstance(t, torch.Tensor) for t in tensors):
        snapshots = [t.clone() for t in tensors]
        with pytest.raises(ValueError, match=message):
            unpack(bucket, tensors, offsets=offsets)
        assert all(torch.equal(t, s) for t, s in zip(tensors, snapshots))

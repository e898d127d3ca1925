"""Shard arithmetic: buckets split evenly, parameters are whole, every element has one owner."""
import pytest

from zero.partition.layout import ALIGN, ShardLayout


@pytest.mark.parametrize("partitions", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [1, 50, 1000, 10**9])
def test_every_parameter_element_has_exactly_one_owner(partitions, bucket_size):
    numels = [7, 1, 130, 33, 0, 64, 5]
    groups = [0, 0, 1, 0, 1, 1, 0]
    layout = ShardLayout(numels, groups, partitions, bucket_size)
    owner = {}
    for b in layout.buckets:
        assert b.numel % (partitions * ALIGN) == 0 and b.numel > 0
        for r in range(partitions):
            lo, hi = b.slice_range(r)
            for e in range(lo, hi):
                owner[e] = r
        assert all(groups[i] == b.group for i in b.params)  # buckets never mix groups
        assert sum(numels[i] for i in b.params) <= max(bucket_size, max(numels[i] for i in b.params))
    for i, n in enumerate(numels):
        b = layout.buckets[layout.bucket_of[i]]
        assert b.start <= layout.offsets[i] and layout.offsets[i] + n <= b.start + b.numel
        assert all(layout.offsets[i] + k in owner for k in range(n))
    spans = sorted((layout.offsets[i], layout.offsets[i] + n) for i, n in enumerate(numels) if n)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert layout.numel == sum(b.numel for b in layout.buckets) == sum(b.slice_numel for b in layout.buckets) * partitions


def test_parameters_are_laid_out_in_reverse_order_so_the_first_bucket_fills_first_in_backward():
    layout = ShardLayout([10, 10, 10, 10], [0] * 4, partitions=2, bucket_size=20)
    assert [b.params for b in layout.buckets] == [(3, 2), (1, 0)]


def test_padding_is_small():
    layout = ShardLayout([1000, 999, 3], [0, 0, 0], partitions=3, bucket_size=10**9)
    assert layout.numel - layout.param_numel < 3 * ALIGN

"""Ulysses sequence parallelism (zero.sequence): attention over sequence slices on 2 ranks equals
attention over the whole sequence in one process, forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _causal(q, k, v):
    """[b, s, h, d] attention, causal, key/value heads shared by groups of query heads."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _ulysses_matches_whole_sequence(heads: int, kv_heads: int, layout: str):
    import torch.distributed as dist

    from zero.deepspeed.sequence.layer import DistributedAttention

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 8 * world, 16
    q = torch.randn(b, s, heads, d, generator=g, dtype=torch.float64).float()
    k = torch.randn(b, s, kv_heads, d, generator=g, dtype=torch.float64).float()
    v = torch.randn(b, s, kv_heads, d, generator=g, dtype=torch.float64).float()
    w = torch.randn(b, s, heads, d, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _causal(*ref_in)
    (ref * w).sum().backward()

    part = slice(rank * s // world, (rank + 1) * s // world)
    if layout == "sbhd":  # DeepSpeed's default layout: [s, b, h, d], batch_dim_idx=1
        local = [t[:, part].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
        attn = DistributedAttention(lambda q, k, v: _causal(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1),
                                    dist.group.WORLD)
        out = attn(*local, batch_dim_idx=1).transpose(0, 1)
    else:
        local = [t[:, part].contiguous().requires_grad_() for t in (q, k, v)]
        attn = DistributedAttention(_causal, dist.group.WORLD, scatter_idx=2, gather_idx=0)
        out = attn(*local, batch_dim_idx=0)
    (out * w[:, part]).sum().backward()  # every rank's loss: the all-to-all's backward sums them
    grads = [t.grad.transpose(0, 1) if layout == "sbhd" else t.grad for t in local]
    errors = [(out - ref[:, part]).abs().max().item()]
    errors += [(gl - t.grad[:, part]).abs().max().item() for gl, t in zip(grads, ref_in)]
    return errors


@pytest.mark.parametrize("heads,kv_heads,layout", [(4, 4, "bshd"), (4, 1, "bshd"), (4, 2, "sbhd")])
def test_ulysses_attention_equals_attention_over_the_whole_sequence(dist_run, heads, kv_heads, layout):
    for errors in dist_run(2, _ulysses_matches_whole_sequence, heads, kv_heads, layout):
        assert max(errors) < 1e-5, errors


def _bad_heads():
    import torch.distributed as dist

    from zero.sequence import DistributedAttention

    attn = DistributedAttention(_causal, dist.group.WORLD)
    x = torch.randn(1, 4, 3, 8)
    try:
        attn(x, x, x, batch_dim_idx=0)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_heads_the_group_does_not_divide_are_a_clear_error(dist_run):
    for message in dist_run(2, _bad_heads):
        assert "3 query heads do not split over a sequence-parallel group of 2" in message

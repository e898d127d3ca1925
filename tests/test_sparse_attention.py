"""Block-sparse attention (issue 17): layouts as DeepSpeed's parameters describe them, the C kernel
(every SIMD level) and the CUDA kernel against dense SDPA with the layout expanded to an element
mask, masks and padding, memory saved for backward, errors, the model swap, and a GPT with sparse
attention training under ZeRO stage 2 like the dense one."""
import math

import pytest
import torch
import torch.nn.functional as F

from zero.ops.builder import load
from zero.ops.sparse_attention import BlockSparseIndex
from zero.probes import SavedTensorProbe
from zero.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    replace_self_attention,
    sparse_attention,
)
from zero.testing.models import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dense_reference(q, k, v, layout, block, causal, key_bias=None, attn_bias=None):
    """fp64 SDPA with the block layout expanded to an element mask (plus the causal triangle)."""
    seq = q.shape[2]
    allowed = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :seq, :seq]
    if causal:
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).tril()
    bias = torch.zeros(q.shape[0], q.shape[1], seq, seq, dtype=torch.float64).masked_fill(~allowed, -math.inf)
    if key_bias is not None:
        bias = bias + key_bias[:, None, None, :].double()
    if attn_bias is not None:
        bias = bias + attn_bias.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias)


def output_gradient(q: torch.Tensor) -> torch.Tensor:
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)


def run_sparse(q, k, v, layout, block, causal, key_bias=None, attn_bias=None, grad=None, **kwargs) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of our kernels for the output gradient `grad` (default `output_gradient(q)`)."""
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sparse_attention(*inputs, layout, block=block, causal=causal, key_bias=key_bias, attn_bias=attn_bias,
                           **kwargs)
    out.backward((output_gradient(q) if grad is None else grad).to(q.device))
    return [out.detach(), *(x.grad for x in inputs)]


def run_dense(q, k, v, layout, block, causal, key_bias=None, attn_bias=None) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of the fp64 dense reference (CPU), same output gradient."""
    inputs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref = dense_reference(*inputs, layout, block, causal, key_bias, attn_bias)
    assert not ref.isnan().any(), "the test case left a query with no key"
    ref.backward(output_gradient(q).double())
    return [ref.detach(), *(x.grad for x in inputs)]


def sparse_and_dense(q, k, v, layout, block, causal, key_bias=None, attn_bias=None, **kwargs):
    return (run_sparse(q, k, v, layout, block, causal, key_bias, attn_bias, **kwargs),
            run_dense(q, k, v, layout, block, causal, key_bias, attn_bias))


# (config, block, head_dim, seq, causal): every config, block 16-128, head dims 32-128, odd lengths.
CASES = [
    (DenseSparsityConfig(2, block=16), 16, 32, 50, False),
    (FixedSparsityConfig(2, block=32, num_local_blocks=2, horizontal_global_attention=True), 32, 64, 97, False),
    (FixedSparsityConfig(2, block=16, num_local_blocks=4, attention="unidirectional"), 16, 40, 113, True),
    (VariableSparsityConfig(2, block=16, different_layout_per_head=True, num_random_blocks=1,
                            local_window_blocks=[1, 2], global_block_indices=[1]), 16, 128, 80, False),
    (BigBirdSparsityConfig(2, block=64, num_random_blocks=1), 64, 64, 200, False),
    (BigBirdSparsityConfig(2, block=32, attention="unidirectional"), 32, 48, 150, True),
    (BSLongformerSparsityConfig(2, block=128, global_block_indices=[1]), 128, 32, 300, False),
    (LocalSlidingWindowSparsityConfig(2, block=16), 16, 96, 77, True),
]


def _key_padding(batch: int, seq: int) -> torch.Tensor:
    """Batch 1 masks keys 3, 9 and its last 5 (batch 0 none): no query is left without a key."""
    bias = torch.zeros(batch, seq)
    bias[1, [3, 9]] = -math.inf
    bias[1, seq - 5 :] = -math.inf
    return bias


def test_every_config_matches_dense_sdpa_in_fp32_at_every_simd_level():
    from zero.ops.cpu_adam import simd_levels

    g = torch.Generator().manual_seed(0)
    for simd in simd_levels():
        for config, block, head_dim, seq, causal in CASES:
            q, k, v = (torch.randn(2, 2, seq, head_dim, generator=g) for _ in range(3))
            blocks = -(-seq // block)
            layout = config.make_layout(blocks * block)
            ours, ref = sparse_and_dense(q, k, v, layout, block, causal, key_bias=_key_padding(2, seq), simd=simd)
            for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
                torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5,
                                           msg=lambda m, n=name, c=config: f"{simd} {c} {n}: {m}")  # noqa: B023


def test_bf16_and_fp16_stay_within_twice_torch_sdpa_error():
    """Stated tolerance for 16-bit inputs: every output and gradient is within twice the error of
    torch's own SDPA in the same dtype (both against fp64 on the same rounded inputs), plus 1e-3."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        for config, block, head_dim, seq, causal in (CASES[2], CASES[4]):
            q, k, v = (torch.randn(2, 2, seq, head_dim, generator=g).to(dtype) for _ in range(3))
            layout = config.make_layout(-(-seq // block) * block)
            ours, ref = sparse_and_dense(q, k, v, layout, block, causal)
            assert ours[0].dtype == dtype and all(x.dtype == dtype for x in ours[1:])
            torch_in = [x.clone().requires_grad_() for x in (q, k, v)]
            seqmask = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :seq, :seq]
            if causal:
                seqmask = seqmask & torch.ones(seq, seq, dtype=torch.bool).tril()
            theirs = F.scaled_dot_product_attention(*torch_in, attn_mask=seqmask)
            theirs.backward(output_gradient(q))
            for name, a, t, r in zip(("out", "dq", "dk", "dv"), ours, [theirs, *(x.grad for x in torch_in)], ref):
                err, torch_err = (a.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
                assert err <= 2 * torch_err + 1e-3, (dtype, config, name, err, torch_err)


def test_masks_modes_and_fully_masked_queries():
    torch.manual_seed(2)
    config = BigBirdSparsityConfig(3, block=16, num_random_blocks=1)
    batch, seq, head_dim = 2, 70, 32
    q, k, v = (torch.randn(batch, 3, seq, head_dim) for _ in range(3))
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[0, 60:] = False
    window = (torch.arange(seq)[:, None] - torch.arange(seq)[None, :]).abs() < 40  # an element-level attn mask
    attention = SparseSelfAttention(config, key_padding_mask_mode="mul", attn_mask_mode="mul", max_seq_length=128)
    out = attention(q, k, v, key_padding_mask=keep.long(), attn_mask=window)
    layout = attention.get_layout(seq)
    assert torch.equal(layout, config.make_layout(128)[:, :5, :5])  # DeepSpeed: a corner of the max-length layout
    key_bias = torch.zeros(batch, seq).masked_fill(~keep, -math.inf)
    attn_bias = torch.zeros(seq, seq).masked_fill(~window, -math.inf)
    ref = dense_reference(q, k, v, layout, 16, False, key_bias, attn_bias)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    additive = SparseSelfAttention(config, key_padding_mask_mode="add", attn_mask_mode="add", max_seq_length=128)
    torch.testing.assert_close(additive(q, k, v, key_padding_mask=key_bias, attn_mask=attn_bias), out, atol=0, rtol=0)
    # a query whose every key is masked gets 0 (dense softmax gives NaN), and no gradient
    qg = q.clone().requires_grad_()
    nothing = torch.zeros(seq, seq, dtype=torch.bool)
    nothing[:, :] = True
    nothing[5, :] = False
    out = attention(qg, k, v, attn_mask=nothing)
    out.sum().backward()
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5])) and not out.isnan().any()
    assert torch.equal(qg.grad[:, :, 5], torch.zeros_like(qg.grad[:, :, 5])) and qg.grad.abs().sum() > 0


def test_nan_scores_make_nan_rows_like_dense_sdpa_at_every_simd_level():
    """A NaN in a query makes its row NaN, a NaN in a key every row that sees that key, forward
    and backward, as dense softmax does (the running max must not drop it)."""
    from zero.ops.cpu_adam import simd_levels

    config = FixedSparsityConfig(2, block=16, num_local_blocks=2)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 64, 32, generator=g) for _ in range(3))
    q[0, 1, 5, 7] = float("nan")
    k[1, 0, 40, 0] = float("nan")
    layout = config.make_layout(64)
    seen = layout.bool().repeat_interleave(16, 1).repeat_interleave(16, 2)  # (heads, query, key)
    want = torch.zeros(2, 2, 64, dtype=torch.bool)
    want[0, 1, 5] = True
    want[1, 0] = seen[0, :, 40]
    for simd in simd_levels():
        out, dq, dk, dv = run_sparse(q, k, v, layout, 16, False, simd=simd)
        assert torch.equal(out.isnan().any(-1), want), simd
        assert dq.isnan().any() and dk.isnan().any() and dv.isnan().any(), simd
        assert not out[~want].isnan().any(), simd


def test_saved_activations_are_inputs_output_and_logsumexp_only():
    """Memory: what autograd keeps is q, k, v, out (padded to whole blocks) and one fp32 per row:
    O(seq), never seq^2 or non-zero blocks x block^2."""
    config = BigBirdSparsityConfig(2, block=64, num_random_blocks=2)
    attention = SparseSelfAttention(config, max_seq_length=2048)
    for seq in (2048, 2000):
        q, k, v = (torch.randn(1, 2, seq, 32, requires_grad=True) for _ in range(3))
        with SavedTensorProbe() as probe:
            out = attention(q, k, v)
        padded = 2048
        assert probe.held_bytes() == 4 * (1 * 2 * padded * 32 * 4) + 1 * 2 * padded * 4, (seq, probe.held_bytes())
        probabilities = int(attention.get_layout(seq).sum()) * 64 * 64 * 4  # the non-zero blocks of P, in fp32
        assert probe.held_bytes() < probabilities / 2 < 2 * seq * seq * 4 / 8
        out.sum().backward()
        assert q.grad.shape == q.shape


def test_heads_taken_in_several_groups_equal_heads_taken_one_by_one():
    """At seq 2048 and head dim 64 the CPU kernel packs 16 heads per forward group and 4 per
    backward group (its 16 MB groups): 24 heads in one call equal each head on its own (a group
    of one), forward and backward."""
    g = torch.Generator().manual_seed(5)
    layout = BigBirdSparsityConfig(1, block=64, num_random_blocks=1).make_layout(2048)
    q, k, v = (torch.randn(2, 12, 2048, 64, generator=g) for _ in range(3))
    together = run_sparse(q, k, v, layout, 64, False)
    for b, h in ((0, 0), (0, 11), (1, 3), (1, 10)):
        pick = (slice(b, b + 1), slice(h, h + 1))
        alone = run_sparse(q[pick], k[pick], v[pick], layout, 64, False, grad=output_gradient(q)[pick])
        for name, a, c in zip(("out", "dq", "dk", "dv"), together, alone):
            torch.testing.assert_close(a[pick], c, atol=1e-6, rtol=1e-6,
                                       msg=lambda m, n=name, w=(b, h): f"head {w} {n}: {m}")


def test_layouts_equal_what_deepspeeds_parameters_describe():
    def rows(*text):
        return torch.tensor([[int(c) for c in r.replace(" ", "")] for r in text])

    # Fixed: windows of 2 blocks; the last block of each window is global (all rows attend to it).
    fixed = FixedSparsityConfig(1, block=16, num_local_blocks=2, num_global_blocks=1)
    assert torch.equal(fixed.make_layout(80)[0], rows("11011", "11011", "01111", "01111", "01011"))
    fixed_uni = FixedSparsityConfig(1, block=16, num_local_blocks=2, attention="unidirectional")
    assert torch.equal(fixed_uni.make_layout(80)[0], rows("10000", "11000", "01100", "01110", "01011"))
    horizontal = FixedSparsityConfig(1, block=16, num_local_blocks=2, horizontal_global_attention=True)
    assert torch.equal(horizontal.make_layout(64)[0], rows("1101", "1111", "0111", "1111"))
    patterns = FixedSparsityConfig(2, block=16, different_layout_per_head=True, num_local_blocks=2,
                                   num_different_global_patterns=2).make_layout(64)
    assert torch.equal(patterns[0], rows("1101", "1101", "0111", "0111"))  # head 0: last block of each window
    assert torch.equal(patterns[1], rows("1110", "1110", "1011", "1011"))  # head 1: the one before
    # Variable: windows of 1, 2, then 2 again; block 3 global.
    variable = VariableSparsityConfig(2, block=16, local_window_blocks=[1, 2], global_block_indices=[3])
    expected = rows("100100", "011100", "011100", "000110", "000110", "000101")
    assert torch.equal(variable.make_layout(96), expected.expand(2, 6, 6))
    ranges = VariableSparsityConfig(1, block=16, local_window_blocks=[2], global_block_indices=[0, 4],
                                    global_block_end_indices=[1, 6], horizontal_global_attention=True)
    assert torch.equal(ranges.make_layout(96)[0], rows("111111", "110011", "101111", "101111", "111111", "111111"))
    # BigBird: window of 3, block 0 global both ways; unidirectional keeps the lower triangle.
    bigbird = BigBirdSparsityConfig(1, block=16, num_random_blocks=0)
    assert torch.equal(bigbird.make_layout(80)[0], rows("11111", "11100", "11110", "10111", "10011"))
    bigbird_uni = BigBirdSparsityConfig(1, block=16, num_random_blocks=0, attention="unidirectional")
    assert torch.equal(bigbird_uni.make_layout(80)[0], rows("10000", "11000", "11100", "10110", "10011"))
    # BSLongformer: window of 3, block 2 global both ways.
    longformer = BSLongformerSparsityConfig(1, block=16, global_block_indices=[2])
    assert torch.equal(longformer.make_layout(80)[0], rows("11100", "11100", "11111", "00111", "00111"))
    # LocalSlidingWindow: unidirectional by default.
    assert torch.equal(LocalSlidingWindowSparsityConfig(1, block=16).make_layout(64)[0],
                       rows("1000", "1100", "0110", "0011"))
    assert torch.equal(LocalSlidingWindowSparsityConfig(1, block=16, num_sliding_window_blocks=5,
                                                        attention="bidirectional").make_layout(80)[0],
                       rows("11100", "11110", "11111", "01111", "00111"))
    assert torch.equal(DenseSparsityConfig(2, block=16).make_layout(48), torch.ones(2, 3, 3, dtype=torch.int64))
    # random blocks: num_random_blocks per row, reproducible from the seed, per head when asked
    for make in (lambda s, per: VariableSparsityConfig(2, block=16, different_layout_per_head=per, num_random_blocks=2,
                                                       local_window_blocks=[1], global_block_indices=[], seed=s),
                 lambda s, per: BigBirdSparsityConfig(2, block=16, different_layout_per_head=per, num_random_blocks=2,
                                                      num_sliding_window_blocks=1, num_global_blocks=0, seed=s)):
        layout = make(0, True).make_layout(16 * 12)
        off_diagonal = layout.sum(-1) - 1  # the window is the diagonal
        assert ((off_diagonal >= 1) & (off_diagonal <= 2)).all()
        assert torch.equal(layout, make(0, True).make_layout(16 * 12)) and not torch.equal(layout[0], layout[1])
        assert not torch.equal(layout, make(1, True).make_layout(16 * 12))
        assert torch.equal(make(0, False).make_layout(16 * 12)[1], make(0, False).make_layout(16 * 12)[0])
    # what SparseSelfAttention keeps: the same layout as bool, one head when the heads share it
    for config, block, _, seq, _ in CASES:
        n = -(-seq // block) * block
        compact = config.compact_layout(n)
        assert compact.dtype == torch.bool and compact.shape[0] == (2 if config.different_layout_per_head else 1)
        assert torch.equal(compact.expand(2, -1, -1).long(), config.make_layout(n)), config
    causal_random = BigBirdSparsityConfig(1, block=16, num_random_blocks=3, attention="unidirectional").make_layout(160)
    assert torch.equal(causal_random, causal_random.tril())


def test_bad_configs_layouts_and_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="num_local_blocks .* multiple of num_global_blocks"):
        FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match="horizontal_global_attention needs attention='bidirectional'"):
        FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True)
    with pytest.raises(ValueError, match="different_layout_per_head=True"):
        FixedSparsityConfig(2, num_different_global_patterns=2)
    with pytest.raises(NotImplementedError, match="attention must be"):
        BigBirdSparsityConfig(2, attention="causal")
    with pytest.raises(ValueError, match="global_block_end_indices has 1 entries"):
        VariableSparsityConfig(2, global_block_indices=[0, 3], global_block_end_indices=[2])
    with pytest.raises(ValueError, match="start index 3 must be smaller than its end index 3"):
        BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3])
    with pytest.raises(ValueError, match="seq_len 40 is not a multiple of the block size 16"):
        DenseSparsityConfig(2).make_layout(40)
    with pytest.raises(ValueError, match="num_random_blocks \\(4\\) is larger than the 2 blocks"):
        BigBirdSparsityConfig(2, num_random_blocks=4).make_layout(32)
    # layouts
    with pytest.raises(ValueError, match="layout must be a \\(heads, blocks, blocks\\) tensor, got \\(4, 4\\)"):
        BlockSparseIndex.from_layout(torch.ones(4, 4), 16, False)
    with pytest.raises(ValueError, match="got \\(1, 4, 3\\)"):
        BlockSparseIndex.from_layout(torch.ones(1, 4, 3, dtype=torch.long), 16, False)
    with pytest.raises(ValueError, match="only 0 and 1"):
        BlockSparseIndex.from_layout(torch.full((1, 2, 2), 2), 16, False)
    upper = torch.ones(2, 3, 3, dtype=torch.long).triu()
    upper[1, 2] = 0
    upper[1, 2, 0] = 1
    upper[0, 1, 1] = 0
    with pytest.raises(ValueError, match="layout head 0, block row 1 has no block \\(blocks above the diagonal"):
        BlockSparseIndex.from_layout(upper, 16, causal=True)
    with pytest.raises(ValueError, match="layout head 1, block row 2 has no block: its queries"):
        BlockSparseIndex.from_layout(torch.ones(2, 3, 3, dtype=torch.long).index_put_(
            (torch.tensor([1]), torch.tensor([2])), torch.tensor(0)), 16, causal=False)
    with pytest.raises(ValueError, match="block must be one of \\(16, 32, 64, 128\\), got 24"):
        BlockSparseIndex.from_layout(torch.ones(1, 2, 2, dtype=torch.long), 24, False)
    with pytest.raises(ValueError, match="sparsity_config.block must be one of"):
        SparseSelfAttention(DenseSparsityConfig(2, block=8))
    # a hand-made index is checked before a kernel indexes with it
    import dataclasses

    good = BlockSparseIndex.from_layout(torch.ones(1, 3, 3, dtype=torch.long), 16, False)
    for change, says in ((dict(col_idx=torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 7], dtype=torch.int32)), "col_idx must hold"),
                         (dict(row_ptr=torch.tensor([[0, 5, 3, 9]], dtype=torch.int32)), "row_ptr must rise"),
                         (dict(row_idx=good.row_idx.long()), "must be int32"),
                         (dict(num_blocks=4), "num_blocks \\+ 1 = 5"),
                         (dict(heads=0), "heads must be")):
        with pytest.raises(ValueError, match=f"BlockSparseIndex: .*{says}"):
            dataclasses.replace(good, **change)
    # random blocks are drawn once, for max_seq_length: a longer sequence would draw others
    attention = SparseSelfAttention(BigBirdSparsityConfig(2, block=16), max_seq_length=60)
    q64 = torch.randn(1, 2, 64, 32)
    attention(q64, q64, q64)  # 60 tokens are 4 blocks of 16: 64 fits
    with pytest.raises(ValueError, match="a sequence of 80 tokens is longer than max_seq_length \\(60\\)"):
        attention(*(torch.randn(1, 2, 80, 32),) * 3)
    longer = SparseSelfAttention(FixedSparsityConfig(2, block=16), max_seq_length=64)  # no random blocks: remade
    assert longer(*(torch.randn(1, 2, 80, 32),) * 3).shape == (1, 2, 80, 32)
    q = torch.randn(1, 2, 100, 32)
    with pytest.raises(ValueError, match="the layout has 3 blocks of 16 but the sequence has 100 tokens; it needs .* 7"):
        sparse_attention(q, q, q, torch.ones(1, 3, 3, dtype=torch.long), block=16)
    from zero.ops import sparse_attention as ops

    index = BlockSparseIndex.from_layout(torch.ones(1, 7, 7, dtype=torch.long), 16, False)
    with pytest.raises(ValueError, match="q has 100 positions but the layout covers 7 blocks of 16 = 112; pad"):
        ops.forward(q, q, q, index, scale=1.0)
    # inputs
    layout = torch.ones(1, 7, 7, dtype=torch.long)
    with pytest.raises(ValueError, match="q, k and v must have one shape"):
        sparse_attention(q, q, q[:, :, :, :16].contiguous(), layout, block=16)
    with pytest.raises(ValueError, match="must be float32 or bfloat16 or float16 on cpu, got torch.float64"):
        sparse_attention(q.double(), q.double(), q.double(), layout, block=16)
    with pytest.raises(ValueError, match="q, k and v must have one dtype"):
        sparse_attention(q, q, q.bfloat16(), layout, block=16)
    with pytest.raises(ValueError, match="head_dim \\(q.shape\\[3\\]\\) must be between 1 and 128, got 160"):
        sparse_attention(*(torch.randn(1, 2, 100, 160),) * 3, layout, block=16)
    with pytest.raises(ValueError, match="the layout has 3 heads but q has 2"):
        sparse_attention(q, q, q, torch.ones(3, 7, 7, dtype=torch.long), block=16)
    attention = SparseSelfAttention(DenseSparsityConfig(2))
    with pytest.raises(ValueError, match="query has 4 heads but sparsity_config.num_heads is 2"):
        attention(*(torch.randn(1, 4, 32, 8),) * 3)
    with pytest.raises(ValueError, match="key_padding_mask must be a \\(1, 100\\) tensor"):
        attention(q, q, q, key_padding_mask=torch.zeros(1, 99))
    with pytest.raises(ValueError, match="its mode is 'add'"):
        attention(q, q, q, key_padding_mask=torch.ones(1, 100, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="rpe"):
        attention(q, q, q, rpe=torch.zeros(1))


def test_swapped_models_equal_dense_attention_with_a_dense_layout():
    """The model swap keeps weights and plumbing: with a Dense layout the swapped GPT (causal) and
    HF GPT-2 / BERT (with a padding mask) compute what they computed before, gradients included."""
    torch.manual_seed(3)
    gpt = GPT(GPTConfig(vocab_size=50, block_size=70, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 50, (2, 70))
    before = gpt(idx, idx)
    before.backward()
    grads = [p.grad.clone() for p in gpt.parameters()]
    keys = list(gpt.state_dict())
    gpt.zero_grad()
    replace_self_attention(gpt, DenseSparsityConfig(2, block=16))
    assert list(gpt.state_dict()) == keys and type(gpt.blocks[0].attend).__name__ == "SparseSelfAttention"
    after = gpt(idx, idx)
    after.backward()
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, gpt.parameters()):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)

    transformers = pytest.importorskip("transformers")
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 33:] = 0
    ids = torch.randint(0, 100, (2, 40))
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=1,
                                                          n_head=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64,
                                                          attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0))
    for model in (gpt2, bert):
        model.eval()
        with torch.no_grad():
            dense = model(input_ids=ids, attention_mask=mask).last_hidden_state
            replace_self_attention(model, DenseSparsityConfig(2, block=16))
            sparse = model(input_ids=ids, attention_mask=mask).last_hidden_state
        real = mask.bool()
        torch.testing.assert_close(sparse[real], dense[real], atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # and a sparse layout really changes the result
            replace_self_attention(model, LocalSlidingWindowSparsityConfig(2, block=16, attention="bidirectional",
                                                                           num_sliding_window_blocks=1))
            assert (model(input_ids=ids, attention_mask=mask).last_hidden_state[real] - dense[real]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="has 2 attention heads but sparsity_config.num_heads is 4"):
        replace_self_attention(GPT(GPTConfig(n_head=2)), DenseSparsityConfig(4))
    with pytest.raises(ValueError, match="no supported self-attention found in Linear"):
        replace_self_attention(torch.nn.Linear(2, 2), DenseSparsityConfig(4))


def _demo_text() -> str:
    """A fixed training text (not the repository's docs, which change): seeded sentences over a small
    vocabulary, so spelling and word order are there to learn."""
    g = torch.Generator().manual_seed(11)
    words = ("the block row attends to its local window and the global blocks while the random "
             "blocks reach far keys so every query sees the start of the sequence").split()
    out = []
    while sum(map(len, out)) < 40_000:
        n = int(torch.randint(4, 12, (1,), generator=g))
        start = int(torch.randint(0, len(words) - n, (1,), generator=g))
        out.append(" ".join(words[start : start + n]).capitalize() + ". ")
    return "".join(out)


SPARSE_GPT = dict(num_heads=2, block=16, num_local_blocks=4, attention="unidirectional")


class MaskedDenseAttention(torch.nn.Module):
    """Dense causal SDPA with a sparsity layout expanded to an element mask: the same maths as the
    block-sparse kernel, computed the dense way."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, q, k, v):
        seq, block = q.shape[2], self.config.block
        layout = self.config.make_layout(-(-seq // block) * block)
        allowed = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :seq, :seq]
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None])


def train_gpt_stage2(attention: str, steps: int) -> list[float]:
    """One rank's losses: a small GPT on the demo text under ZeRO stage 2, each rank drawing its own
    windows, with `attention` "sparse" (causal Fixed layout, ~1/3 of the blocks, our kernel),
    "masked" (the same layout as an element mask on dense SDPA) or "dense" (causal SDPA)."""
    import torch.distributed as dist

    import zero
    from zero.testing.models import CharDataset

    data = CharDataset(_demo_text(), block_size=128)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=64))
    if attention == "sparse":
        replace_self_attention(model, FixedSparsityConfig(**SPARSE_GPT))
    if attention == "masked":
        for block in model.blocks:
            block.attend = MaskedDenseAttention(FixedSparsityConfig(**SPARSE_GPT))
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 2}})
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # dQ sums per-thread buffers: one thread makes the curve independent of load
    try:
        for _ in range(steps):
            x, y = zip(*(data[i] for i in torch.randint(0, len(data), (8,), generator=g).tolist()))
            loss = engine(torch.stack(x), torch.stack(y))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return losses


def test_gpt_with_sparse_attention_trains_under_zero_stage2_like_dense(dist_run):
    """2 ranks, ZeRO stage 2, 60 steps on the demo text: the sparse GPT's loss curve is the curve of
    dense attention masked to the same layout (within 2e-3 at every step: the same model trained
    the same way, only the kernel differs), it falls, and it is not the unmasked dense curve (the
    layout really changes the model)."""
    load("sparse_attention")  # built here once, not by both ranks
    steps = 60
    curves = {}
    for attention in ("sparse", "masked", "dense"):
        runs = dist_run(2, train_gpt_stage2, attention, steps)
        curves[attention] = [sum(r[i] for r in runs) / len(runs) for i in range(steps)]  # mean over ranks
    sparse, masked, dense = curves["sparse"], curves["masked"], curves["dense"]
    gap = max(abs(a - b) for a, b in zip(sparse, masked))
    print(f"sparse vs masked dense: {gap:.2e}; vs dense: {max(abs(a - b) for a, b in zip(sparse, dense)):.2e}")
    assert gap < 2e-3, list(zip(sparse, masked))
    assert sum(sparse[-10:]) / 10 < 0.8 * sparse[0], sparse
    assert max(abs(a - b) for a, b in zip(sparse, dense)) > 1e-2, "the layout did not change the model"


@needs_cuda
def test_cuda_kernel_matches_dense_sdpa_like_the_cpu_kernel():
    """fp32: 1e-5 from fp64 SDPA; bf16 and fp16: within twice the CPU kernel's error, plus 1e-3."""
    g = torch.Generator().manual_seed(4)
    for config, block, head_dim, seq, causal in CASES:
        layout = config.make_layout(-(-seq // block) * block)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            q, k, v = (torch.randn(2, 2, seq, head_dim, generator=g).to(dtype) for _ in range(3))
            key_bias = _key_padding(2, seq)
            cpu, ref = sparse_and_dense(q, k, v, layout, block, causal, key_bias=key_bias)
            gpu = run_sparse(q.cuda(), k.cuda(), v.cuda(), layout, block, causal, key_bias=key_bias.cuda())
            for name, a, c, r in zip(("out", "dq", "dk", "dv"), gpu, cpu, ref):
                assert a.device.type == "cuda" and a.dtype == dtype, (name, a.device, a.dtype)
                err = (a.cpu().double() - r).abs().max().item()
                bound = 1e-5 * (1 + r.abs().max().item()) if dtype == torch.float32 else \
                    2 * (c.double() - r).abs().max().item() + 1e-3
                assert err <= bound, (config, dtype, name, err, bound)


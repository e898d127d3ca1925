"""sequence_tiled_compute (DeepSpeed's `ulysses_sp.sequence_tiled_compute`): any function of
sequence-shaped tensors, computed one sequence tile at a time and recomputed in backward, equals the
untiled function, forward and backward, and holds less at a long sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


class _Block(torch.nn.Module):
    def __init__(self, d=16, hidden=64, vocab=97):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)


def _mlp(self, hidden_states, scale, shift):
    """MLP-like: the 4x-wide activations of every position; `scale` is per position (sharded),
    `shift` is one tensor for all positions (passed whole)."""
    return self.down(F.gelu(self.up(hidden_states))) * scale + shift


def _loss(self, hidden_states, labels, reduction="mean"):
    """Loss-reducing: the sequence x vocabulary logits, reduced to a scalar."""
    return F.cross_entropy(self.lm_head(hidden_states).flatten(0, 1), labels.flatten(), reduction=reduction)


def test_sequence_tiled_compute_equals_the_untiled_function_with_uneven_tiles_and_holds_less():
    from zero.deepspeed.runtime.sequence_parallel import ulysses_sp
    from zero.probes import AllocatorPeak
    from zero.sequence import SequenceTiledCompute, sequence_tiled_compute

    assert ulysses_sp.sequence_tiled_compute is sequence_tiled_compute
    assert ulysses_sp.SequenceTiledCompute is SequenceTiledCompute
    block = _Block()
    params = list(block.parameters())
    fires = {p: 0 for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fires.__setitem__(p, fires[p] + 1))
    g = torch.Generator().manual_seed(1)
    seqlen = 37  # 4 and 5 tiles of unequal lengths
    x = torch.randn(2, seqlen, 16, generator=g)
    scale = torch.rand(2, seqlen, 1, generator=g)
    shift = torch.randn(16, generator=g)
    labels = torch.randint(0, 97, (2, seqlen), generator=g)

    def run(mode: str, reduction: str = "mean"):
        """Forward and every gradient: the inputs', `shift`'s (passed whole) and the parameters'."""
        xi, si = x.clone().requires_grad_(), shift.clone().requires_grad_()
        for p in params:
            p.grad = None
        fires.update(dict.fromkeys(params, 0))
        if mode == "untiled":
            h = _mlp(block, xi, scale, si)
            loss = _loss(block, h, labels, reduction)
        else:
            listed = params if mode == "listed" else None
            h = sequence_tiled_compute(_mlp, seqlen, 4, dict(hidden_states=xi, scale=scale), dict(self=block, shift=si),
                                       "hidden_states", listed, output_reduction=None)
            loss = sequence_tiled_compute(_loss, seqlen, 5, dict(hidden_states=h, labels=labels),
                                          dict(self=block, reduction=reduction), "hidden_states", listed,
                                          output_unshard_dimension=0, output_reduction=reduction)
        assert h.shape == x.shape and loss.dim() == 0
        loss.backward()
        return [h.detach(), loss.detach(), xi.grad, si.grad, *(p.grad.clone() for p in params)], dict(fires)

    for reduction in ("mean", "sum"):
        want, _ = run("untiled", reduction)
        for mode in ("listed", "unlisted"):
            got, fired = run(mode, reduction)
            for name, a, b in zip(["output", "loss", "x.grad", "shift.grad", *(n for n, _ in block.named_parameters())],
                                  want, got):  # within 1e-6 of the tensor's scale ("sum": 74 positions' gradients)
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * max(1.0, a.abs().max().item()),
                                           msg=lambda m, at=f"{mode} {reduction} {name}": f"{at}: {m}")
            if mode == "listed":  # summed over the tiles, each parameter's gradient arrives once (ZeRO 2/3)
                assert set(fired.values()) == {1}, fired
            else:  # DeepSpeed's default, compute_params=None: accumulated tile by tile
                assert fired[block.up.weight] == 4 and fired[block.lm_head.weight] == 5, fired

    # a tensor output stacked per tile (dimension 0) and the mean of a concatenated output
    xi = x.clone().requires_grad_()
    per_tile = sequence_tiled_compute(lambda hidden_states: hidden_states.sum(), seqlen, 3,
                                      dict(hidden_states=xi), {}, "hidden_states", None, 0, None)
    torch.testing.assert_close(per_tile, torch.stack([t.sum() for t in torch.tensor_split(x, 3, dim=1)]))
    mean = sequence_tiled_compute(lambda hidden_states: hidden_states * 2, seqlen, 6, dict(hidden_states=xi), {},
                                  "hidden_states", None, 1, "mean")
    torch.testing.assert_close(mean, (x * 2).mean(), rtol=1e-6, atol=1e-6)
    mean.backward()
    torch.testing.assert_close(xi.grad, torch.full_like(x, 2 / x.numel()))

    # bad input: each error names the argument at fault
    kw = dict(hidden_states=x, scale=scale)
    passed = dict(self=block, shift=shift)
    for args, error, message in [
        ((seqlen, 0, kw, passed, "hidden_states"), ValueError, "shards must be an int >= 1, got 0"),
        ((seqlen, 2, kw, passed, "hidden"), ValueError, "grad_requiring_tensor_key 'hidden' is missing from "
                                                          "kwargs_to_shard"),
        ((seqlen, 2, dict(scale=scale), dict(passed, hidden_states=x), "hidden_states"), ValueError,
         "grad_requiring_tensor_key 'hidden_states' is in kwargs_to_pass"),
        ((seqlen, 2, dict(kw, shift=[0.0]), dict(self=block), "hidden_states"), TypeError,
         r"kwargs_to_shard\['shift'\] is a list, not a tensor"),
        ((seqlen + 1, 2, kw, passed, "hidden_states"), ValueError,
         r"kwargs_to_shard\['hidden_states'\] has shape \(2, 37, 16\): its dimension 1 \(the sequence\) must have "
         "seqlen=38"),
        ((seqlen, 2, kw, dict(passed, scale=scale), "hidden_states"), ValueError,
         r"key\(s\) \['scale'\] are in both kwargs_to_shard and kwargs_to_pass"),
    ]:
        with pytest.raises(error, match=message):
            sequence_tiled_compute(_mlp, *args, output_reduction=None)
    with pytest.raises(ValueError, match="output_reduction must be None, 'mean' or 'sum', got 'max'"):
        sequence_tiled_compute(_mlp, seqlen, 2, kw, passed, "hidden_states", output_reduction="max")
    with pytest.raises(TypeError, match=r"compute_params\[0\] is a str"):
        sequence_tiled_compute(_mlp, seqlen, 2, kw, passed, "hidden_states", ["up"])
    with pytest.raises(ValueError, match="fn returns a scalar per tile"):
        sequence_tiled_compute(_loss, seqlen, 2, dict(hidden_states=x, labels=labels), dict(self=block),
                               "hidden_states", params)

    # at a long sequence the tiles hold one tile's wide activations and logits, not the whole sequence's
    n = 4096
    long_x, long_scale, long_labels = torch.randn(1, n, 16), torch.rand(1, n, 1), torch.randint(0, 97, (1, n))
    peaks = {}
    for tiled in (False, True):
        xi = long_x.clone().requires_grad_()
        with AllocatorPeak() as peak:
            if tiled:
                h = sequence_tiled_compute(_mlp, n, 16, dict(hidden_states=xi, scale=long_scale),
                                           dict(self=block, shift=shift), "hidden_states", params, 1, None)
                loss = sequence_tiled_compute(_loss, n, 16, dict(hidden_states=h, labels=long_labels),
                                              dict(self=block), "hidden_states", params, 0, "mean")
            else:
                loss = _loss(block, _mlp(block, xi, long_scale, shift), long_labels)
            loss.backward()
        peaks[tiled] = peak.peak
    assert peaks[True] < 0.5 * peaks[False], peaks

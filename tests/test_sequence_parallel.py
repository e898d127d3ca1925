"""Long sequences (zero.sequence): Ulysses attention over sequence slices equals attention over the
whole sequence in one process; GPT and HF Llama training under sequence parallelism (2 and 4 ranks,
ZeRO 1-3 and offload, 2 data-parallel groups, padding and ignored labels, the ALST loss recipe)
equals one process on whole sequences; tiled MLP and logits-loss equal the untiled ones and hold
less; the exchange is counted and bounded, bad input is named, checkpoints resume without it."""
from __future__ import annotations

import copy

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


@pytest.mark.parametrize("world,heads,kv_heads,layout", [(2, 4, 4, "bshd"), (2, 4, 1, "bshd"), (2, 4, 2, "sbhd"),
                                                         (4, 8, 2, "bshd")])
def test_ulysses_attention_equals_attention_over_the_whole_sequence(dist_run, world, heads, kv_heads, layout):
    for errors in dist_run(world, _ulysses_matches_whole_sequence, heads, kv_heads, layout):
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


# ------------------------------------------------------------------------------------ tiled compute

class _MLP(torch.nn.Module):
    def __init__(self, d=16, hidden=64):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def plain(self, x):
        return self.down(F.gelu(self.up(x)))


class _Head(torch.nn.Module):
    def __init__(self, d=16, vocab=97):
        super().__init__()
        torch.manual_seed(1)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def loss(self, x, y, mask=None):
        return F.cross_entropy(self.lm_head(x).flatten(0, 1).float(), y.flatten())


def _mlp_and_loss(mlp: _MLP, head: _Head, x: torch.Tensor, y: torch.Tensor, shards: tuple[int, int] | None):
    """The head's mean loss on the MLP's output: plain (shards None) or in (MLP, loss) tiles."""
    from zero.deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    if shards is None:
        return head.loss(mlp.plain(x), y)
    h = TiledMLP.apply(_MLP.plain, mlp, x, shards[0], list(mlp.parameters()))
    return TiledFusedLogitsLoss.apply(_Head.loss, head, h, y, None, shards[1], list(head.parameters()), "mean")


def test_tiled_mlp_and_tiled_logits_loss_equal_the_untiled_ones_and_hold_less():
    from zero.deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    from zero.probes import AllocatorPeak

    mlp, head = _MLP(), _Head()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 37, 16, generator=g)  # 37: tiles of unequal length
    y = torch.randint(0, 97, (2, 37), generator=g)
    runs = {}
    for tiled in (False, True):
        xi = x.clone().requires_grad_()
        for p in [*mlp.parameters(), *head.parameters()]:
            p.grad = None
        loss = _mlp_and_loss(mlp, head, xi, y, (4, 5) if tiled else None)
        loss.backward()
        runs[tiled] = [loss.detach(), xi.grad, *(p.grad.clone() for p in [*mlp.parameters(), *head.parameters()])]
    for a, b in zip(runs[False], runs[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # DeepSpeed's call without a mask, fn(self, x, y); "mean" over the valid labels, ignored ones
    # uneven across the tiles and one tile without any: the untiled mean, and finite
    ignored = y.clone()
    ignored[0, :20] = -100
    ignored[:, 30:] = -100  # tile 5 (positions 30-36) has no valid label
    ignored[1, ::3] = -100
    three = lambda self, x, y: F.cross_entropy(self.lm_head(x).flatten(0, 1).float(), y.flatten())  # noqa: E731
    grads = {}
    for tiled in (False, True):
        xi = x.clone().requires_grad_()
        loss = (TiledFusedLogitsLoss.apply(three, head, xi, ignored, None, 5, list(head.parameters()), "mean")
                if tiled else three(head, xi, ignored))
        assert torch.isfinite(loss)
        head.lm_head.weight.grad = None
        loss.backward()
        grads[tiled] = (loss.detach(), xi.grad, head.lm_head.weight.grad.clone())
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # at a long sequence the tiled MLP and loss hold a tile's intermediates, not the whole sequence's
    long_x, long_y = torch.randn(1, 4096, 16), torch.randint(0, 97, (1, 4096))
    peaks = {}
    for tiled in (False, True):
        xi = long_x.clone().requires_grad_()
        with AllocatorPeak() as peak:
            _mlp_and_loss(mlp, head, xi, long_y, (16, 16) if tiled else None).backward()
        peaks[tiled] = peak.peak
    assert peaks[True] < 0.5 * peaks[False], peaks


def test_tiles_take_a_sensible_count_and_reduction():
    from zero.sequence import TiledFusedLogitsLoss, TiledMLP

    mlp, head = _MLP(), _Head()
    x = torch.randn(1, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="shards must be an int >= 1"):
        TiledMLP.apply(_MLP.plain, mlp, x, 0, list(mlp.parameters()))
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum'"):
        TiledFusedLogitsLoss.apply(_Head.loss, head, x, torch.zeros(1, 8, dtype=torch.long), None, 2,
                                   list(head.parameters()), "max")


class _TiledNet(torch.nn.Module):
    def __init__(self, tiled: bool):
        super().__init__()
        torch.manual_seed(0)
        self.tiled = tiled
        self.inp, self.mlp, self.head = torch.nn.Linear(8, 16), _MLP(), _Head()

    def forward(self, x, y):
        from zero.sequence import TiledFusedLogitsLoss, TiledMLP

        h = self.inp(x)
        if not self.tiled:
            return self.head.loss(h + self.mlp.plain(h), y)
        h = h + TiledMLP.apply(_MLP.plain, self.mlp, h, 3, list(self.mlp.parameters()))
        return TiledFusedLogitsLoss.apply(_Head.loss, self.head, h, y, None, 4, list(self.head.parameters()), "mean")


def _tiled_under_zero(stage: int):
    import torch.distributed as dist

    import zero

    rank, out = dist.get_rank(), []
    for tiled in (False, True):
        engine, *_ = zero.initialize(model=_TiledNet(tiled), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(2, 24, 8, generator=g), torch.randint(0, 97, (2, 24), generator=g)
            engine.backward(engine(x, y))
            engine.step()
        ctx = zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 else torch.no_grad()
        with ctx:
            out.append(torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()]))
        engine.destroy()
    return ((out[0] - out[1]).abs().max() / out[0].abs().max()).item()


@pytest.mark.parametrize("stage", [2, 3])
def test_tiled_compute_trains_like_untiled_under_zero(dist_run, stage):
    for error in dist_run(2, _tiled_under_zero, stage):
        assert error < 1e-5, error


# ------------------------------------------------------------------------------------ the engine

def _max_error(engine, reference, stage: int) -> float:
    """The largest difference between the engine's and the reference's parameters, relative to
    each reference parameter's largest element."""
    import zero

    ctx = zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 else torch.no_grad()
    with ctx:
        return max(((p.detach() - q.detach()).abs().max() / q.detach().abs().max()).item()
                   for p, q in zip(engine.module.parameters(), reference.parameters()))


def _gpt_with_sequence_parallelism(stage: int, offload: bool):
    import torch.distributed as dist

    import zero
    from zero.models import GPT, GPTConfig
    from zero.sequence import ulysses_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": world,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zero.initialize(model=model, config=config)
    ulysses_attention(engine.module, engine.seq_parallel_group)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)  # every rank the same samples: one data-parallel replica
    s = 16
    part = slice(rank * s // world, (rank + 1) * s // world)
    for _ in range(3):
        idx, targets = torch.randint(0, 64, (2, s), generator=g), torch.randint(0, 64, (2, s), generator=g)
        loss = engine(idx[:, part], targets[:, part], position_ids=torch.arange(s)[part])
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        reference(idx, targets).backward()
        opt.step()
    # the comm report counts the exchange: q, k, v and the context, forward and backward, per layer
    exchanged = engine.comm_report()["all_to_all (sequence)"]
    assert exchanged["calls"] == 8 * cfg.n_layer, exchanged
    assert exchanged["elements"] == 8 * cfg.n_layer * 2 * (s // world) * cfg.n_embd, exchanged
    assert engine.seq_parallel_group is engine.parallel.group("sp") is not None
    return _max_error(engine, reference, stage)


@pytest.mark.parametrize("world,stage,offload", [(2, 1, False), (2, 2, False), (2, 3, False), (2, 3, True),
                                                 (4, 3, False)])
def test_sequence_parallel_gpt_trains_like_the_whole_sequence_in_one_process(dist_run, world, stage, offload):
    for error in dist_run(world, _gpt_with_sequence_parallelism, stage, offload):
        assert error < 1e-5, error


def _alst_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """DeepSpeed's ALST recipe: each rank's mean loss, all-gathered differentiably over the group
    and weighted by the ranks' valid tokens (the whole sequence's mean on every rank)."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_f

    good = (shift_labels != -100).sum()
    mean = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), shift_labels.reshape(-1), ignore_index=-100,
                           reduction="sum") / good.clamp(min=1)
    losses = dist_f.all_gather(mean, group=group)
    goods = [torch.zeros_like(good) for _ in losses]
    dist.all_gather(goods, good, group=group)
    return sum(loss * g for loss, g in zip(losses, goods)) / max(1, int(sum(goods)))


def _uneven_slices_and_ignored_labels(stage: int, sp: int, alst: bool = False):
    """Each rank's loader its own batches (a sampler over every rank, as DeepSpeed scripts have it);
    the adapter trains each sequence-parallel group's batches one after the other, and with
    world / sp data-parallel groups each step averages their batches."""
    import torch.distributed as dist

    import zero
    from zero.models import GPT, GPTConfig
    from zero.sequence import UlyssesSPDataLoaderAdapter, sequence_loss, ulysses_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(cfg), config={
        "train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": sp,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    ulysses_attention(engine.module, engine.seq_parallel_group)
    # eps 1e-6: see [Note: conditioning of the comparison] in zero/testing/training.py (with 1e-8 the
    # summation order alone moves the 4-rank runs by ~1.1e-5 on some CPUs)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2 * world):  # 15 tokens: the last slice is padded; a third of the labels ignored, unevenly
        ids = torch.randint(0, 64, (2, 15), generator=g)
        labels = ids.clone()
        labels[torch.rand(2, 15, generator=g) < 0.33] = -100
        labels[0, :9] = -100  # one slice with far fewer valid tokens than the other
        batches.append({"input_ids": ids, "labels": labels})
    adapter = UlyssesSPDataLoaderAdapter(batches[rank::world], rank % sp, engine.seq_parallel_group, sp)
    assert len(adapter) == 2 * sp
    losses, norms = [], []
    for batch in adapter:
        logits = engine(batch["input_ids"], position_ids=batch["position_ids"][0])
        if alst:  # every rank holds the whole sequence's mean (the average over the ranks is the same)
            loss = _alst_loss(logits, batch["shift_labels"], engine.seq_parallel_group)
        else:
            loss = sequence_loss(logits, batch["shift_labels"], engine.seq_parallel_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        norms.append(engine.get_global_grad_norm())
    for j in range(2 * sp):  # step j: group k trains rank (k sp + j % sp)'s (j // sp)-th batch
        opt.zero_grad()
        total = 0.0
        for k in range(world // sp):
            batch = batches[(j // sp) * world + k * sp + j % sp]
            logits = reference(batch["input_ids"])
            shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
            total = total + torch.nn.functional.cross_entropy(logits.reshape(-1, 64), shift.reshape(-1)) / (world // sp)
        total.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
        assert abs(norms[j] - norm.item()) <= 1e-5 * norm.item(), (j, norms[j], norm.item())
        whole = losses[j].clone()  # the ranks' shares, averaged over all of them: the step's loss
        dist.all_reduce(whole)
        assert abs(whole.item() / world - total.item()) <= 1e-5 * total.item(), (j, whole.item() / world, total.item())
        opt.step()
    return _max_error(engine, reference, stage)


# the ALST recipe on 2 ranks only: torch.distributed.nn's all_gather backward fails on gloo subgroups
# (its scatter takes a group rank for a global one)
@pytest.mark.parametrize("world,sp,stage,alst", [(2, 2, 2, False), (2, 2, 3, False), (4, 2, 1, False), (4, 2, 3, False),
                                                (2, 2, 1, True), (2, 2, 3, True)])
def test_uneven_slices_and_ignored_labels_average_over_the_whole_sequence(dist_run, world, sp, stage, alst):
    """Loss, gradient norm and parameters of every step equal one process on the same batches, also
    with 2 data-parallel groups of 2 sequence-parallel ranks, with sequence_loss or DeepSpeed's ALST
    loss recipe."""
    for error in dist_run(world, _uneven_slices_and_ignored_labels, stage, sp, alst):
        assert error < 1e-5, error


def _hf_llama_with_ulysses(stage: int, kv_heads: int = 2, offload: bool = False):
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero
    from zero.deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zero.sequence import sequence_loss

    world = dist.get_world_size()
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    reference = LlamaForCausalLM(copy.deepcopy(cfg))  # its own config: the attention implementation is per config
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 2)
    # eps 1e-6: Adam turns round-off in near-zero gradient elements into lr-sized steps (see [Note:
    # conditioning of the comparison] in zero/testing/training.py); 1e-6 damps them
    engine, *_ = zero.initialize(model=model, mpu=mpu, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              **({"offload_optimizer": {"device": "cpu"}} if offload else {})}})
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 13), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        batches.append({"input_ids": ids, "labels": labels})
    group = mpu.get_sequence_parallel_group()  # each rank loads its own batches; the group trains them in turn
    rank = dist.get_rank()
    for batch in UlyssesSPDataLoaderAdapter(batches[rank::world], mpu.get_sequence_parallel_rank(), group, world):
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        engine.backward(sequence_loss(logits, batch["shift_labels"], group))
        engine.step()
    for batch in batches:
        opt.zero_grad()
        logits = reference(input_ids=batch["input_ids"]).logits
        shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), shift.reshape(-1)).backward()
        opt.step()
    return _max_error(engine, reference, stage)


@pytest.mark.parametrize("world,stage,kv_heads,offload", [(2, 3, 2, False), (2, 2, 1, False), (2, 1, 2, True),
                                                         (4, 3, 2, True)])
def test_hf_llama_with_ulysses_trains_like_the_whole_sequence(dist_run, world, stage, kv_heads, offload):
    """register_with_transformers + initialize(mpu=) + the loader adapter + sequence_loss; key/value
    heads fewer than the group are repeated up to it (1 over 2 ranks, 2 over 4)."""
    pytest.importorskip("transformers")
    for error in dist_run(world, _hf_llama_with_ulysses, stage, kv_heads, offload):
        assert error < 1e-5, error


def _a_rank_skips_the_exchange():
    """Rank 1 of a sequence-parallel pair never reaches its attention (rank-divergent code)."""
    import time

    import torch.distributed as dist

    from zero.parallel.comm import CollectiveTimeout
    from zero.sequence import DistributedAttention, sequence_parallel_group

    attention = DistributedAttention(_causal, sequence_parallel_group(2), scatter_idx=2, gather_idx=0)
    if dist.get_rank() == 1:
        time.sleep(8)
        return "skipped"
    q = torch.randn(4, 1, 2, 8)
    start = time.perf_counter()
    try:
        attention(q, q, q)
    except CollectiveTimeout as err:
        return f"CollectiveTimeout after {time.perf_counter() - start:.1f} s: {err}"
    return "returned"


def test_a_rank_that_skips_the_exchange_fails_the_other_within_the_bound():
    from zero.testing.dist import run_once

    results, _ = run_once(2, _a_rank_skips_the_exchange, env={"ZERO_COLLECTIVE_TIMEOUT": "3"}, timeout=60)
    assert results[1] == "skipped", results
    assert results[0].startswith("CollectiveTimeout") and "all_to_all (sequence)" in results[0], results[0]
    assert float(results[0].split(" after ")[1].split(" s:")[0]) < 6, results[0]


def _a_sequence_the_group_cannot_split():
    import torch.distributed as dist

    from zero.sequence import DistributedAttention, sequence_all_to_all

    x = torch.randn(1, 3, 4, 8)  # [b, s, h, d]: heads split over 2, the 3-token context does not
    messages = []
    for call in (lambda: sequence_all_to_all(x, dist.group.WORLD, 1, 2),
                 lambda: DistributedAttention(_causal, dist.group.WORLD, sp_stream=object())):
        try:
            call()
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _no_exchange_in_the_model():
    """sequence_parallel_size 2, but the GPT's attention was never given the exchange."""
    import zero
    from zero.errors import ZeroRuntimeError
    from zero.models import GPT, GPTConfig
    from zero.sequence import DistributedAttention, UlyssesSPDataLoaderAdapter, sequence_parallel_group

    group = sequence_parallel_group(2)
    q = torch.randn(1, 4, 2, 8)
    DistributedAttention(_causal, group, scatter_idx=2, gather_idx=1)(q, q, q, batch_dim_idx=0)  # before the engine
    shared = [{"input_ids": torch.arange(8).view(1, 8)}]  # every rank the same batch
    try:
        next(iter(UlyssesSPDataLoaderAdapter(shared, torch.distributed.get_rank(), group, 2)))
        adapter = "no error"
    except ValueError as exc:
        adapter = str(exc)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16))
    engine, *_ = zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                                                      "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}})
    before = [p.detach().clone() for p in engine.module.parameters()]
    idx = torch.randint(0, 64, (1, 8))
    engine.backward(engine(idx, idx))
    try:
        engine.step()
    except ZeroRuntimeError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        return str(exc), unchanged, engine.global_steps, adapter
    return "no error", False, engine.global_steps, adapter


def test_bad_sequence_parallel_input_is_a_clear_error_before_anything_changes(dist_run):
    from zero.config import ConfigError, load_config

    for message, unchanged, steps, adapter in dist_run(2, _no_exchange_in_the_model):
        # an exchange before the engine was built does not count for it
        assert "exchanged nothing over the sequence-parallel group" in message and "Nothing was updated" in message
        assert unchanged and steps == 0
        assert "every rank of the sequence-parallel group loaded the same batch" in adapter, adapter
    from zero.sequence import shard_batch

    packed = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    with pytest.raises(ValueError, match="packed sequences"):
        shard_batch(packed, 0, 2)
    for split, stream in dist_run(2, _a_sequence_the_group_cannot_split):
        assert "splits dimension 1 of a tensor of shape (1, 3, 4, 8), whose size 3 is not a multiple of 2" in split
        assert "sp_stream" in stream
    for config, world, message in (
            ({"sequence_parallel_size": 2, "pipeline": {"stages": 2}}, 4, "with pipeline or tensor parallelism"),
            ({"sequence_parallel_size": 2, "tensor_parallel": {"size": 2}}, 4, "with pipeline or tensor parallelism"),
            ({"sequence_parallel_size": 3}, 4, "3, which does not divide the world of 4 ranks"),
            ({"sequence_parallel_size": 0}, 4, "sequence_parallel_size")):
        with pytest.raises(ConfigError, match=message):
            load_config({"train_micro_batch_size_per_gpu": 1, **config}, world)
    transformers = pytest.importorskip("transformers")
    from zero.sequence.hf import UlyssesSPAttentionHF

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=3, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="3 query heads must split over it"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)
    assert model.config._attn_implementation == "sdpa"  # untouched


def _save_with_sequence_parallelism_and_resume_without(directory: str):
    """A checkpoint of a sequence-parallel run resumes in plain data parallelism (and back): the
    model states are partitioned over all ranks either way."""
    import torch.distributed as dist

    import zero
    from zero.models import GPT, GPTConfig
    from zero.sequence import ulysses_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
    config = lambda sp: {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": sp,  # noqa: E731
                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(cfg), config=config(world))
    ulysses_attention(engine.module, engine.seq_parallel_group)
    g = torch.Generator().manual_seed(0)
    s, part = 16, slice(rank * 16 // world, (rank + 1) * 16 // world)
    for _ in range(2):
        idx = torch.randint(0, 64, (2, s), generator=g)
        engine.backward(engine(idx[:, part], idx[:, part], position_ids=torch.arange(s)[part]))
        engine.step()
    engine.save_checkpoint(directory, tag="sp")
    saved = {n: t.float().clone() for n, t in (engine.consolidated_16bit_state_dict() or {}).items()}
    torch.manual_seed(1)  # other weights, replaced by the checkpoint's
    plain, *_ = zero.initialize(model=GPT(cfg), config=config(1))
    plain.load_checkpoint(directory, tag="sp")
    loaded = plain.consolidated_16bit_state_dict() or {}
    assert plain.global_steps == 2
    return len(saved), max(((loaded[n].float() - t).abs().max().item() for n, t in saved.items()), default=0.0)


def test_a_sequence_parallel_checkpoint_resumes_without_sequence_parallelism(dist_run, tmp_path):
    (tensors, error), _ = dist_run(2, _save_with_sequence_parallelism_and_resume_without, str(tmp_path))
    assert tensors > 10 and error == 0.0, (tensors, error)


def test_hf_tiling_helpers_equal_the_untiled_model():
    """tile_mlps routes a Llama's MLPs through TiledMLP and tiled_causal_lm_loss computes the logits
    and loss in tiles: the same summed loss and gradients as the plain model."""
    transformers = pytest.importorskip("transformers")
    from zero.sequence import tile_mlps, tiled_causal_lm_loss

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg)
    tiled = copy.deepcopy(plain)
    assert tile_mlps(tiled, tokens_per_tile=7) == 2
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, 37), generator=g)
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    shift[0, :11] = -100
    want = F.cross_entropy(plain(input_ids=ids).logits.flatten(0, 1).float(), shift.flatten(), ignore_index=-100,
                           reduction="sum")
    got = tiled_causal_lm_loss(tiled, ids, shift, tokens_per_tile=5)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="tokens_per_tile"):
        tile_mlps(tiled, 0)

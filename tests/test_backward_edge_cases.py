"""Backward passes that are not one plain `loss.backward()`, for the stages that reduce during
backward (2 and 3), each against a plain reference: gradients that arrive after their group was
sent, the first gradient arriving inside a reentrant checkpoint, `retain_graph`, frozen weights
(LoRA-style), and a backward that raises."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import zero
from zero.partition.layout import ShardLayout
from zero.testing.training import relative_error, train_side_by_side


def small_groups(stage: int) -> dict:
    """Many groups: one unit per layer (stage 3), buckets of 200 elements (stages 1-2)."""
    if stage == 3:
        return {"stage3_param_persistence_threshold": 0, "stage3_module_granularity_threshold": 100,
                "stage3_max_reuse_distance": 0}
    return {"reduce_bucket_size": 200}


def _batch(n_in, n_out):
    def make(n, g):
        return torch.randn(n, n_in, generator=g), torch.randn(n, n_out, generator=g)
    return make


class SharedUnderTwoCheckpoints(nn.Module):
    """`shared` runs inside two reentrant checkpoints: its gradient arrives in two separate
    backward passes, the second after its bucket or unit was already sent."""

    make_batch = staticmethod(_batch(8, 4))

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        h = F.gelu(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: F.gelu(self.shared(t)), h, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(lambda t: F.gelu(self.shared(t)), h, use_reentrant=True)
        return F.mse_loss(self.out(h), y)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_arriving_after_their_group_was_sent_are_reduced(dist_run, stage):
    for r in dist_run(2, train_side_by_side, model=SharedUnderTwoCheckpoints, stage=stage, extra_config=small_groups(stage)):
        assert r["error"] < 1e-6, r["error"]


class CheckpointedLayers(nn.Module):
    """A stack of layers, each but the first under a reentrant checkpoint, and no parameters of
    its own: the first gradient of a backward arrives inside a nested (checkpoint) backward."""

    make_batch = staticmethod(_batch(8, 8))

    def __init__(self, layers: int = 4):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers - 1))

    def forward(self, x, y):
        x = torch.tanh(self.first(x))  # so the checkpoints' inputs require grad
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(lambda t, m=layer: torch.tanh(m(t)), x, use_reentrant=True)
        return F.mse_loss(x, y)


def comm_of_checkpointed_steps(stage: int):
    r = train_side_by_side(model=CheckpointedLayers, stage=stage, steps=3,
                           extra_config={**small_groups(stage), **({"stage3_module_granularity_threshold": 50} if stage == 3 else {}),
                                         "ignore_unused_parameters": False})
    return r["error"], r["comm"], len(r["units"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_backward_that_starts_inside_a_checkpoint_reduces_each_group_once(dist_run, stage):
    for error, comm, units in dist_run(2, comm_of_checkpointed_steps, stage):
        assert error < 1e-6, error
        if stage == 3:
            assert units == 4
            assert comm["reduce_scatter"]["calls"] == 4  # once per unit, not once per checkpoint
            # train_side_by_side's no-grad forward for the loss (4), the forward (4), and in backward
            # the recompute of the three checkpointed layers (kept for their backward) and the
            # first layer (1): no third gather of a checkpointed layer
            assert comm["all_gather"]["calls"] == 12, comm
        else:  # one reduce-scatter per bucket
            layout = ShardLayout([p.numel() for p in CheckpointedLayers().parameters()], [0] * 8, 2, 200)
            assert comm["reduce_scatter"]["calls"] == len(layout.buckets), comm


def retain_graph_twice(stage: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    engine, *_ = zero.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **small_groups(stage)}})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # the config's default
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs, ys = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        x, y = xs[4 * rank : 4 * rank + 4], ys[4 * rank : 4 * rank + 4]
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss, retain_graph=True)
        engine.backward(loss)  # the same graph again: twice the gradient
        engine.step()
        ref_opt.zero_grad()
        (2 * F.mse_loss(ref(xs), ys)).backward()
        ref_opt.step()
    return relative_error(net, ref)


@pytest.mark.parametrize("stage", [2, 3])
def test_retain_graph_and_a_second_backward_gather_again(dist_run, stage):
    for error in dist_run(2, retain_graph_twice, stage):
        assert error < 1e-6, error


class LoRA(nn.Module):
    """A frozen base weight with a trainable low-rank adapter."""

    def __init__(self, width: int):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.a, self.b = nn.Linear(width, 4, bias=False), nn.Linear(4, width, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.b(self.a(x)))


def lora_gathered_peak():
    torch.manual_seed(0)
    width, layers = 64, 8
    net = nn.Sequential(nn.Linear(8, width), *[LoRA(width) for _ in range(layers)])
    zero.set_z3_leaf_modules(net, [LoRA])
    engine, *_ = zero.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1}})
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
        engine.step()
    unit_bytes = max(u.full_numel for u in engine.optimizer.storage.units if u.name.startswith("1")) * 4
    return engine.memory_report()["gathered_peak"] / unit_bytes


def test_frozen_weights_are_released_once_their_module_backward_is_done(dist_run):
    for units_held in dist_run(2, lora_gathered_peak):
        # one unit in use, one prefetched, and one landing: never all eight
        assert units_held <= 3.01, units_held


class FailsOnce(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if FailsOnce.armed:
            FailsOnce.armed = False
            raise RuntimeError("simulated out of memory in backward")
        return g


class RaisesOnce(nn.Module):
    """Identity whose forward raises once when armed (an OOM in the middle of the forward)."""

    armed = False

    def forward(self, x):
        if RaisesOnce.armed:
            RaisesOnce.armed = False
            raise RuntimeError("simulated out of memory in forward")
        return x


def skip_a_failed_batch(stage: int, fail: str | None):
    """The "skip the batch" loop of docs/engine.md: batch 1 fails in `fail` ("forward" or
    "backward") and is skipped; the result must equal a run that never saw batch 1."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), RaisesOnce(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    engine, *_ = zero.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **small_groups(stage)}})
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        if step == 1 and fail is None:
            continue  # the clean run never sees this batch
        RaisesOnce.armed = step == 1 and fail == "forward"
        FailsOnce.armed = step == 1 and fail == "backward"
        try:
            engine.backward(F.mse_loss(FailsOnce.apply(engine(x)), y))
            engine.step()
        except RuntimeError as exc:
            assert "simulated out of memory" in str(exc)
            engine.zero_grad()  # drop what the failed batch left
    with zero.GatheredParameters(list(net.parameters())):
        return [p.detach().clone() for p in net.parameters()], engine.get_global_grad_norm(), engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_skipping_a_batch_that_raised_in_forward_or_backward_equals_never_seeing_it(dist_run, stage):
    clean = dist_run(2, skip_a_failed_batch, stage, None)
    for fail in ("forward", "backward"):
        failed = dist_run(2, skip_a_failed_batch, stage, fail)
        for (a, norm_a, steps_a), (b, norm_b, steps_b) in zip(clean, failed):
            assert norm_a > 0 and norm_a == pytest.approx(norm_b, rel=1e-6), fail
            assert steps_a == steps_b == 3
            assert all(torch.allclose(x, y, rtol=0, atol=1e-7) for x, y in zip(a, b)), fail

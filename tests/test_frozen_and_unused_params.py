"""Frozen parameters stay unchanged; parameters without gradient neither hang nor crash."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from zero.testing.training import train_side_by_side


def freeze_first_layer(model: nn.Module) -> None:
    model.layers[0].requires_grad_(False)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_frozen_layer_stays_unchanged_and_the_rest_matches(dist_run, stage):
    for r in dist_run(2, train_side_by_side, model="mlp", stage=stage, prepare=freeze_first_layer):
        assert r["frozen_unchanged"]
        assert r["error"] < 1e-6, r["error"]


class SometimesUnused(nn.Module):
    """`extra` is used only on rank 0 and only on even steps; `never` is never used."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)

    def forward(self, x, use_extra: bool):
        x = self.body(x)
        if use_extra:
            x = self.extra(x)
        return x.square().mean()


def train_with_unused(stage: int, overlap: bool):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SometimesUnused()
    never_before = model.never.weight.detach().clone()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "overlap_comm": overlap}}
    engine, *_ = zero.initialize(model=model, config=cfg)
    for step in range(4):
        loss = engine(torch.randn(2, 6), use_extra=(rank == 0 and step % 2 == 0))
        engine.backward(loss)
        engine.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    return engine.global_steps, all(torch.equal(gathered[0], w) for w in gathered), torch.equal(model.never.weight, never_before)


@pytest.mark.parametrize("stage,overlap", [(0, False), (1, False), (2, False), (2, True)])
def test_parameters_unused_on_some_ranks_or_steps_neither_hang_nor_diverge(dist_run, stage, overlap):
    for steps, ranks_agree, never_unchanged in dist_run(3, train_with_unused, stage, overlap, timeout=120):
        assert steps == 4
        assert ranks_agree  # every rank holds the same weights after each all-gather
        assert never_unchanged  # zero gradient and no weight decay: Adam leaves it exactly as it was

"""A mixture-of-experts block whose top-1 routing picks different experts on different ranks trains
under stage 3 when marked as a leaf (one unit, reduced at the end of backward) and equals the
single-process model; unmarked, its experts are units of their own and the ranks diverge."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.testing.dist import DistPool
from zero.testing.training import relative_error


class MoE(nn.Module):
    def __init__(self, width: int = 16, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        choice = self.gate(x).argmax(dim=-1)  # top-1: data-dependent, rank-dependent
        weight = torch.softmax(self.gate(x), dim=-1).max(dim=-1).values.unsqueeze(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                out[picked] = expert(x[picked]) * weight[picked]
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(8, 16), MoE(), nn.Linear(16, 4)

    def forward(self, x, y):
        return F.mse_loss(self.out(torch.tanh(self.moe(torch.tanh(self.inp(x))))), y)


def train(leaf: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    if leaf:
        zero.set_z3_leaf_modules(model, [MoE])
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_module_granularity_threshold": 100}})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16 * world, 8, generator=g), torch.randn(16 * world, 4, generator=g)
            engine.backward(engine(x[16 * rank : 16 * rank + 16], y[16 * rank : 16 * rank + 16]))
            engine.step()
            ref_opt.zero_grad()
            reference(x, y).backward()
            ref_opt.step()
    except zero.RankDivergenceError as exc:
        return f"RankDivergenceError: {exc}"
    return relative_error(model, reference)


def test_a_leaf_moe_block_with_rank_dependent_routing_matches_the_reference(dist_run):
    for error in dist_run(2, train, True):
        assert error < 1e-6, error


def test_unmarked_experts_with_rank_dependent_routing_diverge_clearly():
    pool = DistPool(2)  # its own ranks: a divergence aborts their process group
    try:
        results = pool.run(train, False, timeout=120)
    finally:
        pool.close(kill=True)
    for result in results:  # the same data as the leaf test: so the routing there differs by rank too
        assert isinstance(result, str) and result.startswith("RankDivergenceError"), result

"""Stage 3 on the models that break naive parameter partitioning, each against a plain reference."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import zero
from zero.testing.models import GPT, MLP, GPTConfig
from zero.testing.training import relative_error, train_side_by_side

SMALL_UNITS = {"stage3_param_persistence_threshold": 10, "stage3_module_granularity_threshold": 100}


def regression_batch(n_in: int, n_out: int):
    def make(n, g):
        return torch.randn(n, n_in, generator=g), torch.randn(n, n_out, generator=g)
    return make


class CalledTwice(nn.Module):
    """`shared` runs twice in every forward."""

    make_batch = staticmethod(regression_batch(8, 4))

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        h = F.gelu(self.inp(x))
        h = F.gelu(self.shared(h))
        h = F.gelu(self.shared(h))
        return F.mse_loss(self.out(h), y)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)


class Decoder(nn.Module):
    """Projects back with the encoder's weight, which it does not own."""

    def __init__(self, encoder: Encoder):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8))
        self._encoder = [encoder]  # a plain reference, not a submodule

    def forward(self, h):
        return F.linear(h, self._encoder[0].lin.weight.t(), self.bias)


class ExternalParameter(nn.Module):
    make_batch = staticmethod(regression_batch(8, 8))

    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.mid = nn.Linear(16, 16)
        self.dec = Decoder(self.enc)
        zero.register_external_parameter(self.dec, self.enc.lin.weight)

    def forward(self, x, y):
        h = F.gelu(self.enc.lin(x))
        h = F.gelu(self.mid(h))
        return F.mse_loss(self.dec(h), y)


class TinyOutput(MLP):
    """Its last bias has 2 elements: fewer than the world size of 4."""

    make_batch = staticmethod(regression_batch(13, 2))

    def __init__(self):
        super().__init__((13, 31, 17, 2))


class CheckpointedGPT(GPT):
    """Each block runs under torch.utils.checkpoint (activations recomputed in backward)."""

    reentrant = False

    def __init__(self):
        super().__init__(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18))

    @staticmethod
    def make_batch(n, g):
        idx = torch.randint(0, 37, (n, 9), generator=g)
        return idx[:, :-1], idx[:, 1:]

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ReentrantCheckpointedGPT(CheckpointedGPT):
    reentrant = True


def freeze_first_block(model):
    model.blocks[0].requires_grad_(False)


GPT_UNITS = {"stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 2000}


def test_tied_input_and_output_embedding(dist_run):
    for r in dist_run(3, train_side_by_side, model="gpt", stage=3, eps=1e-6):
        assert r["error"] < 5e-6, r["error"]
        assert r["units"][0] == ""  # the tied weight belongs to the common ancestor: the root unit


@pytest.mark.parametrize("model", [CalledTwice, ExternalParameter, TinyOutput])
def test_awkward_model_matches_reference(dist_run, model):
    for r in dist_run(4, train_side_by_side, model=model, stage=3, lr=1e-2, extra_config=SMALL_UNITS):
        assert r["error"] < 1e-6, r["error"]
        assert len(r["units"]) >= 2


@pytest.mark.parametrize("model", [CheckpointedGPT, ReentrantCheckpointedGPT])
def test_activation_checkpointing_of_blocks(dist_run, model):
    for r in dist_run(2, train_side_by_side, model=model, stage=3, lr=1e-3, eps=1e-6, extra_config=GPT_UNITS):
        assert r["error"] < 5e-6, r["error"]
        assert "blocks.0" in r["units"]


def test_frozen_submodule_stays_unchanged(dist_run):
    for r in dist_run(2, train_side_by_side, model="gpt", stage=3, eps=1e-6, prepare=freeze_first_block):
        assert r["frozen_unchanged"]
        assert r["error"] < 5e-6, r["error"]


class SometimesUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.extra, self.b = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.use_extra = True

    def forward(self, x, y):
        h = F.gelu(self.a(x))
        if self.use_extra:
            h = F.gelu(self.extra(h))
        return F.mse_loss(self.b(h), y)


def train_with_a_branch_and_eval(steps: int = 6):
    """`extra` is used on even steps only (on every rank); an eval pass runs in the middle.

    A parameter without a gradient in a step is updated as if its gradient were zero (weight
    decay and Adam's moment decay still apply), as in DeepSpeed: flat shards have no "no
    gradient" state. That is torch's behaviour with `zero_grad(set_to_none=False)`, which the
    reference uses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = SometimesUsed()
    ref = copy.deepcopy(net)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, **SMALL_UNITS}}
    engine, *_ = zero.initialize(model=net, config=cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(1)
    eval_equal = None
    for step in range(steps):
        net.use_extra = ref.use_extra = step % 2 == 0
        batches = [regression_batch(8, 4)(4, g) for _ in range(world)]
        engine.backward(engine(*batches[rank]))
        engine.step()
        xs, ys = (torch.cat(t) for t in zip(*batches))
        ref_opt.zero_grad(set_to_none=False)
        ref(xs, ys).backward()
        ref_opt.step()
        if step == 2:  # eval, then train again
            engine.eval(), ref.eval()
            with torch.no_grad():
                eval_equal = abs(engine(xs, ys).item() - ref(xs, ys).item()) < 1e-6
            engine.train(), ref.train()
    return relative_error(net, ref), eval_equal, engine.optimizer.storage.runtime.traces


def test_parameter_unused_in_some_steps_and_eval_then_train(dist_run):
    for error, eval_equal, traces in dist_run(3, train_with_a_branch_and_eval):
        assert error < 1e-6, error
        assert eval_equal
        assert traces["forward"] and traces["backward"]


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x, y):
        return F.mse_loss(self.out(F.gelu(self.bn(self.lin(x)))), y)


def train_batchnorm():
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3, **SMALL_UNITS}}
    engine, *_ = zero.initialize(model=WithBatchNorm(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())  # different data on every rank
    for _ in range(3):
        engine.backward(engine(*regression_batch(8, 4)(8, g)))
        engine.step()
    stats = torch.cat([engine.module.bn.running_mean, engine.module.bn.running_var])
    everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, stats)
    return all(torch.equal(everyone[0], s) for s in everyone), engine.module.bn.num_batches_tracked.item()


def test_batchnorm_running_stats_stay_in_sync_across_ranks(dist_run):
    for in_sync, tracked in dist_run(3, train_batchnorm):
        assert in_sync and tracked == 3


def generate_greedily(steps: int = 6):
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=18))
    ref = copy.deepcopy(net)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 2000}}
    engine, *_ = zero.initialize(model=net, config=cfg)
    engine.eval()
    tokens = ref_tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(steps):  # every rank runs the same number of forwards
            tokens = torch.cat([tokens, engine(tokens)[:, -1:].argmax(-1)], dim=1)
            ref_tokens = torch.cat([ref_tokens, ref(ref_tokens)[:, -1:].argmax(-1)], dim=1)
    return torch.equal(tokens, ref_tokens), engine.memory_report()["gathered_bytes"] == 0


def test_generation_under_no_grad_matches_and_releases_everything(dist_run):
    for same, released in dist_run(2, generate_greedily):
        assert same and released

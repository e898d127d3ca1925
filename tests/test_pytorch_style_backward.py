"""`loss.backward()` + `engine.step()` is `engine.backward(loss)` + `engine.step()`, bit for bit, at every
stage, with accumulation, in fp32 and bf16, with Adam and with SGD (which, unlike Adam, shows a wrong
gradient scale), also for a block that runs twice per forward and for two backward passes per
micro-batch; fp16 refuses an unscaled backward and takes `engine.scale(loss).backward()`.
See [Note: backward from PyTorch] in zero/engine/loop.py."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero


class TwiceUsed(nn.Module):
    """`block` runs twice in every forward (its gradient is the sum of both uses)."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x, y):
        h = F.gelu(self.inp(x))
        h = F.gelu(self.block(h))
        h = F.gelu(self.block(h))
        return F.mse_loss(self.out(h).float(), y.float())


def _config(stage: int, precision: str, optimizer: str) -> dict:
    opt = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}} if optimizer == "adam" else \
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "optimizer": opt,
           "zero_optimization": {"stage": stage, **({"reduce_bucket_size": 100} if stage < 3 else {  # several buckets
                                 "stage3_param_persistence_threshold": 10, "stage3_module_granularity_threshold": 100})}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _batches(steps: int, world: int, precision: str):
    g = torch.Generator().manual_seed(3)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return [[(torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 3, generator=g))
             for _ in range(2 * world)] for _ in range(steps)]


def _gathered(model: nn.Module) -> list[torch.Tensor]:
    with zero.GatheredParameters(list(model.parameters())):
        return [p.detach().float().clone() for p in model.parameters()]


def _reference_grads(reference: nn.Module, step, two_passes: bool) -> list[torch.Tensor]:
    """The gradient of the whole global batch's mean loss (both passes' sum), in fp32."""
    reference.zero_grad()
    xs, ys = (torch.cat(t) for t in zip(*step))
    loss = reference(xs.float(), ys)
    if two_passes:  # the second pass flips each micro-batch's inputs
        loss = loss + reference(torch.cat([x.flip(0) for x, _ in step]).float(), ys)
    loss.backward()
    return [p.grad.clone() for p in reference.parameters()]


def both_backwards(stage: int, precision: str, optimizer: str, two_passes: bool, steps: int = 3):
    """Train one copy with engine.backward(loss) and one with loss.backward(); before the first
    step, read both engines' gradients (safe_get_full_grad) beside plain torch's gradient of the
    whole global batch; with SGD in fp32 also train the torch reference. Returns whether the two
    engines agree bit for bit, the gradients' largest relative error against torch's (per
    engine), the parameters' against the reference (fp32 SGD), every warning zero gave, and the
    steps taken."""
    from zero.accessors import safe_get_full_grad

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)
    base = TwiceUsed()
    models = [copy.deepcopy(base) for _ in range(2)]
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    grad_errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines = [zero.initialize(model=m, config=_config(stage, precision, optimizer))[0] for m in models]
        for i, step in enumerate(_batches(steps, world, precision)):
            for k in range(2):  # accumulation steps
                x, y = step[k * world + rank]
                for style, engine in zip(("engine", "torch"), engines):
                    losses = [engine(x, y)] + ([engine(x.flip(0), y)] if two_passes else [])
                    for loss in losses:
                        engine.backward(loss) if style == "engine" else loss.backward()
                    if i == 0 and k == 1:  # the accumulated gradient, before the step
                        want = _reference_grads(reference, step, two_passes)
                        got = [safe_get_full_grad(p) for p in engine.module.parameters()]
                        grad_errors.append(max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want)))
                    engine.step()
            _reference_grads(reference, step, two_passes)
            ref_opt.step()
    a, b = (_gathered(m) for m in models)
    same = all(torch.equal(p, q) for p, q in zip(a, b))
    error = max(((p - r.detach()).abs().max() / r.detach().abs().max()).item() for p, r in zip(b, reference.parameters()))
    zero_warnings = [str(w.message) for w in caught if "zero" in str(w.message)]
    return same, grad_errors, error, zero_warnings, [e.global_steps for e in engines]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_is_engine_backward_bit_for_bit(dist_run, stage):
    cases = [(precision, optimizer, False) for precision in ("fp32", "bf16") for optimizer in ("adam", "sgd")]
    cases.append(("bf16", "sgd", True))  # two backward passes per micro-batch, each using the block twice
    for precision, optimizer, two_passes in cases:
        results = dist_run(2, both_backwards, stage, precision, optimizer, two_passes)
        for same, grad_errors, error, zero_warnings, steps in results:
            what = f"stage {stage} {precision} {optimizer}{' two passes' if two_passes else ''}"
            assert same, what
            assert steps == [3, 3], what
            assert zero_warnings == [], (what, zero_warnings)
            # the gradients themselves against torch's (a dropped use of the block is tens of percent)
            assert max(grad_errors) < (1e-5 if precision == "fp32" else 2e-2), (what, grad_errors)
            if precision == "fp32" and optimizer == "sgd":  # the parameters after 3 steps
                assert error < 1e-6, (what, error)


def fp16_refusal(stage: int):
    """An unscaled loss.backward() under fp16 is refused before any gradient is taken; the engine
    then trains on as if it had not happened, and engine.scale(loss).backward() is engine.backward."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)
    base = TwiceUsed()
    models = [copy.deepcopy(base) for _ in range(2)]
    engines = [zero.initialize(model=m, config=_config(stage, "fp16", "adam"))[0] for m in models]
    message = None
    for i, step in enumerate(_batches(2, world, "fp16")):
        for k in range(2):
            x, y = step[k * world + rank]
            if i == 0 and k == 1:  # a refused backward, on the second engine only
                try:
                    engines[1](x, y).backward()
                except RuntimeError as exc:
                    message = str(exc)
            engines[0].backward(engines[0](x, y))
            engines[1].scale(engines[1](x, y)).backward()
            for engine in engines:
                engine.step()
    a, b = (_gathered(m) for m in models)
    return message, all(torch.equal(p, q) for p, q in zip(a, b)), [e.global_steps for e in engines]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_refuses_an_unscaled_backward_and_scale_backward_is_engine_backward(dist_run, stage):
    for message, same, steps in dist_run(2, fp16_refusal, stage):
        assert message is not None and "Call engine.backward(loss), or engine.scale(loss).backward(), instead of " \
            "loss.backward()" in message, message
        assert same and steps == [2, 2]


def two_fp16_engines(stage: int):
    """A GAN's step under fp16: the generator's loss runs through the discriminator's model (another
    engine), a gradient penalty takes torch.autograd.grad through it, and a regulariser on the
    parameters alone is a backward of its own. Returns each engine's backward count, per step."""
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)), nn.Sequential(nn.Linear(6, 8), nn.Tanh(),
                                                                                        nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "fp16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    g, *_ = zero.initialize(model=gen, config=cfg)
    d, *_ = zero.initialize(model=disc, config=cfg)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step without a backward" warning either
        for _ in range(2):
            z = torch.randn(2, 4, dtype=torch.float16)
            fake = g(z)
            g.backward(-d(fake).float().mean())  # through the discriminator's model: no refusal
            g.step()
            d.zero_grad()  # the discriminator's gradients from the generator's loss are dropped
            real = torch.randn(2, 6, dtype=torch.float16).requires_grad_(True)
            score = d(real)
            grad, = torch.autograd.grad(score.float().sum(), real, create_graph=True)  # a gradient penalty
            loss = -score.float().mean() + d(fake.detach()).float().mean() + grad.float().square().sum()
            d.backward(loss)
            d.backward(sum(p.float().square().sum() for p in disc.parameters()) * 1e-4)  # parameters alone
            counts.append((g.progress.backwards, d.progress.backwards))
            d.step()
    return counts, g.global_steps, d.global_steps


def test_two_fp16_engines_a_gradient_penalty_and_a_loss_on_parameters_alone(dist_run):
    for stage in (1, 2, 3):
        for counts, g_steps, d_steps in dist_run(2, two_fp16_engines, stage):
            # g: its own backward (then stepped, so 0 again); d: the generator's (its gradients dropped
            # by zero_grad, the count stays), its own and the regulariser's; autograd.grad adds none
            assert counts == [(0, 3), (0, 3)] and g_steps == d_steps == 2, (stage, counts)


def test_scale_without_fp16_is_the_loss_itself_and_the_pipeline_api_needs_a_schedule():
    engine, *_ = zero.initialize(model=TwiceUsed(), config=_config(2, "bf16", "adam"))
    loss = engine(torch.randn(4, 6, dtype=torch.bfloat16), torch.randn(4, 3))
    assert engine.scale(loss) is loss
    with pytest.raises(TypeError, match=r"engine.scale\(loss\) takes the scalar loss tensor, got a tuple"):
        engine.scale((loss,))
    assert not hasattr(engine, "train_batch") and not hasattr(engine, "is_first_stage")
    with pytest.raises(AttributeError, match=r"'Engine' object has no attribute 'train_batch': it belongs to a "
                                             r"pipeline schedule"):
        engine.train_batch(iter([]))


class _Box:
    def __init__(self, t):
        self.t = t


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward that fails midway")


class BoxedCheckpointed(nn.Module):
    """Returns its output inside a plain object, from under a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, fail: bool = False):
        h = torch.utils.checkpoint.checkpoint(self.b, self.a(x), use_reentrant=True)
        return _Box(_Fails.apply(h) if fail else h)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_counts_survive_hidden_outputs_checkpoints_and_a_backward_that_raised(stage):
    for precision in ("bf16", "fp16"):
        torch.manual_seed(0)
        engine, *_ = zero.initialize(model=BoxedCheckpointed(), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, precision: {"enabled": True},
            "zero_optimization": {"stage": stage, "ignore_unused_parameters": False}})
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        x = torch.randn(2, 4, dtype=dtype)
        engine.backward(engine(x).t.float().sum())  # the output in a plain object, from a checkpoint: one pass
        assert engine.progress.backwards == 1, (stage, precision)
        with pytest.raises(RuntimeError, match="fails midway"):
            engine.backward(engine(x, fail=True).t.float().sum())
        engine.zero_grad()  # what a failed batch left (docs/engine.md, "Skipping a batch that raised")
        # no forward since: a loss on the parameters alone is a pass of its own (and, under fp16,
        # unscaled, it is refused although the scaled backward before it never reached its end)
        regulariser = sum(p.float().square().sum() for p in engine.module.parameters())
        if precision == "fp16":
            with pytest.raises(RuntimeError, match="without the fp16 loss scale"):
                regulariser.backward()
            regulariser = sum(p.float().square().sum() for p in engine.module.parameters())
            engine.backward(regulariser)
        else:
            regulariser.backward()
        assert engine.progress.backwards == 2, (stage, precision)
        engine.zero_grad()

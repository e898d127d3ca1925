"""Train a model with zero and, beside it, with plain single-process PyTorch; compare the results.

Every rank builds the same model from the same seed, trains one copy with `zero.initialize` on its
own micro-batches, and trains a reference copy locally with torch.optim on the full global batch
(all ranks' micro-batches of all accumulation steps at once). After the steps, the parameters of
the two must agree. Runs inside a test's rank process (see zero/testing/dist.py), or alone as a
world of one.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from zero.testing.models import GPT, MLP, GPTConfig

# stage-3 settings that make the small test models shard into several units
STAGE3 = {
    "mlp": {"stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 300},
    "gpt": {"stage3_param_persistence_threshold": 20, "stage3_module_granularity_threshold": 2000},
}


def build_model(name) -> nn.Module:
    """Small models whose parameter counts do not divide 2, 3 or 4 evenly (or `name()` if callable)."""
    if callable(name):
        return name()
    if name == "mlp":
        return MLP((13, 31, 17, 5))  # 1068 parameters
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18))
    raise ValueError(f"unknown model {name!r}")


def make_batch(name, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if callable(name):
        return name.make_batch(n, g)
    if name == "mlp":
        return torch.randn(n, 13, generator=g), torch.randn(n, 5, generator=g)
    idx = torch.randint(0, 37, (n, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def relative_error(a: nn.Module, b: nn.Module) -> float:
    """max over parameters of max|a - b| / max|b| (sharded parameters are gathered first)."""
    with zero.GatheredParameters(list(a.parameters())):
        return max(((pa.float() - pb.float()).abs().max() / pb.float().abs().max().clamp_min(1e-12)).item()
                   for pa, pb in zip(a.parameters(), b.parameters()))


def train_side_by_side(
    model: str = "mlp",
    stage: int = 2,
    steps: int = 5,
    micro_batch: int = 4,
    accumulation: int = 1,
    precision: str = "fp32",
    clip: float = 0.0,
    weight_decay: float = 0.01,
    adamw: bool = True,
    extra_config: dict[str, Any] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    lr: float | None = None,
    eps: float = 1e-8,
) -> dict[str, Any]:
    """Train with zero and with torch side by side; return errors and engine reports.

    Args:
        model: "mlp" or "gpt", or a model class/factory whose `make_batch(n, generator)` gives
            (x, y) and whose forward(x, y) returns the loss.
        stage: ZeRO stage.
        steps: optimizer steps.
        micro_batch: samples per rank per micro-step.
        accumulation: micro-steps per optimizer step.
        precision: "fp32", "bf16" or "fp16".
        clip: gradient clipping (0 = off).
        weight_decay, adamw: optimizer settings (AdamW or Adam with L2).
        extra_config: merged into the zero config's zero_optimization section.
        prepare: called on the model (both copies) before training, e.g. to freeze a layer.
        lr: learning rate; default 1e-2 for the MLP and 1e-3 for the GPT.

    [Note: conditioning of the comparison]
    Adam divides each gradient element by its own running magnitude, so a round-off difference
    in a tiny gradient element (different summation order across ranks, or a GEMM that blocks
    differently on a view) becomes a difference of order lr in the update, and a transformer's
    training dynamics amplify it from step to step. Measured on the 2-layer GPT: for a world of
    one with no partitioning at all, lr 1e-2 drifts to ~1e-5 after 5 steps, lr 1e-3 stays below
    1e-6. Across 3-4 ranks the reduced gradients equal the reference's to ~5e-7 of each tensor's
    largest element, yet a few elements whose gradient nearly cancels across samples (~1e-4 of the
    largest) differ in relative terms, and with eps=1e-8 Adam's first step (about lr * sign(g))
    turns that into ~8e-5. With eps=1e-6 such elements are damped and parameters agree to ~2e-6.
    So the GPT tests use eps=1e-6, and tests/test_gradient_shards.py checks the gradients
    themselves at 1e-6.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    net = build_model(model)
    if prepare is not None:
        prepare(net)
    ref = copy.deepcopy(net)
    lr = lr if lr is not None else (1e-2 if model == "mlp" else 1e-3)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW" if adamw else "Adam",
                      "params": {"lr": lr, "eps": eps, "weight_decay": weight_decay, "adam_w_mode": adamw}},
        "zero_optimization": {"stage": stage, **({"reduce_bucket_size": 500} if stage < 3 else {}), **(extra_config or {})},
    }
    if stage == 3 and isinstance(model, str):
        config["zero_optimization"] = {**STAGE3[model], **config["zero_optimization"]}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    frozen_before = {n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad}
    psi = sum(p.numel() for p in net.parameters() if p.requires_grad)
    engine, *_ = zero.initialize(model=net, config=config)
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = opt_cls([p for p in ref.parameters() if p.requires_grad], lr=lr, eps=eps, weight_decay=weight_decay)

    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batches = [make_batch(model, micro_batch, g) for _ in range(accumulation * world)]
        xs, ys = (torch.cat(t) for t in zip(*batches))
        with torch.no_grad():  # the engine's model on the whole global batch, before this step
            cast = (lambda t: t.to(engine.config.dtype) if t.is_floating_point() else t)
            engine_loss = engine.module(cast(xs), cast(ys)).float().item()
        for k in range(accumulation):
            x, y = batches[k * world + rank]
            if precision != "fp32" and x.is_floating_point():
                x, y = x.to(engine.config.dtype), y.to(engine.config.dtype)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        ref_opt.zero_grad()
        ref_loss = ref(xs, ys)
        ref_loss.backward()
        losses.append((engine_loss, ref_loss.item()))
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()

    with zero.GatheredParameters(list(net.parameters())):
        frozen_same = all(torch.equal(p.float(), frozen_before[n].float()) for n, p in net.named_parameters()
                          if not p.requires_grad)
    return {
        "error": relative_error(net, ref),
        "frozen_unchanged": frozen_same,
        "units": [u.name for u in getattr(engine.optimizer.storage, "units", [])],
        "memory": engine.memory_report(),
        "psi": psi,  # trainable parameter elements
        "comm": engine.comm_report(),
        "global_steps": engine.global_steps,
        "grad_norm": engine.get_global_grad_norm(),
        "losses": losses,  # per step: (engine, reference) loss on the whole global batch before the update
    }


def average_and_clip_sliced_grads(model: nn.Module, dp_group, dp: int, max_norm: float) -> None:
    """torch's side of a tensor x data parallel reference, after backward: each gradient's local
    piece averaged over the data ranks, then every gradient clipped by the norm of the whole
    gradients (clip_grad_norm_'s rule, which does not take mixed DTensor / tensor gradients)."""
    for p in model.parameters():
        local = getattr(p.grad, "_local_tensor", p.grad)
        dist.all_reduce(local, group=dp_group)
        local /= dp
    whole = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    norm = torch.stack([g.float().square().sum() for g in whole]).sum().sqrt().item()
    for p in model.parameters():
        p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))

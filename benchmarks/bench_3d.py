"""3D parallelism on 8 gloo ranks: step time and per-rank memory of data-only, pipeline x data,
tensor x data and pipeline x tensor x data training of the same GPT.

    python benchmarks/bench_3d.py [--blocks 8] [--width 128] [--micro-batches 8] [--steps 6] [--write]

- The model: a PipelineModule of `--blocks` GPT blocks (zero.testing.models, q/k/v apart so plan
  'gpt' can slice them), an embedding tied to the output head, fp32, ZeRO stage 1, M micro-batches
  of 2 sequences per step on every data replica.
- Step time: the median of the steps after the first (which builds the schedule).
- Bubble: the theoretical idle fraction of a GPipe/1F1B pipeline, (P - 1) / (M + P - 1), beside the
  measured one: 1 - (time this rank spent inside its stage's forward and backward) / (step time),
  averaged over the ranks of the stage. On a shared 2-core CPU eight ranks take turns, so the
  measured idle time includes waiting for a core, not only the pipeline's bubble.
- Memory: each rank's model-state bytes (engine.memory_report(): parameters, gradients, optimizer
  states) against the formula for its layout: with Psi_r the parameters this rank holds (its
  stage's, its tensor slice of the sliced ones), fp32 ZeRO-1 keeps 4 Psi_r of parameters (also the
  master), 4 Psi_r of gradients and 8 Psi_r / D of Adam's moments.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero.testing.dist import DistPool  # noqa: E402

VOCAB, SEQ = 256, 64
LAYOUTS = [("data only", 1, 1), ("pipeline x data", 2, 1), ("tensor x data", 1, 2), ("pipeline x tensor x data", 2, 2)]


class Embed(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, width) * 0.02)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)

    def forward(self, idx):
        return self.weight[idx] + self.pos[: idx.shape[1]]


def head(embed, x):
    return x @ embed.weight.t()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run(pp: int, tp: int, blocks: int, width: int, micro_batches: int, steps: int):
    """One rank: (step seconds after the first, seconds inside its stage per step, model-state
    bytes, the formula's bytes, this rank's pp coordinate)."""
    import zero
    import zero.tp
    from zero.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from zero.testing.models import Block, GPTConfig

    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=max(2, width // 32), n_embd=width,
                    fused_qkv=False)
    layers = [TiedLayerSpec("embed", Embed, width), *[LayerSpec(Block, cfg) for _ in range(blocks)],
              LayerSpec(nn.LayerNorm, width), TiedLayerSpec("embed", Embed, width, forward_fn=head)]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": micro_batches,
              "pipeline": {"stages": pp, "schedule": "1f1b"}, "tensor_parallel": {"size": tp},
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    model = PipelineModule(layers, num_stages=pp, loss_fn=loss_fn, seed_layers=True, partition_method="type:Block")
    if tp > 1:
        zero.tp.parallelize(model, zero.tp.mesh(config), "gpt")
    engine, *_ = zero.initialize(model=model, config=config)
    busy = [0.0]
    for part in model.parts:  # time inside this stage's forward and backward
        part.register_forward_pre_hook(lambda m, a: busy.append(-time.perf_counter()))
        part.register_forward_hook(lambda m, a, o: busy.append(time.perf_counter()))
        part.register_full_backward_pre_hook(lambda m, g: busy.append(-time.perf_counter()))
        # the backward ends when every parameter of the part has its gradient (a module hook on the
        # inputs' gradients would fire at once on the first stage, whose inputs are token ids)
        torch.autograd.graph.register_multi_grad_hook([p for p in part.parameters() if p.requires_grad],
                                                      lambda grads: busy.append(time.perf_counter()), mode="all")
    g = torch.Generator().manual_seed(engine.comm.rank)
    times, inside = [], []
    for step in range(steps):
        data = [tuple(torch.randint(0, VOCAB, (2, SEQ + 1), generator=g).split([SEQ, 1], 1)[0].roll(s, 1)
                      for s in (0, 1)) for _ in range(micro_batches)]
        dist.barrier()
        busy[:] = []
        start = time.perf_counter()
        engine.train_batch(iter(data))
        elapsed = time.perf_counter() - start
        if step:
            times.append(elapsed)
            inside.append(sum(busy))
    local = sum((p._local_tensor if hasattr(p, "_local_tensor") else p).numel() for p in model.parameters())
    report = engine.memory_report()
    states = report["params"] + report["grads"] + report["fp32_master"] + report["optimizer_states"]
    formula = 4 * local + 4 * local + 8 * local / engine.comm.world_size
    return statistics.median(times), statistics.median(inside), states, formula, engine.mesh.coordinate("pp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--write", action="store_true", help="also write benchmarks/results/parallelism.md")
    args = parser.parse_args(argv)
    m = args.micro_batches
    lines = [f"GPT of {args.blocks} blocks, width {args.width}, vocabulary {VOCAB}, sequence {SEQ}; 8 gloo ranks, fp32, "
             f"ZeRO stage 1, {m} micro-batches of 2 per data replica per step, 1F1B; torch {torch.__version__}", "",
             "| layout | P x D x T | step ms | bubble (theory) | idle (measured, per stage) | model-state bytes per "
             "rank (max) | formula | measured / formula |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    pool = DistPool(8)
    try:
        for name, pp, tp in LAYOUTS:
            rows = pool.run(run, pp, tp, args.blocks, args.width, m, args.steps, timeout=1800)
            step = statistics.median(r[0] for r in rows)
            idle = []
            for stage in range(pp):
                mine = [r for r in rows if r[4] == stage]
                idle.append(1 - statistics.mean(r[1] / r[0] for r in mine))
            bubble = (pp - 1) / (m + pp - 1)
            states = max(r[2] for r in rows)
            formula = max(r[3] for r in rows)
            ratio = max(r[2] / r[3] for r in rows)
            lines.append(f"| {name} | {pp} x {8 // (pp * tp)} x {tp} | {step * 1e3:.0f} | {bubble:.0%} | "
                         f"{', '.join(f'{x:.0%}' for x in idle)} | {states:,} | {formula:,.0f} | {ratio:.2f} |")
    finally:
        pool.close()
    text = "\n".join(lines)
    print(text)
    if args.write:
        from report import RESULTS, _write

        RESULTS.mkdir(exist_ok=True)
        _write("parallelism", "3D parallelism: step time, bubble and memory per layout", text, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a small GPT on zero's own documentation: the main demo (`make demo`).

    torchrun --nproc_per_node 2 examples/train_gpt.py                                   # stage 3 + CPU optimizer offload
    torchrun --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero2.json
    torchrun --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3_offload_bf16.json --steps 400

A character-level GPT (4 blocks, about 0.5M parameters) learns the text of README.md and docs/*.md,
which ship with the repository (nothing is downloaded), on as many ranks as torchrun starts (one
process works too), on CPUs (gloo) or GPUs (NCCL). Any config in examples/configs/ runs: stages 0-3,
optimizer and parameter offload, bf16.

Rank 0 shows a progress bar (step, loss, time per step over a moving window that leaves out the
first step and its native-op build, characters per second, every rank's memory). At the end it
prints one table: this run's model-state bytes per rank, measured, beside the estimator's number and
what plain data parallelism and every other stage would need; peak memory; communication per step;
and the time split into forward, backward and optimizer step. Then the model writes a few lines.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import zero
from zero.testing.models import GPT, CharDataset, GPTConfig, arithmetic_corpus

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "zero3_offload.json"


def corpus() -> str:
    """The repository's documentation, or (in an installed copy without it) generated sums."""
    files = [HERE.parent / "README.md", *sorted((HERE.parent / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.exists())
    return text if len(text) > 20_000 else arithmetic_corpus(200_000)


@torch.no_grad()
def sample(model: GPT, data: CharDataset, prompt: str, length: int, device: torch.device) -> str:
    """Continue `prompt` by sampling (temperature 0.8) from the plain model."""
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.tensor([[data.stoi.get(c, 0) for c in prompt]], device=device)
    for _ in range(length):
        logits = model(idx[:, -model.cfg.block_size :])[:, -1].float().cpu() / 0.8
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g).to(device)
        idx = torch.cat([idx, nxt], dim=1)
    return "".join(data.chars[i] for i in idx[0].tolist())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a DeepSpeed-style config (examples/configs/)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--block", type=int, default=64, help="characters per sequence")
    parser.add_argument("--no-sample", action="store_true", help="skip the text sample at the end")
    args = parser.parse_args(argv)

    config = json.loads(args.config.read_text())
    if "scheduler" in config:  # the schedule spans this run
        config["scheduler"]["params"]["total_num_steps"] = args.steps
        config["scheduler"]["params"]["warmup_num_steps"] = max(1, min(20, args.steps // 10))
    zero.init_distributed()
    torch.manual_seed(0)
    data = CharDataset(corpus(), block_size=args.block)
    gpt_config = GPTConfig(vocab_size=data.vocab_size, block_size=args.block, n_layer=args.layers, n_head=4,
                           n_embd=args.width)
    model = GPT(gpt_config)  # small enough to build whole (its __init__ re-initialises weights, which zero.Init would lose)
    engine, _, loader, _ = zero.initialize(model=model, config=config, training_data=data)
    rank, world = engine.comm.rank, engine.world_size
    if rank == 0:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(f"zero: {args.config.name} on {world} rank(s), {engine.device}; GPT with {n_params:,} parameters "
              f"on {len(data.data):,} characters; uniform-guess loss {math.log(data.vocab_size):.2f}", flush=True)

    monitor = zero.TrainingMonitor(engine, steps=args.steps, tokens_per_step=engine.config.train_batch_size * args.block,
                                   unit="char")
    epoch, losses = 0, []
    batches = iter(loader)
    while engine.global_steps < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            batches = iter(loader)
            continue
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        monitor.step(loss)
        losses.append(loss.item())
    table = monitor.report()
    text = ""
    if not args.no_sample:  # every rank runs the same sampling: under stage 3 each forward gathers collectively
        engine.eval()
        text = sample(engine.module, data, "ZeRO ", 240, engine.device)
    if rank == 0:
        print(table, end="")
        print(f"final loss {sum(losses[-20:]) / len(losses[-20:]):.3f} (mean of the last 20 micro-steps)")
        if text:
            print(f"sample: {text!r}")
    return {"first_loss": losses[0], "final_loss": sum(losses[-20:]) / len(losses[-20:]), "table": table,
            "summary": monitor.summary, "memory": engine.memory_report(), "rank": rank, "sample": text}


if __name__ == "__main__":
    main()

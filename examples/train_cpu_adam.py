"""Train a small GPT on generated arithmetic text with zero's CPU Adam, and report the loss.

    python examples/train_cpu_adam.py [--steps 200]

The text is sums like '12+7=19;' generated in-process, so nothing is downloaded. A model that
has learned something gets well below the loss of guessing uniformly (printed as the baseline).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from zero.ops import CPUAdam
from zero.testing.models import GPT, CharDataset, GPTConfig, arithmetic_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    data = CharDataset(arithmetic_corpus(200_000), block_size=32)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64))
    optimizer = CPUAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    print(f"GPT with {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"uniform-guess loss {math.log(data.vocab_size):.3f}")

    step, start, batches = 0, time.perf_counter(), iter(loader)
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % 25 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({(time.perf_counter() - start) / step * 1e3:.0f} ms/step)")
    print(f"final loss {loss.item():.3f}")


if __name__ == "__main__":
    main()

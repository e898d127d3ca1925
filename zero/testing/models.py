"""Small reference models: a GPT-style transformer and an MLP, plus synthetic data to train them.

They are plain `nn.Module`s with nothing zero-specific, so a test can train the same model with
zero and with plain PyTorch and compare. Sizes are chosen by the caller; defaults are tiny. The GPT
lives in zero.models (zero.tp's "gpt" plan and zero.sparse_attention know its blocks; library code
does not import test fixtures) and is re-exported here.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero.models import GPT, Block, GPTConfig  # noqa: F401 - the tests' and examples' import path


class MLP(nn.Module):
    """A stack of Linear+GELU layers with a regression loss: `forward(x, y)` returns MSE."""

    def __init__(self, sizes: tuple[int, ...] = (13, 31, 17, 5)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x if y is None else F.mse_loss(x, y)


def arithmetic_corpus(n_chars: int, seed: int = 0) -> str:
    """Text of sums like '12+7=19;' : a learnable next-character task that needs no download."""
    g = torch.Generator().manual_seed(seed)
    parts, length = [], 0
    while length < n_chars:
        a, b = torch.randint(0, 100, (2,), generator=g).tolist()
        s = f"{a}+{b}={a + b};"
        parts.append(s)
        length += len(s)
    return "".join(parts)[:n_chars]


class CharDataset(torch.utils.data.Dataset):
    """Fixed-length windows of a character corpus as (input, next-character target) pairs."""

    def __init__(self, text: str, block_size: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : i * self.block_size + self.block_size + 1]
        return chunk[:-1], chunk[1:]

"""Small reference models: a GPT-style transformer and an MLP, plus synthetic data to train them.

They are plain `nn.Module`s with nothing zero-specific, so a test can train the same model with
zero and with plain PyTorch and compare. Sizes are chosen by the caller; defaults are tiny.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-style decoder.

    Args:
        vocab_size: tokens in the vocabulary.
        block_size: longest sequence.
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: hidden size.
        tie_weights: share the token embedding with the output head.
        fused_qkv: one Linear for queries, keys and values; False: three (q, k, v), which a
            tensor-parallel plan can slice by heads (zero.tp's "gpt" plan needs it).
    """

    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    tie_weights: bool = True
    fused_qkv: bool = True


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # a key bias has zero gradient
        else:
            self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd, bias=False) for _ in range(3))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        # attention over (batch, heads, seq, head_dim) q, k, v; None: causal SDPA. Swapped by
        # zero.sparse_attention.replace_self_attention for block-sparse attention.
        self.attend: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(c, dim=2) if hasattr(self, "qkv") else (self.q(h), self.k(h), self.v(h))
        # heads from the width (-1): under tensor parallelism q, k and v hold this rank's heads only
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if self.attend is None else self.attend(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer. `forward(idx, targets=None)` returns logits, or the loss."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


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

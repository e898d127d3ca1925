"""Reference models the library knows by name: a GPT-style decoder (`GPT`, its `Block`s) and a 3D
U-Net (`UNet3D`, examples/train_unet3d.py; zero.spatial splits its volumes, the estimator and
benchmarks/bench_spatial.py size it).

zero.tp's "gpt" plan slices these blocks, and zero.sparse_attention.replace_self_attention swaps
their attention. They are plain `nn.Module`s with nothing zero-specific, so a test or an example
can train the same model with zero and with plain PyTorch and compare; zero.testing.models
re-exports them beside its MLP and synthetic data. Sizes are chosen by the caller; defaults are tiny.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


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
    """One pre-norm decoder block: causal self-attention, then a GELU MLP, each with a residual."""

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
        for table in (self.wte.weight, self.wpe.weight, self.head.weight):
            table.use_muon = False  # Muon's split goes by names with "embed"/"lm_head" (DeepSpeed's rule): these
            # tables are named otherwise, and stay with AdamW (see zero/optim/muon.py)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids`: each token's place in the whole sequence (a sequence-parallel rank's
        slice starts past 0); default 0, 1, ..."""
        pos = torch.arange(idx.shape[1], device=idx.device) if position_ids is None else position_ids
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class ConvBlock(nn.Sequential):
    """Two 3x3x3 convolutions, each followed by GroupNorm and SiLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU(),
                         nn.Conv3d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class UNet3D(nn.Module):
    """A U-Net with `depth` resolutions, `width` channels at the top, doubling at each level down.
    `checkpointing`: each conv block's activations are recomputed in backward instead of kept
    (torch.utils.checkpoint), leaving the block outputs."""

    def __init__(self, width: int = 16, depth: int = 3, cin: int = 1, cout: int = 1, checkpointing: bool = False):
        super().__init__()
        self.checkpointing = checkpointing
        chans = [width * 2**i for i in range(depth)]
        self.down = nn.ModuleList(ConvBlock(a, b) for a, b in zip([cin, *chans[:-1]], chans))
        self.up = nn.ModuleList(nn.ConvTranspose3d(chans[i + 1], chans[i], 2, stride=2) for i in range(depth - 1))
        self.merge = nn.ModuleList(ConvBlock(2 * chans[i], chans[i]) for i in range(depth - 1))
        self.head = nn.Conv3d(width, cout, 1)
        self.pool = nn.MaxPool3d(2)  # a module, not F.max_pool3d, so that zero.spatial can split it

    def _block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = self._block(block, x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = self.pool(x)
        for i in reversed(range(len(self.up))):
            x = self._block(self.merge[i], torch.cat([self.up[i](x), skips[i]], dim=1))
        return self.head(x)

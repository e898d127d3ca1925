"""Block layouts of sparse self-attention: DeepSpeed's `SparsityConfig` family, same names,
parameters and layouts.

A layout is a (num_heads, blocks, blocks) int64 tensor of 0/1 for a sequence of blocks * block
tokens: layout[h, i, j] = 1 when the queries of block i may attend to the keys of block j in head
h. `make_layout(seq_len)` builds it; seq_len must be a multiple of `block` (SparseSelfAttention
pads a sequence before asking). With `different_layout_per_head=False` (the default) head 0's
layout is computed and copied to every head.

[Note: random blocks]
DeepSpeed draws random blocks (Variable, BigBird) from Python's global `random`, so two ranks, or
two calls, get different layouts. Here they come from a torch.Generator seeded with the config's
`seed` (a keyword DeepSpeed lacks, default 0) at every `make_layout` call: every rank of a job and
every call build the same layout, which data parallelism needs. BigBird's unidirectional random
blocks are drawn among the row's past blocks; a row with fewer past blocks than
`num_random_blocks` takes all of them (DeepSpeed fails there). The draws depend on the layout's
length, so SparseSelfAttention refuses a sequence longer than its max_seq_length for such configs
rather than draw a longer layout whose corner would differ from the one used so far.
"""
from __future__ import annotations

import torch

ATTENTION_TYPES = ("bidirectional", "unidirectional")


def _check_attention(attention: str) -> str:
    if attention not in ATTENTION_TYPES:
        raise NotImplementedError(f"attention must be 'bidirectional' or 'unidirectional', got {attention!r}")
    return attention


def _check_positive(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_global_ranges(starts: list[int], ends: list[int] | None) -> None:
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in starts):
        raise ValueError(f"global_block_indices must be integers >= 0, got {starts!r}")
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_end_indices has {len(ends)} entries but global_block_indices has "
                         f"{len(starts)}; they must pair up")
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"global block start index {start} must be smaller than its end index {end}")


class SparsityConfig:
    """Shared part of every layout: heads, block size, one layout or one per head.

    Args:
        num_heads: attention heads of the layer.
        block: block size; the layout has one entry per block x block tile of the scores.
        different_layout_per_head: build each head's layout separately (random blocks and
            Fixed's global patterns then differ between heads); else head 0's is copied.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = _check_positive("num_heads", num_heads)
        self.block = _check_positive("block", block)
        self.different_layout_per_head = bool(different_layout_per_head)
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero (num_heads, seq_len / block, seq_len / block) int64 layout."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if seq_len % self.block:
            raise ValueError(f"seq_len {seq_len} is not a multiple of the block size {self.block}")
        blocks = seq_len // self.block
        if getattr(self, "_compact", False):  # see compact_layout
            return torch.zeros(self.num_layout_heads, blocks, blocks, dtype=torch.bool)
        return torch.zeros(self.num_heads, blocks, blocks, dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not define make_layout")

    def compact_layout(self, seq_len: int) -> torch.Tensor:
        """`make_layout(seq_len)` as bool, with one head when every head shares it: (num_layout_heads,
        blocks, blocks). What SparseSelfAttention keeps: at 262k tokens of block 64 and 12 shared
        heads, 16 MiB instead of make_layout's 1.5 GiB (the layout is (seq / block)^2 per head)."""
        self._compact = True
        try:
            return self.make_layout(seq_len)
        finally:
            self._compact = False

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k not in ("num_layout_heads", "_compact"))
        return f"{type(self).__name__}({fields})"


class DenseSparsityConfig(SparsityConfig):
    """Every block: dense attention in block-sparse form (for comparisons)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _local_windows(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Blocks start..end-1 attend to each other (to themselves and earlier ones if unidirectional)."""
    size = end - start
    window = torch.ones(size, size, dtype=layout.dtype)
    layout[h, start:end, start:end] = torch.tril(window) if unidirectional else window


def _sliding_window(layout: torch.Tensor, h: int, width: int, unidirectional: bool) -> None:
    """Row r attends to blocks r - width//2 .. r + width//2 (.. r when unidirectional)."""
    blocks = layout.shape[1]
    if blocks < width:
        raise ValueError(f"num_sliding_window_blocks ({width}) is larger than the {blocks} blocks of the sequence")
    half = width // 2
    r = torch.arange(blocks)
    offset = r[None, :] - r[:, None]  # column - row
    band = (offset >= -half) & (offset <= (0 if unidirectional else half))
    layout[h][band] = 1


class FixedSparsityConfig(SparsityConfig):
    """`Fixed` pattern of Sparse Transformers (Child et al. 2019), as DeepSpeed customised it.

    The sequence is cut into windows of `num_local_blocks` blocks that attend within themselves;
    in each window the last `num_global_blocks` blocks (with several global patterns: the ones
    before them, pattern h % num_different_global_patterns for head h) are global: every block
    row attends to them (unidirectional: every later row), and with `horizontal_global_attention`
    they attend to every block. A short last window takes its global blocks at the same offset,
    moved left to fit.

    Args:
        num_heads, block, different_layout_per_head: see SparsityConfig.
        num_local_blocks: blocks per local window.
        num_global_blocks: global blocks per window; must divide num_local_blocks.
        attention: "bidirectional" or "unidirectional".
        horizontal_global_attention: global blocks also attend to all blocks (bidirectional only).
        num_different_global_patterns: how many different global positions heads cycle through
            (needs different_layout_per_head; at most num_local_blocks / num_global_blocks).
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = _check_positive("num_local_blocks", num_local_blocks)
        self.num_global_blocks = _check_positive("num_global_blocks", num_global_blocks)
        if num_local_blocks % num_global_blocks:
            raise ValueError(f"num_local_blocks ({num_local_blocks}) must be a multiple of num_global_blocks "
                             f"({num_global_blocks})")
        self.attention = _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        _check_positive("num_different_global_patterns", num_different_global_patterns)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed "
                             f"num_local_blocks / num_global_blocks = {num_local_blocks // num_global_blocks}")
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks = layout.shape[1]
        for start in range(0, blocks, self.num_local_blocks):
            _local_windows(layout, h, start, min(start + self.num_local_blocks, blocks),
                           self.attention == "unidirectional")
        return layout

    def _global(self, h: int, layout: torch.Tensor, start: int, end: int) -> None:
        layout[h, 0 if self.attention == "bidirectional" else start :, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, g = layout.shape[1], self.num_global_blocks
        first = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * g  # offset in a window
        full = blocks - blocks % self.num_local_blocks  # blocks in complete windows
        for start in range(first, full, self.num_local_blocks):
            self._global(h, layout, start, start + g)
        if full < blocks:  # the short last window
            start = max(0, min(full + first, blocks - g))
            self._global(h, layout, start, min(start + g, blocks))
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """`Fixed` extended: random blocks, local windows of varying sizes, explicit global blocks.

    Args:
        num_heads, block, different_layout_per_head: see SparsityConfig.
        num_random_blocks: random key blocks per block row (see [Note: random blocks]).
        local_window_blocks: sizes of the consecutive local windows; the last size repeats to
            the end of the sequence.
        global_block_indices: global blocks (every row attends to them; unidirectional: every
            row from theirs on). With global_block_end_indices, the starts of global ranges.
        global_block_end_indices: optional exclusive ends of the global ranges.
        attention: "bidirectional" or "unidirectional".
        horizontal_global_attention: global blocks also attend to all blocks (bidirectional only).
        seed: seed of the random blocks.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: list[int] | None = None,
                 global_block_indices: list[int] | None = None, global_block_end_indices: list[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False, *, seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _check_positive("num_random_blocks", num_random_blocks, 0)
        self.local_window_blocks = list(local_window_blocks) if local_window_blocks is not None else [4]
        if not self.local_window_blocks:
            raise ValueError("local_window_blocks must name at least one window size")
        for size in self.local_window_blocks:
            _check_positive("each of local_window_blocks", size)
        self.global_block_indices = list(global_block_indices) if global_block_indices is not None else [0]
        self.global_block_end_indices = list(global_block_end_indices) if global_block_end_indices is not None else None
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        self.attention = _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        blocks = layout.shape[1]
        if blocks < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) is larger than the {blocks} blocks "
                             f"of the sequence")
        for row in range(blocks):
            layout[h, row, torch.randperm(blocks, generator=generator)[: self.num_random_blocks]] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, start = layout.shape[1], 0
        sizes = iter(self.local_window_blocks)
        size = self.local_window_blocks[-1]
        while start < blocks:
            size = next(sizes, size)
            _local_windows(layout, h, start, min(start + size, blocks), self.attention == "unidirectional")
            start += size
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start >= blocks:
                continue
            end = min(end, blocks)
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, 0 if self.attention == "bidirectional" else start :, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        generator = torch.Generator().manual_seed(self.seed)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, generator)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020): random blocks, a sliding window, and global blocks 0..g-1
    that attend to and are attended by every block. Unidirectional keeps the lower triangle.

    Args:
        num_heads, block, different_layout_per_head: see SparsityConfig.
        num_random_blocks: random key blocks per block row (see [Note: random blocks]).
        num_sliding_window_blocks: width of the window centred on the diagonal.
        num_global_blocks: the first blocks that are global.
        attention: "bidirectional" or "unidirectional".
        seed: seed of the random blocks.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional", *, seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _check_positive("num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = _check_positive("num_sliding_window_blocks", num_sliding_window_blocks)
        self.num_global_blocks = _check_positive("num_global_blocks", num_global_blocks, 0)
        self.attention = _check_attention(attention)
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        blocks = layout.shape[1]
        if blocks < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) is larger than the {blocks} blocks "
                             f"of the sequence")
        for row in range(blocks):
            choices = blocks if self.attention == "bidirectional" else row + 1
            layout[h, row, torch.randperm(choices, generator=generator)[: self.num_random_blocks]] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, unidirectional=False)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, g = layout.shape[1], self.num_global_blocks
        if blocks < g:
            raise ValueError(f"num_global_blocks ({g}) is larger than the {blocks} blocks of the sequence")
        layout[h, :g, :] = 1
        layout[h, :, :g] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        generator = torch.Generator().manual_seed(self.seed)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, generator)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): a sliding window plus global blocks that
    attend to and are attended by every block. Unidirectional keeps the lower triangle.

    Args:
        num_heads, block, different_layout_per_head: see SparsityConfig.
        num_sliding_window_blocks: width of the window centred on the diagonal.
        global_block_indices: global blocks, or with global_block_end_indices the starts of
            global ranges.
        global_block_end_indices: optional exclusive ends of the global ranges.
        attention: "bidirectional" or "unidirectional".
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: list[int] | None = None,
                 global_block_end_indices: list[int] | None = None, attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = _check_positive("num_sliding_window_blocks", num_sliding_window_blocks)
        self.global_block_indices = list(global_block_indices) if global_block_indices is not None else [0]
        self.global_block_end_indices = list(global_block_end_indices) if global_block_end_indices is not None else None
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        self.attention = _check_attention(attention)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, unidirectional=False)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start < blocks:
                layout[h, start : min(end, blocks), :] = 1
                layout[h, :, start : min(end, blocks)] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window only: row r attends to blocks r - w//2 .. r + w//2 (.. r unidirectional).

    Args:
        num_heads, block: see SparsityConfig (one layout for all heads).
        num_sliding_window_blocks: width w of the window.
        attention: "unidirectional" (the default here) or "bidirectional".
    """

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = _check_positive("num_sliding_window_blocks", num_sliding_window_blocks)
        self.attention = _check_attention(attention)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, self.attention == "unidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)

"""The declared optimizer state a storage allocates (see [Note: declared state] in zero/optim/rules.py):
the contract between the update rules, which declare it, and the storages and the state store,
which hold it."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from zero.ops.adam_formats import q8_blocks


class StateSpec(NamedTuple):
    """One tensor of optimizer state a rule keeps for each slot.

    Args:
        name: its name in checkpoints and accessors ("exp_avg", "momentum_buffer", "sum", "step").
        dtype: as stored.
        per: "element" (as long as the slot's master), "block" (one per Q8_BLOCK elements: 8-bit
            moments' scales) or "scalar" (one value per slot: a torch optimizer's `step`).
        scales: for 8-bit codes, the name of the "block" state holding their scales (checkpoints
            and accessors see the codes' exact values, decoded, under `name`).
    """

    name: str
    dtype: torch.dtype
    per: str = "element"
    scales: str | None = None

    def numel(self, n: int) -> int:
        """Elements of this state for a slot of `n` elements."""
        return n if self.per == "element" else q8_blocks(n) if self.per == "block" else 1


def saved_specs(specs: tuple[StateSpec, ...]) -> tuple[StateSpec, ...]:
    """The specs a checkpoint holds as tensors of their own (block scales travel inside their codes)."""
    return tuple(s for s in specs if s.per != "block")


StateSpecs = Callable[[int], tuple[StateSpec, ...]]  # param-group index -> its declared state

"""`deepspeed.checkpoint.utils`."""
from __future__ import annotations

import torch

from zero.deepspeed._missing import missing


def clone_tensors_for_torch_save(item, device: torch.device | str = "cpu"):
    """`item` (tensors in lists, tuples and dicts) with every tensor copied to `device`, so that
    `torch.save` writes each tensor alone rather than the whole storage it is a view of."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def __getattr__(name: str):
    return missing(__name__, name)

"""What zero asks of autograd: whether a backward is running, and the tensors inside a module's output."""
from __future__ import annotations

import dataclasses

import torch


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj) -> list[torch.Tensor]:
    """Tensors inside a module output: a tensor, tuples/lists/dicts of them (HF outputs), dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_in(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def graph_outputs(obj) -> list[torch.Tensor]:
    """The tensors of a module output that a backward will pass through: those that require grad
    and were computed (not leaves: a hook on a leaf would stay on it for good)."""
    return [t for t in tensors_in(obj) if t.requires_grad and t.grad_fn is not None]

"""What zero asks of autograd: whether a backward is running, and the tensors inside a module's output."""
from __future__ import annotations

import dataclasses

import torch


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj, depth: int = 4) -> list[torch.Tensor]:
    """Tensors inside a module output: a tensor, tuples/lists/dicts of them (HF outputs),
    dataclasses, and the attributes of a plain object holding them; `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type, torch.nn.Module)) or obj is None:
        return []
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x, depth - 1)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_in(x, depth - 1)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name), depth - 1)]
    if hasattr(obj, "__dict__") and not callable(obj):  # a plain object of the model's own
        return [t for x in vars(obj).values() for t in tensors_in(x, depth - 1)]
    return []


def graph_outputs(obj) -> list[torch.Tensor]:
    """The tensors of a module output that a backward will pass through: those that require grad
    and were computed (not leaves: a hook on a leaf would stay on it for good)."""
    return [t for t in tensors_in(obj) if t.requires_grad and t.grad_fn is not None]

"""Tensors sliced over tensor-parallel ranks (DTensors): what this rank stores of them, how a tensor
is sliced, and HuggingFace's Conv1D (whose slicing is the transposed nn.Linear's)."""
from __future__ import annotations

import torch
import torch.nn as nn

# [Note: sliced parameters]
# Under tensor parallelism a parameter is a DTensor: the module sees the whole (global) tensor,
# and each tensor-parallel rank stores its own piece of it, `_local_tensor`. ZeRO partitions
# what a rank stores: the flat buffers hold local pieces, `local.data` becomes the view (the
# DTensor object and the module are untouched), and gradients arrive as DTensors whose local
# piece is what is reduced over the data-parallel group. Stage 3 shards the local piece the same
# way: its units gather and free `local.data`, and `param._zero` describes the local piece.


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of `t`: a DTensor's local piece, else `t` itself."""
    return getattr(t, "_local_tensor", t)


def slicing(t: torch.Tensor) -> tuple[int, int] | None:
    """(dimension, split factor) of a tensor sliced over a one-dimensional mesh: (d, 1) for
    Shard(d), (d, s) for a strided slice of s parts ([Note: fused q/k/v slices] in
    zero/tp/styles.py); None for a plain tensor or a replicated DTensor."""
    from torch.distributed.tensor import Shard

    placements = tuple(getattr(t, "placements", ()))
    if len(placements) > 1:
        raise ValueError(f"a DTensor placed {placements} on a {len(placements)}-dimensional mesh: zero handles "
                         f"tensors sliced over one (tensor-parallel) mesh dimension")
    if not placements:
        return None
    p = placements[0]
    split = getattr(p, "split_factor", None)
    if split is not None:  # _StridedShard, a Shard subclass in older torch and not in 2.13
        return p.dim, int(split)
    if isinstance(p, Shard):
        return p.dim, 1
    return None


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad` as this rank stores it (a DTensor gradient laid out as its parameter first)."""
    grad = param.grad
    if grad is None or not hasattr(grad, "_local_tensor"):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        sliced, grad_sliced = slicing(param), slicing(grad)
        # a gradient sliced along its parameter's dimension is laid out as its parameter's piece
        # (it was computed from it); only the label may lack a strided slice's split factor
        if sliced is None or grad_sliced is None or grad_sliced[0] != sliced[0]:
            grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def is_conv1d(module: nn.Module) -> bool:
    """HuggingFace's Conv1D (found by shape, so transformers need not be imported): a [nx, nf]
    weight and an [nf] bias."""
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    return (hasattr(module, "nf") and hasattr(module, "nx") and isinstance(w, torch.Tensor)
            and tuple(w.shape) == (module.nx, module.nf) and (b is None or tuple(b.shape) == (module.nf,)))

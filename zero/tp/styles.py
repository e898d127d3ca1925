"""Tensor-parallel styles for HuggingFace's `Conv1D` (GPT-2's linear layer, weight [in, out]),
which torch's ColwiseParallel and RowwiseParallel do not take (they slice nn.Linear and
nn.Embedding), and for GPT-2's attention, whose q, k and v come from one fused Conv1D.

[Note: fused q/k/v slices]
GPT-2's `c_attn` computes q, k and v as one [E, 3E] product, the three side by side. A rank that
keeps heads h..h' of attention needs those heads' columns from each of the three parts: columns
t of q, of k and of v, not a contiguous third. torch describes that piece with `_StridedShard(1,
split_factor=3)`: the dimension is first cut into 3 (q, k, v), each part into T, and rank t holds
the t-th piece of every part, side by side. DTensor's full_tensor and redistribute read it
correctly, so the model, state_dict and checkpoints see the fused weight in its usual order.
`_StridedShard` is private in torch (2.11-2.13 have it; 2.13 made it no longer a `Shard`);
`zero.parallel.sliced.slicing()` reads both kinds, and is what the rest of zero asks.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from zero.parallel.sliced import is_conv1d

__all__ = ["Conv1DColwise", "Conv1DRowwise", "GPT2AttentionHeads"]


def _strided(dim: int, split: int) -> Placement:
    """Shard(dim), or the strided slice of `split` parts ([Note: fused q/k/v slices])."""
    if split == 1:
        return Shard(dim)
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split)


def _replace(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    p = getattr(module, name)
    if p is not None:
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))


def _as_dtensor(placement):
    def prepare(module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [placement], run_check=False)
        return (x, *inputs[1:])
    return prepare


def _check(module: nn.Module, what: str) -> None:
    if not is_conv1d(module):
        raise ValueError(f"{what} slices a HuggingFace Conv1D (weight [nx, nf]), not a {type(module).__name__}; "
                         f"for nn.Linear use torch's ColwiseParallel / RowwiseParallel")


def _check_local_forward(module: nn.Module) -> None:
    """A strided slice's forward must be each rank's own piece computed locally. torch's sharding
    rules for `_StridedShard` are private and have changed between versions; a version that
    re-slices the output contiguously would train on the wrong q, k and v columns without any
    error, so this compares a probe's output with the local product now (no communication)."""
    w, b = module.weight.to_local(), module.bias.to_local() if module.bias is not None else None
    if w.device.type == "meta":
        return
    with torch.no_grad():
        x = torch.linspace(-1, 1, 2 * module.nx, dtype=w.dtype, device=w.device).view(2, module.nx)
        got, want = module(x), x @ w + (b if b is not None else 0)
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3):
        raise RuntimeError(f"torch {torch.__version__}'s DTensor does not compute a strided (fused q/k/v) slice "
                           f"locally, so the sliced layer would compute the wrong columns; use torch 2.13 or later "
                           f"for this slicing")


class Conv1DColwise(ParallelStyle):
    """Slice a Conv1D's outputs: each tensor rank computes its columns from the whole input, and
    gets them back as a plain tensor (the input's gradient is summed over the ranks in backward).

    Args:
        split: cut the outputs into this many equal parts first (3: q, k and v) and give each
            rank its piece of every part ([Note: fused q/k/v slices]).
    """

    def __init__(self, split: int = 1):
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check(module, "Conv1DColwise")
        if module.nf % (self.split * device_mesh.size()):
            raise ValueError(f"Conv1DColwise(split={self.split}) on {device_mesh.size()} ranks: the layer's "
                             f"{module.nf} outputs must be a multiple of {self.split * device_mesh.size()}")

        def partition(name, m, mesh):
            if m is module:
                _replace(m, "weight", mesh, _strided(1, self.split))
                _replace(m, "bias", mesh, _strided(0, self.split))

        distribute_module(module, device_mesh, partition, _as_dtensor(Replicate()), lambda m, out, mesh: out.to_local())
        if self.split > 1:
            _check_local_forward(module)
        return module


class Conv1DRowwise(ParallelStyle):
    """Slice a Conv1D's inputs (the outputs of a column-sliced layer before it): each tensor rank
    multiplies its piece, the partial products are summed over the ranks in forward, and every
    rank gets the whole output (the bias is added once)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check(module, "Conv1DRowwise")
        if module.nx % device_mesh.size():
            raise ValueError(f"Conv1DRowwise on {device_mesh.size()} ranks: the layer's {module.nx} inputs must be a "
                             f"multiple of {device_mesh.size()}")

        def partition(name, m, mesh):
            if m is module:
                _replace(m, "weight", mesh, Shard(0))
                _replace(m, "bias", mesh, Replicate())

        return distribute_module(module, device_mesh, partition, _as_dtensor(Shard(-1)),
                                 lambda m, out, mesh: out.redistribute(mesh, [Replicate()]).to_local())


class GPT2AttentionHeads(ParallelStyle):
    """Slice a HuggingFace GPT2Attention by heads: its fused `c_attn` into each rank's q, k and v
    columns, its `c_proj` by rows, and the module's head count and q/k/v split size to this
    rank's share (its forward reads heads from the tensors' shapes)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()
        if not all(hasattr(module, a) for a in ("c_attn", "c_proj", "split_size", "num_heads")):
            raise ValueError(f"GPT2AttentionHeads slices a HuggingFace GPT2Attention, not a {type(module).__name__}")
        if getattr(module, "is_cross_attention", False):
            raise ValueError("GPT2AttentionHeads: cross-attention (add_cross_attention=True) is not sliced; slice "
                             "the self-attention layers only, or leave the model unsliced")
        if module.num_heads % size:
            raise ValueError(f"GPT2AttentionHeads on {size} tensor-parallel ranks: the {module.num_heads} heads must "
                             f"be a multiple of {size}")
        Conv1DColwise(split=3)._apply(module.c_attn, device_mesh)
        Conv1DRowwise()._apply(module.c_proj, device_mesh)
        module.num_heads //= size
        module.split_size //= size
        return module

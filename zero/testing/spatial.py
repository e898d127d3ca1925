"""The spatial tests' comparison: a module over a volume split across the group against the same
module unsplit, for one forward and backward (zero/spatial/)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zero.parallel.comm import Comm


@dataclass
class Compared:
    """errors: the largest difference of the output slab ("output"), the input gradient
    ("grad_input") and the group's summed parameter gradients ("grad_params") from the unsplit
    module's; `out`: this rank's output slab; `ref_out`, `ref`: the unsplit output and module."""

    errors: dict[str, float]
    out: torch.Tensor
    ref_out: torch.Tensor
    ref: nn.Module


def compare_with_unsplit(module: nn.Module, x: torch.Tensor, comm: Comm, seed: int = 2, dim=2) -> Compared:
    """Run a copy of `module` on the whole `x` (every rank passes the same), then convert `module`
    (zero.spatial.parallelize) and run it on this rank's slab, both backward from the same random
    output gradient (drawn from `seed`); `dim`: the split dimension, or a grid's dimensions."""
    import zero.spatial as sp

    ref = copy.deepcopy(module)
    xr = x.clone().requires_grad_()
    ref_out = ref(xr)
    gy = torch.randn(ref_out.shape, dtype=ref_out.dtype, generator=torch.Generator().manual_seed(seed))
    (ref_out * gy).sum().backward()
    sp.parallelize(module, comm, dim)
    xs = sp.shard_volume(x, comm, dim).requires_grad_()
    out = module(xs)
    (out * sp.shard_volume(gy, comm, dim)).sum().backward()
    worst_param = 0.0
    for p, q in zip(module.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # the group's parameter gradients sum to the unsplit one
        worst_param = max(worst_param, (g - q.grad).abs().max().item())
    errors = {"output": (out - sp.shard_volume(ref_out.detach(), comm, dim)).abs().max().item(),
              "grad_input": (xs.grad - sp.shard_volume(xr.grad, comm, dim)).abs().max().item(),
              "grad_params": worst_param}
    return Compared(errors, out, ref_out.detach(), ref)

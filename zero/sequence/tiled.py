"""Tiled compute over the sequence: an MLP, and the vocabulary projection with its loss, applied one
sequence tile at a time so that their large intermediates (the MLP's 4x-wide hidden activations,
the sequence x vocabulary logits) never exist whole.

[Note: tiles with recomputation]
Forward runs `fn` on each tile without recording a graph and keeps only its input. Backward runs
each tile again with a graph and differentiates it at once, so one tile's intermediates are alive
at a time in either pass. The parameters `fn` uses are inputs of the autograd node (the
`compute_params` DeepSpeed's API passes), and their gradients, summed over the tiles, leave the node
once: a parameter's gradient hook fires once per backward, as ZeRO's reductions expect, not once
per tile. Under ZeRO-3 the recomputation gathers the parameters as activation checkpointing does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _tiles(x: torch.Tensor, shards: int) -> list[torch.Tensor]:
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    if x.dim() < 2:
        raise ValueError(f"tiled compute splits dimension 1 (the sequence) of its input, which has shape {tuple(x.shape)}")
    return list(torch.tensor_split(x, min(shards, max(1, x.size(1))), dim=1))


def _grads(outputs, inputs: list[torch.Tensor], grad_outputs) -> list[torch.Tensor | None]:
    wanted = [t for t in inputs if t.requires_grad]
    got = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True)) if wanted else iter(())
    return [next(got) if t.requires_grad else None for t in inputs]


def _add(total: list, grads: list) -> list:
    return [g if t is None else t if g is None else t + g for t, g in zip(total, grads)]


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, module, x: torch.Tensor, shards: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards, ctx.params = fn, module, shards, params  # parameters: leaves, kept as is
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, t) for t in _tiles(x, shards)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,), params = ctx.saved_tensors, list(ctx.params)
        x_grads, param_grads = [], [None] * len(params)
        sizes = [t.size(1) for t in _tiles(x, ctx.shards)]
        for t, g in zip(_tiles(x.detach(), ctx.shards), torch.split(grad, sizes, dim=1)):
            t = t.requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, t)
            got = _grads(out, [t, *params], g)
            x_grads.append(got[0])
            param_grads = _add(param_grads, got[1:])
        dx = torch.cat(x_grads, dim=1) if x.requires_grad else None
        return (None, None, dx, None, *param_grads)


class TiledMLP:
    """DeepSpeed's `ulysses_sp.TiledMLP`: `TiledMLP.apply(fn, self, x, shards, compute_params)` is
    `fn(self, x)` computed in `shards` tiles of the sequence (dimension 1 of x) with recomputation
    in backward (see [Note: tiles with recomputation]). `compute_params`: the parameters `fn` uses."""

    @staticmethod
    def apply(fn: Callable, module, x: torch.Tensor, shards: int, compute_params: Sequence[torch.Tensor] = ()):
        return _TiledMLP.apply(fn, module, x, shards, *list(compute_params or ()))


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, module, x: torch.Tensor, y: torch.Tensor, mask, shards: int, reduction: str,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards, ctx.reduction, ctx.mask = fn, module, shards, reduction, mask
        ctx.params = params
        ctx.save_for_backward(x, y)
        with torch.no_grad():
            total = sum(w * fn(module, xt, yt, mt) for w, xt, yt, mt in _loss_tiles(x, y, mask, shards, reduction))
        return total.detach() if isinstance(total, torch.Tensor) else torch.tensor(float(total))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x, y), params = ctx.saved_tensors, list(ctx.params)
        x_grads, param_grads = [], [None] * len(params)
        for w, xt, yt, mt in _loss_tiles(x.detach(), y, ctx.mask, ctx.shards, ctx.reduction):
            xt = xt.requires_grad_(x.requires_grad)
            with torch.enable_grad():
                loss = w * ctx.fn(ctx.module, xt, yt, mt)
            got = _grads(loss, [xt, *params], grad)
            x_grads.append(got[0] if got[0] is not None else torch.zeros_like(xt))
            param_grads = _add(param_grads, got[1:])
        dx = torch.cat(x_grads, dim=1) if x.requires_grad else None
        return (None, None, dx, None, None, None, None, *param_grads)


def _loss_tiles(x, y, mask, shards: int, reduction: str):
    """(weight, x tile, y tile, mask tile) per tile; "mean" weights each tile's loss by its share of
    the sequence (the exact mean when `fn` returns each tile's mean over equally weighted positions)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"output_reduction must be 'mean' or 'sum', got {reduction!r}")
    xs = _tiles(x, shards)
    sizes = [t.size(1) for t in xs]
    ys = torch.split(y, sizes, dim=1)
    ms = torch.split(mask, sizes, dim=1) if mask is not None else [None] * len(xs)
    total = sum(sizes)
    for xt, yt, mt, n in zip(xs, ys, ms, sizes):
        yield (n / total if reduction == "mean" else 1.0), xt, yt, mt


class TiledFusedLogitsLoss:
    """DeepSpeed's `ulysses_sp.TiledFusedLogitsLoss`: `TiledFusedLogitsLoss.apply(fn, self, x, y,
    mask, shards, compute_params, output_reduction)` is the loss `fn(self, x, y, mask)` (the
    vocabulary projection and the loss, fused) computed in `shards` tiles of the sequence, so the
    logits of one tile exist at a time (see [Note: tiles with recomputation]). "mean" averages the
    tiles' losses weighted by their lengths, "sum" adds them."""

    @staticmethod
    def apply(fn: Callable, module, x: torch.Tensor, y: torch.Tensor, mask, shards: int,
              compute_params: Sequence[torch.Tensor] = (), output_reduction: str = "mean"):
        return _TiledLoss.apply(fn, module, x, y, mask, shards, output_reduction, *list(compute_params or ()))

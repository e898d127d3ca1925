"""Tiled compute over the sequence: an MLP, the vocabulary projection with its loss, or any function
of sequence-shaped tensors (`sequence_tiled_compute`), applied one sequence tile at a time so that
their large intermediates (the MLP's 4x-wide hidden activations, the sequence x vocabulary logits)
never exist whole.

[Note: tiles with recomputation]
Forward runs `fn` on each tile without recording a graph and keeps only its input. Backward runs
each tile again with a graph and differentiates it at once, so one tile's intermediates are alive
at a time in either pass. The parameters `fn` uses are inputs of the autograd node (the
`compute_params` DeepSpeed's API passes), and their gradients, summed over the tiles, leave the node
once: a parameter's gradient hook fires once per backward, as ZeRO's reductions expect, not once
per tile. Under ZeRO-3 the recomputation gathers the parameters as activation checkpointing does.
`sequence_tiled_compute` also takes no `compute_params` (DeepSpeed's default, None) or an
incomplete list: the leaves requiring grad that a tile's graph reaches beyond its inputs and the
listed parameters then accumulate their gradients tile by tile, as plain autograd (and DeepSpeed)
would. The values are the same; ZeRO 2/3 reduce such a gradient once per tile (their late-gradient
path keeps the sum exact), so list the parameters to have them reduced once.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zero.sequence.data import IGNORE


def _tiles(x: torch.Tensor, shards: int) -> list[torch.Tensor]:
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    if x.dim() < 2:
        raise ValueError(f"tiled compute splits dimension 1 (the sequence) of its input, which has shape {tuple(x.shape)}")
    return list(torch.tensor_split(x, min(shards, max(1, x.size(1))), dim=1))


def _grads(outputs, inputs: list[torch.Tensor], grad_outputs, retain_graph: bool = False) -> list[torch.Tensor | None]:
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad(outputs, wanted, grad_outputs, retain_graph=retain_graph, allow_unused=True))
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
            total = sum(w * _call(fn, module, xt, yt, mt) for w, xt, yt, mt in _loss_tiles(x, y, mask, shards, reduction)
                        if w)
        return total.detach() if isinstance(total, torch.Tensor) else x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x, y), params = ctx.saved_tensors, list(ctx.params)
        x_grads, param_grads = [], [None] * len(params)
        for w, xt, yt, mt in _loss_tiles(x.detach(), y, ctx.mask, ctx.shards, ctx.reduction):
            if not w:
                x_grads.append(torch.zeros_like(xt))
                continue
            xt = xt.requires_grad_(x.requires_grad)
            with torch.enable_grad():
                loss = w * _call(ctx.fn, ctx.module, xt, yt, mt)
            got = _grads(loss, [xt, *params], grad)
            x_grads.append(got[0] if got[0] is not None else torch.zeros_like(xt))
            param_grads = _add(param_grads, got[1:])
        dx = torch.cat(x_grads, dim=1) if x.requires_grad else None
        return (None, None, dx, None, None, None, None, *param_grads)


def _call(fn: Callable, module, x: torch.Tensor, y: torch.Tensor, mask):
    """`fn(module, x, y)`, or `fn(module, x, y, mask)` when there is a mask (DeepSpeed's call)."""
    return fn(module, x, y) if mask is None else fn(module, x, y, mask)


def _loss_tiles(x, y, mask, shards: int, reduction: str):
    """(weight, x tile, y tile, mask tile) per tile. "mean" weighs each tile's loss by its share of
    the positions that count (the mask's nonzero ones, else the labels that are not -100 when `y`
    holds class labels, else all): the exact mean when `fn` returns its tile's mean. Weight 0: a tile
    with none, which is not computed (its gradient is zero, where its own mean would be 0/0)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"output_reduction must be 'mean' or 'sum', got {reduction!r}")
    xs = _tiles(x, shards)
    sizes = [t.size(1) for t in xs]
    ys = torch.split(y, sizes, dim=1)
    ms = torch.split(mask, sizes, dim=1) if mask is not None else [None] * len(xs)
    if reduction == "mean" and (mask is not None or not y.is_floating_point()):  # one device sync
        counts = torch.stack([mt.count_nonzero() if mt is not None else (yt != IGNORE).sum()
                              for yt, mt in zip(ys, ms)]).tolist()
    else:
        counts = sizes
    total = max(1, sum(counts))
    for xt, yt, mt, n in zip(xs, ys, ms, counts):
        yield (1.0 if reduction == "sum" else n / total), xt, yt, mt


class TiledFusedLogitsLoss:
    """DeepSpeed's `ulysses_sp.TiledFusedLogitsLoss`: `TiledFusedLogitsLoss.apply(fn, self, x, y,
    mask, shards, compute_params, output_reduction)` is the loss `fn(self, x, y)` (`fn(self, x, y,
    mask)` with a mask: the vocabulary projection and the loss, fused) computed in `shards` tiles of
    the sequence, so the logits of one tile exist at a time (see [Note: tiles with recomputation]).
    "sum" adds the tiles' losses. "mean" weighs each tile's (mean) loss by its share of the positions
    that count: the mask's nonzero ones, else the labels that are not -100 (class labels), else all;
    a tile with none is skipped. That is the mean over the whole sequence, where DeepSpeed's plain
    mean of the tiles differs when tiles count different numbers of positions."""

    @staticmethod
    def apply(fn: Callable, module, x: torch.Tensor, y: torch.Tensor, mask, shards: int,
              compute_params: Sequence[torch.Tensor] = (), output_reduction: str = "mean"):
        return _TiledLoss.apply(fn, module, x, y, mask, shards, output_reduction, *list(compute_params or ()))


# ------------------------------------------------------------------------------ sequence_tiled_compute

@dataclass(frozen=True)
class _Tiling:
    """A checked `sequence_tiled_compute` call: the keys of the sharded and of the passed tensors (in
    the order of the autograd node's inputs), the passed non-tensors, the tile lengths, and how the
    tiles' outputs are put together."""

    fn: Callable
    shard_keys: tuple[str, ...]
    pass_keys: tuple[str, ...]
    constants: Mapping[str, Any]
    sizes: tuple[int, ...]
    dim: int
    reduction: str | None

    def call(self, tile: Sequence[torch.Tensor], passed: Sequence[torch.Tensor]):
        return self.fn(**dict(zip(self.shard_keys, tile)), **dict(zip(self.pass_keys, passed)), **self.constants)

    def weight(self, i: int, tile_numel: int, total_numel: int) -> float:
        """The factor of tile i's output sum in the reduction. "mean" is the mean of the
        concatenated output; with one output per tile stacked on dimension 0 (a loss per tile),
        each tile's mean is weighted by its share of the sequence, which is the untiled mean when
        `fn` returns its tile's mean over equally weighted positions."""
        if self.reduction == "sum":
            return 1.0
        if self.dim == 0:
            return self.sizes[i] / sum(self.sizes) / max(tile_numel, 1)
        return 1.0 / max(total_numel, 1)


def _plan(fn: Callable, seqlen: int, shards: int, keys_to_shard: Sequence[str], keys_to_pass: Sequence[str],
          grad_requiring_tensor_key: str, output_unshard_dimension: int, output_reduction: str | None,
          args: Sequence[Any]) -> tuple[_Tiling, list[torch.Tensor], list[torch.Tensor]]:
    """Check the arguments, each error naming the argument at fault; return the tiling, the sharded
    tensors and the passed tensors."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
        raise ValueError(f"seqlen must be an int >= 1 (the length of dimension 1 of kwargs_to_shard's tensors), "
                         f"got {seqlen!r}")
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}")
    if not isinstance(output_unshard_dimension, int) or isinstance(output_unshard_dimension, bool):
        raise TypeError(f"output_unshard_dimension must be an int, got {output_unshard_dimension!r}")
    keys_to_shard, keys_to_pass = list(keys_to_shard), list(keys_to_pass)
    if len(args) != len(keys_to_shard) + len(keys_to_pass):
        raise ValueError(f"{len(args)} values for {len(keys_to_shard)} keys to shard and {len(keys_to_pass)} keys to "
                         "pass: give the values of kwargs_to_shard, then those of kwargs_to_pass")
    if not keys_to_shard:
        raise ValueError("kwargs_to_shard is empty: give at least the tensor to tile, under grad_requiring_tensor_key")
    both = sorted(set(keys_to_shard) & set(keys_to_pass))
    if both:
        raise ValueError(f"key(s) {both} are in both kwargs_to_shard and kwargs_to_pass: give each argument of fn once")
    if grad_requiring_tensor_key not in keys_to_shard:
        where = "is in kwargs_to_pass, which is not tiled" if grad_requiring_tensor_key in keys_to_pass else \
            "is missing from kwargs_to_shard"
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} {where}: it must name one of "
                         f"kwargs_to_shard's tensors (keys: {keys_to_shard})")
    sharded, values = list(args[:len(keys_to_shard)]), args[len(keys_to_shard):]
    for key, t in zip(keys_to_shard, sharded):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kwargs_to_shard[{key!r}] is a {type(t).__name__}, not a tensor: every value of "
                            "kwargs_to_shard is sliced along dimension 1; pass other values in kwargs_to_pass")
        if t.dim() < 2 or t.size(1) != seqlen:
            raise ValueError(f"kwargs_to_shard[{key!r}] has shape {tuple(t.shape)}: its dimension 1 (the sequence) "
                             f"must have seqlen={seqlen} elements")
    pass_keys = tuple(k for k, v in zip(keys_to_pass, values) if isinstance(v, torch.Tensor))
    passed = [v for v in values if isinstance(v, torch.Tensor)]
    constants = {k: v for k, v in zip(keys_to_pass, values) if not isinstance(v, torch.Tensor)}
    n = min(shards, seqlen)
    sizes = tuple(seqlen // n + (i < seqlen % n) for i in range(n))  # lengths differ by one at most
    tiling = _Tiling(fn, tuple(keys_to_shard), pass_keys, constants, sizes, output_unshard_dimension,
                     output_reduction)
    return tiling, sharded, passed


def _params(compute_params, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """compute_params, each once and none that is already an input (a gradient returned twice
    for one tensor would be added twice)."""
    seen, out = {id(t) for t in inputs}, []
    for i, p in enumerate(compute_params or ()):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"compute_params[{i}] is a {type(p).__name__}, not a tensor: give the parameters fn uses")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _other_leaves(out: torch.Tensor, known: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that `out`'s graph reaches, other than `known`."""
    skip, seen, found = {id(t) for t in known}, set(), []
    todo = [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if leaf is not None:
            if id(leaf) not in skip and leaf.requires_grad:
                found.append(leaf)
        else:
            todo.extend(f for f, _ in node.next_functions)
    return found


def _tile_backward(out: torch.Tensor, seed: torch.Tensor, own: list[torch.Tensor],
                   params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of `out` (seeded with `seed`) for `own` (the tile's detached inputs) and
    `params` (compute_params), None where one needs none; leaves beyond them accumulate theirs in
    `.grad` (see [Note: tiles with recomputation])."""
    if not out.requires_grad:
        return [None] * (len(own) + len(params))
    others = _other_leaves(out, [*own, *params])
    if not others:
        return _grads(out, [*own, *params], seed)
    if any(p.requires_grad for p in params):  # two passes: returned for the listed, accumulated for the others
        got = _grads(out, [*own, *params], seed, retain_graph=True)
        torch.autograd.backward(out, seed, inputs=others, retain_graph=True)
        return got
    wanted = [t for t in own if t.requires_grad]
    torch.autograd.backward(out, seed, inputs=wanted + others, retain_graph=True)
    got = [t.grad if t.requires_grad else None for t in own]
    for t in wanted:
        t.grad = None  # a passed tensor's leaf serves every tile: its gradients are added by the caller
    return got + [None] * len(params)


class _SequenceTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tiling: _Tiling, n_params: int, *inputs: torch.Tensor) -> torch.Tensor:
        n = len(tiling.shard_keys)
        split = len(inputs) - n_params
        sharded, passed = inputs[:n], inputs[n:split]
        ctx.tiling, ctx.params = tiling, inputs[split:]  # parameters: leaves, kept as is
        ctx.save_for_backward(*inputs[:split])
        outs, sums = [], []
        with torch.no_grad():
            for tile in zip(*(torch.split(t, tiling.sizes, dim=1) for t in sharded)):
                out = tiling.call(tile, passed)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"fn must return a tensor, returned a {type(out).__name__}")
                if out.dim() == 0 and tiling.dim != 0:
                    raise ValueError(f"fn returns a scalar per tile, which has no dimension {tiling.dim} to "
                                     "concatenate along: use output_unshard_dimension=0 (the tiles' outputs stacked)")
                if tiling.reduction is None:
                    outs.append(out)
                else:
                    sums.append((out.sum(), out.numel()))
        if tiling.reduction is not None:
            ctx.numel = sum(k for _, k in sums)
            return sum(tiling.weight(i, k, ctx.numel) * s for i, (s, k) in enumerate(sums))
        if tiling.dim == 0:
            return torch.stack(outs)
        ctx.out_sizes = [o.size(tiling.dim) for o in outs]
        return torch.cat(outs, dim=tiling.dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tiling, saved, params = ctx.tiling, ctx.saved_tensors, list(ctx.params)
        n = len(tiling.shard_keys)
        needs = ctx.needs_input_grad[2:]
        sharded = [t.detach() for t in saved[:n]]
        passed = [t.detach().requires_grad_(need) for t, need in zip(saved[n:], needs[n:])]
        shard_grads = [torch.zeros_like(t) if need else None for t, need in zip(sharded, needs[:n])]
        rest: list = [None] * (len(passed) + len(params))
        if tiling.reduction is not None:
            seeds = [grad] * len(tiling.sizes)
        elif tiling.dim == 0:
            seeds = list(grad.unbind(0))
        else:
            seeds = list(torch.split(grad, ctx.out_sizes, dim=tiling.dim))
        offset = 0
        for i, tile in enumerate(zip(*(torch.split(t, tiling.sizes, dim=1) for t in sharded))):
            tile = [t.requires_grad_(need) for t, need in zip(tile, needs[:n])]
            with torch.enable_grad():
                out = tiling.call(tile, passed)
                if tiling.reduction is not None:
                    out = tiling.weight(i, out.numel(), getattr(ctx, "numel", 0)) * out.sum()
            got = _tile_backward(out, seeds[i], [*tile, *passed], params)
            for total, g in zip(shard_grads, got[:n]):
                if total is not None and g is not None:
                    total.narrow(1, offset, tiling.sizes[i]).copy_(g)
            rest = _add(rest, got[n:])
            offset += tiling.sizes[i]
        return (None, None, *shard_grads, *rest)


class SequenceTiledCompute:
    """DeepSpeed's `ulysses_sp.SequenceTiledCompute`, the autograd function behind
    `sequence_tiled_compute`: `SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard,
    keys_to_pass, grad_requiring_tensor_key, compute_params, output_unshard_dimension,
    output_reduction, *args)`, where `args` are the values of `keys_to_shard` then those of
    `keys_to_pass`. See `sequence_tiled_compute`."""

    @staticmethod
    def apply(fn: Callable, seqlen: int, shards: int, keys_to_shard: Sequence[str], keys_to_pass: Sequence[str],
              grad_requiring_tensor_key: str, compute_params: Sequence[torch.Tensor] | None,
              output_unshard_dimension: int, output_reduction: str | None, *args: Any) -> torch.Tensor:
        tiling, sharded, passed = _plan(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                                        output_unshard_dimension, output_reduction, args)
        params = _params(compute_params, [*sharded, *passed])
        return _SequenceTiled.apply(tiling, len(params), *sharded, *passed, *params)


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: Mapping[str, torch.Tensor],
                           kwargs_to_pass: Mapping[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Sequence[torch.Tensor] | None = None, output_unshard_dimension: int = 1,
                           output_reduction: str | None = "mean") -> torch.Tensor:
    """DeepSpeed's `ulysses_sp.sequence_tiled_compute`: `fn(**kwargs_to_shard, **kwargs_to_pass)`
    computed one sequence tile at a time, recomputing each tile in backward, so that one tile's
    intermediates exist at a time (see [Note: tiles with recomputation]).

    Args:
        fn: called as `fn(**tile_of_kwargs_to_shard, **kwargs_to_pass)` once per tile; returns a
            tensor.
        seqlen: the length of dimension 1 (the sequence) of every tensor in kwargs_to_shard.
        shards: the number of tiles (at most seqlen); when it does not divide seqlen the tiles'
            lengths differ by one.
        kwargs_to_shard: tensors of shape [batch, seqlen, ...], sliced along dimension 1.
        kwargs_to_pass: arguments given whole to every tile (tensors, modules, numbers).
        grad_requiring_tensor_key: the key of kwargs_to_shard's main input (DeepSpeed's gradient
            goes to that one). Here every tensor of kwargs_to_shard and kwargs_to_pass that
            requires grad gets its gradient.
        compute_params: the parameters `fn` uses; their gradients, summed over the tiles, leave
            once per backward, as ZeRO 2/3 expect. None: parameters accumulate their gradients
            tile by tile, as under DeepSpeed.
        output_unshard_dimension: the dimension along which the tiles' outputs are concatenated;
            0 stacks them (one output per tile, e.g. a loss).
        output_reduction: None returns the concatenated output; "sum" its sum; "mean" its mean,
            where with `output_unshard_dimension=0` each tile's output counts by the tile's share of
            the sequence (so a tile's mean loss gives the mean loss over the whole sequence, also
            for uneven tiles; DeepSpeed averages the tiles equally).

    Returns:
        The concatenated (or stacked) output, or its reduction (a scalar).
    """
    for name, value in (("kwargs_to_shard", kwargs_to_shard), ("kwargs_to_pass", kwargs_to_pass)):
        if not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a dict of fn's keyword arguments, got {type(value).__name__}")
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())

"""DeepSpeed-Ulysses sequence parallelism: attention over whole sequences, heads split over ranks.

[Note: the Ulysses exchange]
P ranks of a sequence-parallel group each hold a contiguous slice of every sequence (rank r: tokens
[r S/P, (r+1) S/P)) with all H attention heads. Attention mixes tokens, so it needs whole sequences;
it does not mix heads. One all-to-all re-slices the query, key and value tensors: rank r sends its
slice's heads [j H/P, (j+1) H/P) to rank j and receives, from every rank, that rank's slice of its
own heads, which concatenated in rank order are the whole sequence for H/P heads. The local attention
runs on that, and the inverse all-to-all returns each rank its own tokens with all heads. The
backward of an all-to-all is the inverse all-to-all of the gradient, so autograd needs nothing else.
Per rank and layer this moves 4 / P of the activations of q, k, v and the output, whatever the
sequence length: the all-to-all scales where ring attention's passes do not.

Key/value heads fewer than the group (grouped-query attention) are repeated up to it, as DeepSpeed
does: rank r's query heads all use the same key/value head, floor(r H_kv / P), which the repeat puts
on rank r; the gradients of the copies sum back through the repeat.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.components import Component

LABEL = "all_to_all (sequence)"
KIND = "sequence"  # the shared Comms' kind (see [Note: one group registry] in zero/parallel/groups.py)


def _comm(group):
    """zero's shared Comm over `group` for sequence traffic: its all-to-all waits at most
    ZERO_COLLECTIVE_TIMEOUT on gloo (a rank that diverged raises CollectiveTimeout instead of
    hanging) and counts what it sends."""
    from zero.parallel.groups import shared_comm

    return shared_comm(group, KIND)


def take_traffic() -> dict[str, dict[str, int]]:
    """This process's sequence-parallel traffic since the last call ("all_to_all (sequence)", the
    loss's token count): the engine's comm report adds it to its step's window."""
    from zero.parallel.groups import take_traffic as take

    return take(KIND)


def exchange_wait_s() -> float:
    """Seconds this process has waited for sequence-parallel collectives (gloo; see Comm.wait_for)."""
    from zero.parallel.groups import waited_s

    return waited_s(KIND)


_exchanges: dict[int, int] = {}  # id of a process group -> sequence-parallel exchanges over it, ever


def exchanged(group) -> int:
    """Count one sequence-parallel exchange over `group` and return the count so far. zero's
    exchange calls it; an attention that exchanges over the group by other means (ring attention,
    its own all-to-all) calls it too, so that the engine's first-step check sees it."""
    _exchanges[id(group)] = _exchanges.get(id(group), 0) + 1
    return _exchanges[id(group)]


def exchanges(group) -> int:
    """Sequence-parallel exchanges over `group` so far (see `exchanged`)."""
    return _exchanges.get(id(group), 0)


class SequenceParallelism(Component):
    """The engine's component for Ulysses sequence parallelism (see [Note: engine components]):
    before the first step it refuses a run whose forward and backward exchanged nothing over the
    group (`refuse_without_exchange`), and after each step it adds the step's sequence traffic to
    the engine's comm report.

    Args:
        group: the sequence-parallel group.
        size: its size (`sequence_parallel_size`).
    """

    name = "sequence"

    def __init__(self, group, size: int):
        self.group, self.size = group, size
        self.exchanges_at_start = exchanges(group)

    def before_step(self, engine) -> None:
        if engine.progress.global_steps == 0 and engine.progress.backwards:
            refuse_without_exchange(self.size, self.group, self.exchanges_at_start)

    def after_step(self, engine, applied: bool) -> None:
        engine._last_comm.update(take_traffic())  # in the same window as the engine's own collectives


def refuse_without_exchange(size: int, group, before: int) -> None:
    """Raise before the first optimizer step of a sequence-parallel run whose forward and backward
    exchanged nothing over its group (`before`: the count when the engine was built): its
    attention saw only each rank's slice."""
    if exchanges(group) <= before:
        from zero.errors import ZeroRuntimeError

        raise ZeroRuntimeError(
            f"sequence_parallel_size is {size}, but the first step's forward and backward exchanged nothing over the "
            f"sequence-parallel group: the model's attention is not sequence-parallel, so each rank attended over its "
            f"own slice only and the gradients are wrong. Give it the exchange: for an HF model "
            f"UlyssesSPAttentionHF.register_with_transformers(model, ...) (or load it with "
            f"attn_implementation='ulysses' after registering), for a zero GPT zero.sequence.ulysses_attention, else "
            f"zero.sequence.DistributedAttention around its attention (an attention that exchanges by other means "
            f"calls zero.sequence.exchanged(group)). Nothing was updated")


class ShapeGroup:
    """A stand-in for a sequence-parallel group of `size` ranks where nothing is sent: the memory
    estimator traces a model with it (zero/estimate/activations.py). The exchange then allocates
    what it would and leaves the received tensor unwritten."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def group_size(group) -> int:
    """Ranks in `group` (a process group, None for the default one, or a ShapeGroup)."""
    return group.size() if isinstance(group, ShapeGroup) else dist.get_world_size(group)


def _shapes_only(x: torch.Tensor, group) -> bool:
    """Nothing to send: a ShapeGroup, or tensors without data (meta, or fake while being traced)."""
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(group, ShapeGroup) or x.is_meta or is_fake(x)


class _SequenceAllToAll(torch.autograd.Function):
    """All-to-all that splits `scatter_dim` over the group and joins `gather_dim` from it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        world = group_size(group)
        send = torch.stack(torch.tensor_split(x, world, dim=scatter_dim)).contiguous()
        received = torch.empty_like(send)
        if not _shapes_only(x, group):
            _comm(group).all_to_all(received, send, label=LABEL)
            exchanged(group)
        return torch.cat(received.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _SequenceAllToAll.apply(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def sequence_all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` into the group's size and send part j to rank j; concatenate
    what arrives along `gather_dim` in rank order (see [Note: the Ulysses exchange]). Differentiable.

    Raises:
        ValueError: `scatter_dim` does not split evenly over the group.
    """
    world = group_size(group)
    if x.size(scatter_dim) % world:
        raise ValueError(f"sequence parallelism over {world} ranks splits dimension {scatter_dim} of a tensor of "
                         f"shape {tuple(x.shape)}, whose size {x.size(scatter_dim)} is not a multiple of {world}")
    return _SequenceAllToAll.apply(x, group, scatter_dim, gather_dim)


def heads_for_group(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world: int, heads_dim: int,
                    who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value ready for the exchange over `world` ranks: as they are when their heads split
    over it, repeated up to it when fewer (see [Note: the Ulysses exchange]).

    Raises:
        ValueError (naming `who` and the numbers): query heads that do not split over the group,
            key/value heads that neither split over it nor divide it, key and value heads that differ.
    """
    heads, kv_heads = query.size(heads_dim), key.size(heads_dim)
    if heads % world:
        raise ValueError(f"{who}: {heads} query heads do not split over a sequence-parallel group of {world}; use a "
                         f"group size that divides the number of heads")
    if value.size(heads_dim) != kv_heads:
        raise ValueError(f"{who}: key has {kv_heads} heads, value {value.size(heads_dim)}")
    if kv_heads % world:
        if world % kv_heads or heads % kv_heads:
            raise ValueError(f"{who}: {kv_heads} key/value heads neither split over the group of {world} nor divide it "
                             f"(nor the {heads} query heads); grouped-query attention needs the group size to be a "
                             f"multiple or a divisor of the key/value heads")
        key = key.repeat_interleave(world // kv_heads, dim=heads_dim)
        value = value.repeat_interleave(world // kv_heads, dim=heads_dim)
    return key, value


class DistributedAttention(nn.Module):
    """DeepSpeed's `deepspeed.sequence.layer.DistributedAttention(local_attention,
    sequence_process_group, scatter_idx=2, gather_idx=0)`: Ulysses attention around any attention
    function.

    Args:
        local_attention: called as `local_attention(query, key, value, *args, **kwargs)` on whole
            sequences and this rank's share of the heads, in the layout it was given; returns the
            context in that layout.
        sequence_process_group: the sequence-parallel group (None: the default group).
        scatter_idx: the heads dimension of query/key/value (2 for [s, b, h, d] and [b, s, h, d]).
        gather_idx: the sequence dimension for `batch_dim_idx=1` ([s, b, h, d]); with
            `batch_dim_idx=0` ([b, s, h, d]) the sequence is dimension 1, as in DeepSpeed.
    """

    def __init__(self, local_attention, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 0,
                 sp_stream=None):
        super().__init__()
        if sp_stream is not None:
            raise ValueError("DistributedAttention(sp_stream=...): overlapping the key/value all-to-alls on a side "
                             "stream is not implemented; leave sp_stream as None")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def _sequence_dim(self, batch_dim_idx: int | None) -> int:
        if batch_dim_idx is None or batch_dim_idx == 1:
            return self.gather_idx
        if batch_dim_idx == 0:
            return 1 if self.gather_idx == 0 else self.gather_idx
        raise ValueError(f"batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), got {batch_dim_idx!r}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        """Attention of this rank's sequence slice over the whole sequence; returns the context of
        this rank's tokens with all heads, laid out as `query`."""
        world = group_size(self.spg)
        heads_dim, seq_dim = self.scatter_idx, self._sequence_dim(batch_dim_idx)
        key, value = heads_for_group(query, key, value, world, heads_dim, "DistributedAttention")
        q, k, v = (sequence_all_to_all(t, self.spg, heads_dim, seq_dim) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return sequence_all_to_all(context, self.spg, seq_dim, heads_dim)


def _causal_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def ulysses_attention(model: nn.Module, group) -> nn.Module:
    """Make the blocks of a zero.models GPT attend over whole sequences across `group` (each rank
    passes its slice of the tokens, and `position_ids` with their places in the whole sequence).
    Returns the model."""
    from zero.models import Block

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(f"ulysses_attention: {type(model).__name__} has no zero.models Block to give sequence-"
                         f"parallel attention; wrap your attention in DistributedAttention instead")
    for block in blocks:  # the block's attention takes (batch, heads, sequence, head_dim)
        block.attend = DistributedAttention(_causal_bhsd, group, scatter_idx=1, gather_idx=2)
    return model

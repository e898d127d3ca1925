"""Ulysses sequence parallelism for HuggingFace transformers models, as DeepSpeed's
`UlyssesSPAttentionHF.register_with_transformers` does it: an attention implementation registered
with transformers that wraps a core one ("sdpa", "flash_attention_2", ...) in the Ulysses exchange.
Optional: needs transformers only when called.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zero.parallel.groups import sequence_parallel_group
from zero.sequence.ulysses import heads_for_group, sequence_all_to_all

NAME = "ulysses"


class SequenceParallelState:
    """The `mpu` register_with_transformers returns and `zero.initialize(mpu=...)` takes: this
    rank's sequence-parallel group and its place in it (DeepSpeed's parallel_state_sp functions)."""

    def __init__(self, size: int):
        self.size = size
        self.group = sequence_parallel_group(size)

    def get_sequence_parallel_group(self):
        return self.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.size

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()


class _LocalHeads:
    """The attention module as the core implementation sees it: its own attributes, with the query
    heads per key/value head of this rank's share."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class UlyssesSPAttentionHF(torch.nn.Module):
    """An HF attention implementation over whole sequences for a share of the heads: q, k, v come
    as [batch, heads, local sequence, head_dim]; the core implementation sees the whole sequence
    (causal; padding is expressed with ignored labels, not an attention mask) and returns
    [batch, sequence, heads, head_dim], which goes back to this rank's tokens."""

    def __init__(self, attn, group, size: int):
        super().__init__()
        self.attn, self.group, self.size = attn, group, size

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        key, value = heads_for_group(query, key, value, self.size, 1, "Ulysses attention")
        q, k, v = (sequence_all_to_all(t.contiguous(), self.group, 1, 2) for t in (query, key, value))
        kwargs.pop("is_causal", None)
        # this rank's positions would not describe the whole sequence the core sees; without them
        # it is one causal sequence (packed sequences are not supported)
        kwargs.pop("position_ids", None)
        # the core repeats key/value heads by the module's ratio: this rank's ratio, after the exchange
        local = _LocalHeads(module, q.size(1) // k.size(1))
        out, _ = self.attn(local, q, k, v, None, *args, is_causal=True, **kwargs)  # [b, s, h_local, d]
        return sequence_all_to_all(out.contiguous(), self.group, 1, 2), None

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str, sequence_parallel_size: int,
                                   micro_batch_size: int | None = None, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True):
        """Register attention implementation "ulysses" (the core one wrapped in the exchange) with
        transformers and switch `model_name_or_path` to it when it is a model (a path: load it
        with attn_implementation="ulysses"). Returns the mpu for `zero.initialize(mpu=...)`."""
        from transformers import AttentionInterface

        if core_attn_implementation not in AttentionInterface._global_mapping:
            raise ValueError(f"core_attn_implementation {core_attn_implementation!r} is not a transformers attention "
                             f"implementation ({sorted(AttentionInterface._global_mapping)}); 'eager' is model-specific "
                             f"and cannot be wrapped: use 'sdpa'")
        if isinstance(model_name_or_path, torch.nn.Module):  # its heads, checked before anything changes
            _check_heads(model_name_or_path.config, sequence_parallel_size)
        mpu = SequenceParallelState(sequence_parallel_size)
        wrapper = cls(AttentionInterface._global_mapping[core_attn_implementation], mpu.group, sequence_parallel_size)
        AttentionInterface.register(NAME, wrapper.forward)
        if isinstance(model_name_or_path, torch.nn.Module):
            model_name_or_path.set_attn_implementation(NAME)
        return mpu


def _check_heads(config, size: int) -> None:
    """The query heads must split over the group; key/value heads must split over it or divide it
    (then they are repeated up to it)."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        return
    if heads % size or (kv % size and size % kv):
        raise ValueError(f"sequence_parallel_size {size} does not fit the model's heads: {heads} query heads must split "
                         f"over it, and {kv} key/value heads must split over it or divide it")


def tile_mlps(model: torch.nn.Module, tokens_per_tile: int = 256) -> int:
    """Route every MLP of an HF decoder (its modules whose class name ends in "MLP": LlamaMLP,
    Qwen2MLP, MistralMLP, ...) through `TiledMLP`, `tokens_per_tile` positions at a time, so the
    MLP's wide hidden activations exist for one tile at a time. Returns how many were tiled."""
    import functools

    if not isinstance(tokens_per_tile, int) or tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile must be a positive int, got {tokens_per_tile!r}")
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    for mlp in mlps:
        mlp.forward = functools.partial(_tiled_mlp_forward, mlp, tokens_per_tile)
    return len(mlps)


def _tiled_mlp_forward(mlp: torch.nn.Module, tokens_per_tile: int, x: torch.Tensor) -> torch.Tensor:
    import math

    from zero.sequence.tiled import TiledMLP

    if x.dim() != 3:  # not [batch, sequence, hidden] (a mixture-of-experts expert's [tokens, hidden]): as it was
        return type(mlp).forward(mlp, x)
    return TiledMLP.apply(type(mlp).forward, mlp, x, math.ceil(x.size(1) / tokens_per_tile), list(mlp.parameters()))


def tiled_causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, shift_labels: torch.Tensor,
                         position_ids: torch.Tensor | None = None, tokens_per_tile: int = 1024) -> torch.Tensor:
    """The summed cross-entropy of an HF causal LM's predictions over valid `shift_labels` (-100:
    ignored), with the vocabulary projection and the loss computed `tokens_per_tile` positions at a
    time (`TiledFusedLogitsLoss`): the [sequence x vocabulary] logits never exist whole. Divide by
    the valid tokens (or use the sequence-parallel share, as `sequence_loss` does) for a mean."""
    import math

    import torch.nn.functional as F

    from zero.sequence.tiled import TiledFusedLogitsLoss

    hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids).last_hidden_state
    head = model.get_output_embeddings()

    def loss(head, x, y):
        return F.cross_entropy(head(x).float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")

    return TiledFusedLogitsLoss.apply(loss, head, hidden, shift_labels, None, math.ceil(hidden.size(1) / tokens_per_tile),
                                      list(head.parameters()), "sum")

"""Swap the self-attention of existing models for block-sparse attention, keeping their weights.

`replace_self_attention(model, sparsity_config)` changes, in place:

- every `zero.models.Block` (the GPT of zero.models, built with fused or separate
  q, k, v): its attention function (`Block.attend`) becomes a causal SparseSelfAttention where it
  called dense SDPA; the layers, parameters and state_dict keys stay as they were;
- every HuggingFace `GPT2Attention` (self-attention) and `BertSelfAttention` so that its attention
  function is ours (registered with transformers' AttentionInterface as "zero_sparse"; the
  module gets its own copy of the config naming it, so other modules keep theirs). The layer
  passes its causal flag and scaling; its attention mask may be key padding (plus the causal
  triangle), which becomes our key bias; any other mask structure is an error, as is attention
  dropout while training (the kernels have none: set attn_pdrop / attention_probs_dropout_prob
  to 0 to train).

The model's parameters are untouched, so an optimizer or `zero.initialize` may come before or
after the swap.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from zero.sparse_attention.attention import SparseSelfAttention
from zero.sparse_attention.sparsity_config import SparsityConfig

HF_ATTENTION_NAME = "zero_sparse"
_HF_CLASSES = ("GPT2Attention", "BertSelfAttention")


def replace_self_attention(model: nn.Module, sparsity_config: SparsityConfig, *,
                           max_seq_length: int = 2048) -> nn.Module:
    """Make every supported self-attention in `model` block-sparse with `sparsity_config`.

    Args:
        model: a zero.models GPT (or any module holding its Blocks), or a HuggingFace
            GPT-2 / BERT model or block.
        sparsity_config: the layout; its num_heads must be the model's.
        max_seq_length: see SparseSelfAttention.

    Returns:
        `model`, changed in place.

    Raises:
        ValueError: nothing in `model` is a supported attention, or the head counts differ.
    """
    from zero.models import Block

    swapped = 0
    for name, module in model.named_modules():
        if isinstance(module, Block):  # its attention function, which is causal
            _check_heads(name or type(module).__name__, module.n_head, sparsity_config)
            module.attend = SparseSelfAttention(sparsity_config, max_seq_length=max_seq_length, causal=True)
            swapped += 1
    for module in model.modules():
        if type(module).__name__ in _HF_CLASSES and not getattr(module, "is_cross_attention", False):
            heads = getattr(module, "num_heads", getattr(module, "num_attention_heads", None))
            _check_heads(type(module).__name__, heads, sparsity_config)
            _register_hf_attention()
            module.zero_sparse_attention = SparseSelfAttention(
                sparsity_config, key_padding_mask_mode="mul", max_seq_length=max_seq_length,
                causal=bool(getattr(module, "is_causal", False)))
            module.config = copy.copy(module.config)
            module.config._attn_implementation = HF_ATTENTION_NAME
            swapped += 1
    if not swapped:
        raise ValueError(f"no supported self-attention found in {type(model).__name__}: replace_self_attention "
                         f"knows zero.models.Block, HuggingFace GPT2Attention and BertSelfAttention")
    return model


def _check_heads(where: str, heads: int | None, config: SparsityConfig) -> None:
    if heads != config.num_heads:
        raise ValueError(f"{where} has {heads} attention heads but sparsity_config.num_heads is {config.num_heads}")


def _register_hf_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION_NAME, hf_sparse_attention)


def hf_sparse_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the module's SparseSelfAttention."""
    if dropout:
        raise ValueError(f"{type(module).__name__} asks for attention dropout p={dropout}, which block-sparse "
                         f"attention does not do: set the config's attention dropout (attn_pdrop for GPT-2, "
                         f"attention_probs_dropout_prob for BERT) to 0 before training")
    sparse: SparseSelfAttention = module.zero_sparse_attention
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"block-sparse attention needs as many queries as keys (no key/value cache), got "
                         f"{query.shape[2]} queries and {key.shape[2]} keys")
    keep = key_padding_of(attention_mask, query.shape[0], key.shape[2], sparse.causal)
    out = sparse(query, key, value, key_padding_mask=keep, scale=scaling)
    return out.transpose(1, 2), None


def key_padding_of(mask: torch.Tensor | None, batch: int, seq: int, causal: bool) -> torch.Tensor | None:
    """The (batch, seq) keep-mask of keys behind a HuggingFace attention mask, or None for none.

    The mask may be a (batch, seq) keep-mask, or a (batch, 1 or heads, seq, seq) bool (True =
    attend) or additive float (0 = attend, the dtype's minimum = masked) mask. Rows of padding
    queries are not checked (HuggingFace may unmask them to avoid NaNs).

    Raises:
        ValueError: the mask is more than key padding (and the causal triangle when causal).
    """
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask != 0
    if mask.dim() != 4 or mask.shape[0] != batch or mask.shape[-2:] != (seq, seq):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} is neither (batch, seq) nor "
                         f"(batch, heads, seq, seq) for batch {batch}, seq {seq}")
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
        if bool((mask[allowed] != 0).any()):
            raise ValueError("the attention mask adds values other than 0 and -inf (a position bias?); "
                             "block-sparse attention takes key padding only")
    keep = allowed.any(dim=2).all(dim=1)  # (batch, seq): keys some query may see, in every head
    expected = keep[:, None, None, :].expand_as(allowed)
    if causal:
        expected = expected & torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
    real_rows = keep[:, None, :, None]
    if bool(((allowed != expected) & real_rows).any()):
        raise ValueError("the attention mask is not key padding (plus the causal triangle); block-sparse attention "
                         "takes key padding only")
    return keep

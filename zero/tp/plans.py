"""Named tensor-parallel plans (`zero.tp.parallelize(model, mesh, name)`): for each model, a
function (model, tensor-parallel size) -> {module path: ParallelStyle}, which checks the model's
sizes against the slicing before anything is sliced."""
from __future__ import annotations

from typing import Any

import torch.nn as nn


def _gpt_plan(model: nn.Module, size: int) -> dict[str, Any]:
    """The blocks of zero.models (built with fused_qkv=False), wherever they are (a GPT,
    or the layers of a PipelineModule): heads sliced in attention, the hidden layer in the MLP;
    in a GPT also the vocabulary in the embedding and the head (the logits come back whole)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from zero.models import GPT, Block

    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(f"plan 'gpt' slices the blocks of zero.models.GPT; a {type(model).__name__} has none")
    plan: dict[str, Any] = {}
    for name, block in blocks:
        if not hasattr(block, "q"):
            raise ValueError("plan 'gpt' slices attention by heads, which needs separate q, k and v layers: build "
                             "the GPT with GPTConfig(fused_qkv=False)")
        for what, n in (("n_head", block.n_head), ("4 * n_embd", block.fc.out_features)):
            if n % size:
                raise ValueError(f"plan 'gpt' on {size} tensor-parallel ranks: {what} ({n}) must be a multiple of {size}")
        plan.update({f"{name}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc")})
        plan.update({f"{name}.{n}": RowwiseParallel() for n in ("proj", "out")})
    if isinstance(model, GPT):
        if model.cfg.vocab_size % size:
            raise ValueError(f"plan 'gpt' on {size} tensor-parallel ranks: vocab_size ({model.cfg.vocab_size}) must be "
                             f"a multiple of {size}")
        plan.update({"wte": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())})
    return plan


def _llama_plan(model: nn.Module, size: int) -> dict[str, Any]:
    """HuggingFace Llama (LlamaForCausalLM or LlamaModel): attention by heads (q/k/v column-,
    o row-sliced), the MLP's intermediate width (gate/up column-, down row-sliced), the
    vocabulary in the embedding and the lm_head (tied or not; the vocabulary need not divide)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = getattr(model, "model", model)
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(base, "layers"):
        raise ValueError(f"plan 'llama' is for HuggingFace Llama models, not a {type(model).__name__}")
    _transformers_with_shape_read_heads("llama")
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(cfg, what)
        if n % size:
            raise ValueError(f"plan 'llama' on {size} tensor-parallel ranks: config.{what} ({n}) must be a multiple "
                             f"of {size}")
    prefix = "model." if base is not model else ""
    plan: dict[str, Any] = {f"{prefix}embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    if hasattr(model, "lm_head"):  # tied or not: both keep their weight's rows (see parallelize)
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(base.layers)):
        layer = f"{prefix}layers.{i}"
        plan.update({f"{layer}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
        plan.update({f"{layer}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
    return plan



def _gpt2_plan(model: nn.Module, size: int) -> dict[str, Any]:
    """HuggingFace GPT-2 (GPT2LMHeadModel, GPT2Model, or a GPT-2 with another head): attention by
    heads (the fused c_attn by each head's q, k and v columns, c_proj by rows; [Note: fused q/k/v
    slices] in zero/tp/styles.py), the MLP's inner width (c_fc by columns, c_proj by rows), the
    vocabulary in the embedding and the lm_head (tied or not; the logits come back whole). The
    vocabulary need not divide: GPT-2's 50257 rows are sliced unevenly. The position embedding,
    layer norms and other heads stay whole on every tensor rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from zero.tp.styles import Conv1DColwise, Conv1DRowwise, GPT2AttentionHeads

    base = getattr(model, "transformer", model)
    cfg = getattr(model, "config", None)
    if cfg is None or not (hasattr(base, "h") and hasattr(base, "wte")):
        raise ValueError(f"plan 'gpt2' is for HuggingFace GPT-2 models, not a {type(model).__name__}")
    _transformers_with_shape_read_heads("gpt2")
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("plan 'gpt2' does not slice cross-attention (config.add_cross_attention=True)")
    inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
    for what, n in (("n_head", cfg.n_head), ("n_inner", inner)):
        if n % size:
            raise ValueError(f"plan 'gpt2' on {size} tensor-parallel ranks: config.{what} ({n}) must be a multiple "
                             f"of {size}")
    prefix = "transformer." if base is not model else ""
    plan: dict[str, Any] = {f"{prefix}wte": RowwiseParallel(input_layouts=Replicate())}
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(base.h)):
        block = f"{prefix}h.{i}"
        plan[f"{block}.attn"] = GPT2AttentionHeads()
        plan[f"{block}.mlp.c_fc"] = Conv1DColwise()
        plan[f"{block}.mlp.c_proj"] = Conv1DRowwise()
    return plan


PLANS = {"gpt": _gpt_plan, "llama": _llama_plan, "gpt2": _gpt2_plan}


def auto_plan_for(model: nn.Module, size: int) -> str | None:
    """For `zero.initialize` with tensor_parallel.size > 1 (DeepSpeed's autotp_size): None when
    the model is sliced already; the name of its plan when it is a HuggingFace model one of
    PLANS slices (its sizes checked now, before any process group work); else a ValueError that
    says how to slice it."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = model_type if model_type in ("gpt2", "llama") else None
    if name is None:  # a ConfigError (a ValueError) naming the key, as DeepSpeed's AutoTP users set autotp_size
        from zero.config.errors import _raise

        _raise([(("tensor_parallel", "size"), f"is {size} (DeepSpeed's autotp_size) but no parameter of the "
                 f"{type(model).__name__} is sliced: slice it first with zero.tp.parallelize(model, "
                 f"zero.tp.mesh(config), plan) (named plans: {sorted(PLANS)}, or a dict of module path -> "
                 f"ParallelStyle), or leave tensor parallelism out (size 1); HuggingFace GPT-2 and Llama models "
                 f"are sliced by initialize itself")])
    try:
        PLANS[name](model, size)
    except ValueError as exc:
        raise ValueError(f"tensor_parallel.size {size} slices this {type(model).__name__} by plan {name!r}: {exc}") \
            from None
    return name


def _transformers_with_shape_read_heads(plan: str) -> None:
    """HF plans divide the heads among the ranks and rely on attention reading its head count
    from the tensors (views with -1), which transformers does from 4.48 on."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("4.48"):
        raise ValueError(f"plan {plan!r} needs transformers 4.48 or later (its attention takes the head count from "
                         f"the tensors, so a rank can hold some heads); this is {transformers.__version__}")

"""`deepspeed.module_inject`: of DeepSpeed's module injection, the two tensor-parallel Linear layers
(`LinearLayer`, `LinearAllreduce`, in layers.py, on torch's DTensor as zero.tp slices).

zero's tensor slicing is zero.tp: `zero.tp.parallelize(model, zero.tp.mesh(config), plan)` with a
named plan ("gpt", "llama", "gpt2") or a dict of module path -> torch ParallelStyle, or the
config's `tensor_parallel.size` (DeepSpeed's `autotp_size`), with which `initialize` slices
HuggingFace GPT-2 and Llama models itself: that is what DeepSpeed's AutoTP training does. The rest
of this package (AutoTP's layer replacement, kernel injection, policies and containers,
replace_transformer_layer, ...) resolves to stand-ins that raise with that advice when used.
"""
from zero.deepspeed._missing import missing
from zero.deepspeed.module_inject._absent import unavailable
from zero.deepspeed.module_inject.layers import LinearAllreduce, LinearLayer  # noqa: F401

# DeepSpeed names of this package with no counterpart here
_KNOWN = frozenset({
    "AutoTP", "AutoTPConfig", "AutoTPPresets", "DSPolicy", "EmbeddingLayer", "GroupQuantizer", "HFBertLayerPolicy",
    "Normalize", "PartitionType", "ReplaceWithTensorSlicing", "SubParamLinearAllreduce", "SubParamLinearLayer",
    "TPLayerSpec", "generic_injection", "merge_autotp_configs", "quantize_transformer_layer",
    "replace_transformer_layer", "revert_transformer_layer", "set_autotp_mode",
})


def __getattr__(name: str):
    if name in _KNOWN:
        return unavailable(__name__, name)
    return missing(__name__, name)

"""`deepspeed.module_inject.replace_module`: DeepSpeed's layer replacement (kernel injection,
replace_transformer_layer) has no counterpart in zero; its names are explanatory stand-ins."""
from zero.deepspeed._missing import missing
from zero.deepspeed.module_inject._absent import unavailable

# DeepSpeed names of this module with no counterpart here
_KNOWN = frozenset({
    "AutoTP", "DeepSpeedDiffusersAttention", "DeepSpeedDiffusersTransformerBlock", "Diffusers2DTransformerConfig",
    "GroupQuantizer", "Loading", "ReplaceWithTensorSlicing", "TensorParallelIcShardConv2d",
    "TensorParallelOcShardConv2d", "generic_injection", "get_transformer_name", "load_model_with_checkpoint",
    "policy_to_ds_container", "replace_module", "replace_transformer_layer", "revert_transformer_layer",
    "skip_level_0_prefix",
})


def __getattr__(name: str):
    if name in _KNOWN:
        return unavailable(__name__, name)
    return missing(__name__, name)

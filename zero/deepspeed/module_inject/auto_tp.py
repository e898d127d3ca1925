"""`deepspeed.module_inject.auto_tp`: zero's automatic slicing is zero.tp's (see the package's
docstring); the Linear layers are zero.deepspeed.module_inject.layers'."""
from zero.deepspeed._missing import missing
from zero.deepspeed.module_inject._absent import unavailable
from zero.deepspeed.module_inject.layers import LinearAllreduce, LinearLayer  # noqa: F401

# DeepSpeed names of this module with no counterpart here
_KNOWN = frozenset({
    "AutoTP", "AutoTPConfig", "AutoTPMeta", "Conv_LinearALlreduce", "GateUpPack_LinearLayer", "GatheredParameters",
    "HiddenParallelEmbedding", "LinearAllreduceWithReplicatedInput", "LmHeadLinearAllreduce", "Loading",
    "PartitionType", "ReplaceWithTensorSlicing", "SubParamLinearAllreduce", "SubParamLinearLayer", "TPLayerSpec",
    "TensorParallel_Layer", "VocabParallelEmbedding", "VocabParallelLinear", "Yuan_LinearAllreduce", "Yuan_LinearLayer",
    "conv_LinearLayer", "fused_LinearLayer", "get_shard_size", "get_shard_size_list", "is_autotp_training_mode",
    "move", "require_tp_fused_qkvw",
})


def __getattr__(name: str):
    if name in _KNOWN:
        return unavailable(__name__, name)
    return missing(__name__, name)

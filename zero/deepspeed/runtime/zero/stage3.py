"""`deepspeed.runtime.zero.stage3`."""
from zero.deepspeed._kinds import kind
from zero.deepspeed._missing import missing
from zero.estimate import estimate_memory
from zero.optim.step import ShardedOptimizer
from zero.stages.unit_params import UnitParams

DeepSpeedZeroOptimizer_Stage3 = kind(
    "DeepSpeedZeroOptimizer_Stage3", __name__, lambda o: isinstance(o, ShardedOptimizer) and isinstance(o.storage, UnitParams),
    "the engine's optimizer at stage 3 (zero.optim.step.ShardedOptimizer over UnitParams)")


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5):
    """Print the per-rank memory of stage 3 with and without offload for `model` (zero.estimate_memory;
    `additional_buffer_factor` is not needed: the buffers are sized from the config)."""
    print(estimate_memory(model, num_gpus_per_node * num_nodes, stage=3, gpus_per_node=num_gpus_per_node))


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5):
    """The same from a parameter count and the largest layer's."""
    print(estimate_memory(int(total_params), num_gpus_per_node * num_nodes, stage=3, gpus_per_node=num_gpus_per_node,
                          largest_layer=int(largest_layer_params)))


def __getattr__(name: str):
    return missing(__name__, name)

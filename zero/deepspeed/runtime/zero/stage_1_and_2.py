"""`deepspeed.runtime.zero.stage_1_and_2`."""
from zero.deepspeed._kinds import kind
from zero.deepspeed._missing import missing
from zero.estimate import estimate_memory
from zero.optim.step import ShardedOptimizer
from zero.stages.buckets import FlatParams

DeepSpeedZeroOptimizer = kind(
    "DeepSpeedZeroOptimizer", __name__, lambda o: isinstance(o, ShardedOptimizer) and isinstance(o.storage, FlatParams),
    "the engine's optimizer at stages 0-2 (zero.optim.step.ShardedOptimizer over FlatParams)")


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5):
    """Print the per-rank memory of stage 2 with and without offload for `model` (zero.estimate_memory)."""
    print(estimate_memory(model, num_gpus_per_node * num_nodes, stage=2, gpus_per_node=num_gpus_per_node))


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5):
    """The same from a parameter count."""
    print(estimate_memory(int(total_params), num_gpus_per_node * num_nodes, stage=2, gpus_per_node=num_gpus_per_node))


def __getattr__(name: str):
    return missing(__name__, name)

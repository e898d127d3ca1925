"""What to say about a DeepSpeed name zero does not have."""
from __future__ import annotations

# DeepSpeed names with no counterpart here, and what to use instead
NOT_HERE = {
    "deepspeed.init_inference": "inference engines are not implemented; use the model directly (under stage 3, "
                                "with zero.integrations.hf.from_pretrained and model.generate)",
    "deepspeed.pipe": "pipeline parallelism is not implemented yet",
    "deepspeed.PipelineModule": "pipeline parallelism is not implemented yet",
    "deepspeed.moe": "expert parallelism is not implemented; MoE layers train as ordinary modules "
                     "(zero.set_z3_leaf_modules keeps an MoE block one unit under stage 3)",
    "deepspeed.profiling": "use torch.profiler; engine.wall_clock_report() and engine.comm_report() give zero's "
                           "breakdown",
    "deepspeed.launcher": "launch with torchrun",
    "deepspeed.compression": "compression training is not implemented",
    "deepspeed.inference": "inference engines are not implemented",
    "deepspeed.sequence": "sequence parallelism is not implemented",
    "deepspeed.utils.safe_get_full_grad": "read the gradient norm with engine.get_global_grad_norm(); full "
                                          "gradients are not gathered by zero",
    "deepspeed.utils.safe_get_local_grad": "gradients live in zero's reduce buffers; use engine.get_global_grad_norm()",
    "deepspeed.checkpointing.model_parallel_cuda_manual_seed": "zero has no model parallelism; use torch.manual_seed",
}


def missing(module: str, name: str):
    """Raise the explanatory error for `module.name` (an AttributeError, so hasattr() still works)."""
    if name.startswith("__"):
        raise AttributeError(name)
    full = f"{module}.{name}"
    reason = NOT_HERE.get(full)
    if reason is None:
        raise AttributeError(f"{full} is not part of zero's DeepSpeed compatibility layer (see "
                             f"docs/migrating-from-deepspeed.md for what is)")
    raise AttributeError(f"{full} is not available in zero: {reason}")

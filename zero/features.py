"""What zero does not do (and what to use instead), written once.

[Note: the feature table]
`FEATURES` lists the parts of DeepSpeed zero lacks, or has only in part, each with its reason and
every place a user meets it:
- `packages`: DeepSpeed packages of that feature. One zero has no file under raises ImportError
  with the reason when imported from zero.deepspeed, so `try: import deepspeed.moe` probes take
  the right branch; in one zero implements in part (a file of its own under it), the names it lacks
  are stand-ins that fail on use with the reason (see [Note: absent names] in
  zero/deepspeed/_missing.py);
- `names`: single DeepSpeed names with that reason;
- `engine_methods`: DeepSpeedEngine methods the facade (zero/deepspeed/engine_methods.py) refuses
  with the reason;
- `optimizers`: optimizer classes zero refuses to run on shards (zero/optim/choice.py);
- `config_keys`: the feature's config keys. Every config key zero refuses or warns about is a row
  of `UNIMPLEMENTED_FEATURES` in zero/config/features.py, which holds what only a key has (its
  placeholder field: DeepSpeed's type and default, when setting it matters, why that key
  matters); a test checks that each key named here is a row there, so a key and a package of one
  feature are refused for the same feature. The migration guide's
table (docs/migrating-from-deepspeed.md, "What zero does not do") is `markdown_table()`, and a test
checks that no reason denies a feature zero has (`IMPLEMENTED`) and that the guide shows the table.
This module imports nothing: the config, the facade and the optimizers all read it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    """One part of DeepSpeed that zero lacks (see [Note: the feature table]).

    Args:
        name: what it is, in a user's words.
        reason: what zero does instead, or what to use.
        packages: DeepSpeed packages of it (`deepspeed.moe`).
        names: single DeepSpeed names of it (`deepspeed.init_inference`).
        engine_methods: DeepSpeedEngine methods of it.
        optimizers: optimizer class names of it (refused by the engine).
        config_keys: its config keys (each a row of zero/config/features.py's table, which holds
            the key's field and when setting it matters).
    """

    name: str
    reason: str
    packages: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    engine_methods: tuple[str, ...] = ()
    optimizers: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()


_GATHER_HANDLE = ("zero's stage-3 gathers have finished when they return (param.all_gather_coalesced() returns a handle "
                  "whose wait() does nothing); DeepSpeed's handle classes are not provided")
_NVME = ("zero offloads to NVMe from the config (offload_optimizer.device and offload_param.device: nvme; "
         "docs/offload.md); DeepSpeed's aio handles and tensor-swapper classes are not provided")
_SPARSE = "sparse gradients are not supported (use dense embeddings)"
_DEEPCOMPILE = "DeepCompile is not implemented; engine.compile() compiles the model's blocks (docs/compile.md)"

FEATURES: tuple[Feature, ...] = (
    Feature("expert parallelism (MoE)", "expert parallelism is not implemented; MoE layers train as ordinary modules "
            "(zero.set_z3_leaf_modules keeps an MoE block one unit under stage 3)",
            packages=("deepspeed.moe",), engine_methods=("load_moe_state_dict",),
            config_keys=("use_data_before_expert_parallelism",)),
    Feature("DeepSpeed's profilers", "use torch.profiler; engine.wall_clock_report() and engine.comm_report() give "
            "zero's breakdown", packages=("deepspeed.profiling",), config_keys=("flops_profiler.enabled",)),
    Feature("DeepSpeed's launcher", "launch with torchrun", packages=("deepspeed.launcher",)),
    Feature("compression training", "compression training is not implemented", packages=("deepspeed.compression",),
            config_keys=("compression_training",)),
    Feature("inference engines", "inference engines are not implemented; use the model directly (under stage 3, with "
            "zero.integrations.hf.from_pretrained and model.generate)",
            packages=("deepspeed.inference", "deepspeed.model_implementations"), names=("deepspeed.init_inference",)),
    Feature("DeepSpeed's other sequence parallelism (FPDT, ...)", "zero's sequence parallelism is Ulysses: "
            "deepspeed.sequence.layer.DistributedAttention and deepspeed.runtime.sequence_parallel.ulysses_sp "
            "(UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, TiledMLP, TiledFusedLogitsLoss, "
            "sequence_tiled_compute; docs/sequence.md); this part of DeepSpeed's is not provided",
            packages=("deepspeed.sequence", "deepspeed.runtime.sequence_parallel")),
    Feature("DeepSpeed's fused transformer kernels", "DeepSpeed's fused transformer layers are not implemented; use "
            "torch's layers (F.scaled_dot_product_attention)", packages=("deepspeed.ops.transformer",)),
    Feature("LAMB", "LAMB is refused: its trust ratio needs whole parameters, which ZeRO partitions",
            packages=("deepspeed.ops.lamb",)),
    # optimizers that look at whole tensors cannot run on partitioned shards (see [Note: other optimizers on
    # shards] in zero/optim/choice.py): each reason says what it needs whole
    Feature("LBFGS", "its line search needs the whole model in one closure", optimizers=("LBFGS",)),
    Feature("Adafactor", "its factored second moments need whole matrices", optimizers=("Adafactor",)),
    Feature("SparseAdam", "it takes sparse gradients", optimizers=("SparseAdam",)),
    Feature("LAMB and LARS as client optimizers", "its trust ratio needs each parameter's whole norm",
            optimizers=("Lamb", "LARS")),
    Feature("Shampoo", "its preconditioners need whole matrices", optimizers=("Shampoo",)),
    Feature("TiledLinear", "TiledLinear is not implemented; stage 3 gathers one module at a time (split a huge Linear "
            "into several modules)", packages=("deepspeed.runtime.zero.tiling",)),
    Feature("DeepSpeed's process-group helpers", "zero's process groups come from its parallel dimensions: "
            "engine.parallel.group('zero' | 'sp' | 'pp' | 'tp' | ...) (see docs/parallelism.md); DeepSpeed's group "
            "helpers are not provided", packages=("deepspeed.utils.groups",)),
    Feature("DeepSpeed's timers", "use engine.wall_clock_report() for zero's timings, or torch.profiler",
            packages=("deepspeed.utils.timer",), config_keys=("timers",)),
    Feature("DeepSpeed's mixed-precision optimizers", "mixed precision is the engine's (the config's fp16 and bf16 "
            "sections; engine.loss_scale); 1-bit and 0/1 Adam run inside the engine: set \"optimizer\": {\"type\": "
            "\"OneBitAdam\"} or {\"type\": \"ZeroOneAdam\"} in the config (docs/onebit.md)",
            packages=("deepspeed.runtime.fp16", "deepspeed.runtime.bf16_optimizer")),
    Feature("1-bit optimizer classes", "1-bit and 0/1 Adam run inside the engine: set \"optimizer\": {\"type\": "
            "\"OneBitAdam\"} or {\"type\": \"ZeroOneAdam\"} in the config (docs/onebit.md)",
            names=("deepspeed.runtime.fp16.onebit.adam.OnebitAdam", "deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam")),
    Feature("autotuning", "autotuning is not implemented; zero.estimate_memory gives each stage's memory per rank "
            "(docs/estimate.md)", packages=("deepspeed.autotuning",), config_keys=("autotuning.enabled",)),
    Feature("DeepSpeed's NVMe API", _NVME, packages=("deepspeed.nvme", "deepspeed.io", "deepspeed.ops.aio",
                                                     "deepspeed.ops.gds", "deepspeed.runtime.swap_tensor")),
    Feature("DeepSpeedCPUAdagrad", "DeepSpeedCPUAdagrad is not provided; set \"optimizer\": {\"type\": \"Adagrad\"} in "
            "the config (zero runs Adagrad on each rank's shards, natively under optimizer offload)",
            packages=("deepspeed.ops.adagrad",)),
    Feature("DeepCompile", _DEEPCOMPILE, packages=("deepspeed.compile",),
            engine_methods=("get_deepcompile_backend", "get_deepspeed_compile_backend", "register_compile_pass"),
            config_keys=("compile.deepcompile",)),
    Feature("AutoSP and AutoTP compile backends", "DeepSpeed's AutoSP and AutoTP compile backends are not implemented; "
            "engine.compile() compiles the model's blocks with torch.compile (docs/compile.md), sequence parallelism "
            "is the config's sequence_parallel_size and tensor slicing its tensor_parallel.size",
            engine_methods=("get_autosp_backend", "get_autotp_backend")),
    Feature("ZenFlow", "ZenFlow is not implemented; optimizer offload is the config's offload_optimizer "
            "(docs/offload.md)", packages=("deepspeed.runtime.zenflow",), config_keys=("zero_optimization.zenflow",)),
    Feature("SuperOffload", "SuperOffload is not implemented; optimizer offload is the config's offload_optimizer "
            "(docs/offload.md)", packages=("deepspeed.runtime.superoffload",),
            config_keys=("zero_optimization.offload_optimizer.super_offload",)),
    Feature("the hybrid engine", "the hybrid (training and generation) engine is not implemented",
            packages=("deepspeed.runtime.hybrid_engine",), config_keys=("hybrid_engine.enabled",)),
    Feature("data efficiency (curriculum learning, random-LTD)", "DeepSpeed's data efficiency library (curriculum "
            "learning, random-LTD) is not implemented", packages=("deepspeed.runtime.data_pipeline",),
            engine_methods=("random_ltd_initialize", "set_custom_curriculum_learning_schedule"),
            config_keys=("curriculum_learning.enabled", "data_efficiency.enabled")),
    Feature("stage-3 gather handles", _GATHER_HANDLE,
            names=tuple(f"deepspeed.runtime.zero.partition_parameters.{handle}" for handle in (
                "AllGatherHandle", "AllGatherCoalescedHandle", "MultipleAllGatherHandles", "NoGatherHandle",
                "NoGatherCoalescedHandle"))),
    Feature("remote stage-3 parameters", "zero's stage-3 parameters tell their state by ds_status; there are no remote "
            "parameters", names=("deepspeed.runtime.zero.partition_parameters.ZeroParamType",)),
    Feature("zero.Init's tensor-constructor override", "zero.Init does not wrap torch's tensor constructors: parameters "
            "are made with the dtype and device they ask for, and zero.Init(dtype=...) casts the shards",
            names=("deepspeed.runtime.zero.partition_parameters.DeepSpeedTensorOverride",)),
    Feature("a model-parallel random generator", "zero's tensor slices keep no separate model-parallel generator "
            "(docs/parallelism.md, Dropout); seed every rank alike with torch.manual_seed",
            names=("deepspeed.runtime.activation_checkpointing.checkpointing.model_parallel_cuda_manual_seed",)),
    Feature("the engine's extra gradient reductions", "gradients are reduced by the ZeRO stage's hooks and at step(); "
            "use engine.allreduce_no_retain(tensors, group) for tensors of your own",
            engine_methods=("buffered_allreduce_fallback",)),
    Feature("clipping outside the step", "the engine clips inside step() (the config's gradient_clipping)",
            engine_methods=("clip_fp32_gradients",)),
    Feature("coalesced gradient reduction", "use engine.no_sync() (stages 0-1) or gradient_accumulation_steps",
            engine_methods=("coalesce_grad_reduction",)),
    Feature("DeepSpeed's optimizer configuration object", "zero builds the config's optimizer itself "
            "(zero/optim/choice.py)", engine_methods=("get_optimizer_configuration",)),
    Feature("sparse gradients", _SPARSE,
            engine_methods=("sparse_all_gather", "sparse_allreduce", "sparse_allreduce_bucket",
                            "sparse_allreduce_no_retain"), config_keys=("sparse_gradients",)),
)

# Features zero has, by the words a reason would use to deny one (a test checks no reason does)
IMPLEMENTED = ("sequence parallelism", "torch.compile", "tensor parallelism", "pipeline parallelism", "Muon",
               "1-bit Adam", "0/1 Adam", "optimizer offload", "parameter offload", "activation checkpointing",
               "elasticity", "Lion", "Adagrad", "sparse attention", "client optimizer checkpoints")


def absent_packages() -> dict[str, str]:
    """DeepSpeed package -> the reason zero lacks it (or part of it)."""
    return {package: f.reason for f in FEATURES for package in f.packages}


def absent_names() -> dict[str, str]:
    """Single DeepSpeed name -> the reason zero lacks it."""
    return {name: f.reason for f in FEATURES for name in f.names}


def refused_engine_methods() -> dict[str, str]:
    """DeepSpeedEngine method -> the reason the facade refuses it."""
    return {name: f.reason for f in FEATURES for name in f.engine_methods}


def refused_optimizers() -> dict[str, str]:
    """Optimizer class name -> the reason zero cannot run it on shards."""
    return {name: f.reason for f in FEATURES for name in f.optimizers}


def config_keys() -> dict[str, str]:
    """Config key -> the feature zero lacks that it belongs to."""
    return {key: f.name for f in FEATURES for key in f.config_keys}


def markdown_table() -> str:
    """The migration guide's table of what zero does not do (docs/migrating-from-deepspeed.md)."""
    rows = ["| DeepSpeed | what zero does instead |", "| --- | --- |"]
    for f in FEATURES:
        where = [f"`{p.removeprefix('deepspeed.')}`" for p in f.packages]
        where += [f"`{n.removeprefix('deepspeed.')}`" for n in f.names]
        where += [f"`engine.{m}()`" for m in f.engine_methods]
        where += [f"`{o}`" for o in f.optimizers]
        where += [f"config `{k}`" for k in f.config_keys]
        rows.append(f"| {f.name}: {', '.join(where)} | {f.reason} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

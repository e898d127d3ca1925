"""zero: ZeRO and ZeRO-Offload for PyTorch.

    engine, optimizer, _, scheduler = zero.initialize(model=model, config=ds_config)

`import zero` is cheap: native ops are compiled on first use (see zero/ops/builder.py).
"""
__version__ = "0.1.0"


def __getattr__(name):  # keep `import zero` light: torch-heavy modules load on first use
    if name == "initialize":
        from zero.engine.launch import initialize

        return initialize
    if name == "init_distributed":
        from zero.parallel.process_group import init_distributed

        return init_distributed
    if name == "Engine":
        from zero.engine import Engine

        return Engine
    if name in ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
                "set_z3_leaf_modules"):
        from zero import init

        return getattr(init, name)
    if name in ("RankDivergenceError", "CollectiveTimeout"):
        from zero.parallel import comm

        return getattr(comm, name)
    if name == "NonFiniteGradientError":
        from zero.optim import loss_scale as precision

        return precision.NonFiniteGradientError
    if name == "TrainingMonitor":
        from zero.monitor import TrainingMonitor

        return TrainingMonitor
    if name in ("estimate_memory", "estimate_activations"):
        from zero import estimate

        return getattr(estimate, name)
    if name == "ZeroRuntimeError":
        from zero.errors import ZeroRuntimeError

        return ZeroRuntimeError
    if name in ("ConfigError", "load_config"):
        from zero import config

        return getattr(config, name)
    if name in ("pipe", "tp", "sparse_attention"):  # subpackages, imported when first used
        import importlib

        return importlib.import_module(f"zero.{name}")
    if name in _DEEPSPEED_ONLY:
        raise AttributeError(f"zero.{name} does not exist: zero's top level has DeepSpeed's initialize and "
                             f"init_distributed only; for the rest of DeepSpeed's names use "
                             f"`import zero.deepspeed as deepspeed` (see docs/migrating-from-deepspeed.md)")
    raise AttributeError(f"module 'zero' has no attribute {name!r}")


_DEEPSPEED_ONLY = {"add_config_arguments", "zero", "comm", "utils", "checkpointing", "ops", "DeepSpeedEngine", "init_inference",
                   "moe", "runtime", "accelerator"}


__all__ = ["initialize", "init_distributed", "Engine", "ConfigError", "load_config", "Init", "GatheredParameters",
           "register_external_parameter", "unregister_external_parameter", "set_z3_leaf_modules", "RankDivergenceError",
           "CollectiveTimeout", "NonFiniteGradientError", "ZeroRuntimeError", "estimate_memory", "estimate_activations", "TrainingMonitor",
           "__version__"]

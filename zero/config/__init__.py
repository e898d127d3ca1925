"""Parse and validate a DeepSpeed-style config; the one place in `zero` that knows key names.

    cfg = load_config("ds_config.json", world_size=dist.get_world_size())
    cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.precision, ...

Key names, aliases and defaults follow DeepSpeed (see docs/config.md for the version and for what
we do not implement). Everything is checked here, before any model or process group is touched:

- a misspelt key is a `ConfigError` naming its full path and the closest valid key;
- a bad value is a `ConfigError` naming its path and the expected type or range;
- a DeepSpeed key we do not read is a `ConfigError` if setting it would change the results, and a
  `ConfigWarning` if it would not (see `UNIMPLEMENTED_FEATURES` and [Note: what zero does with a
  DeepSpeed key] in zero/config/features.py); no accepted key is silently ignored;
- settings that cannot go together, with each other or with the caller's model and optimizer
  object (`load_config(..., model_is_pipeline=, client_optimizer=)`), are a `ConfigError` naming
  the key to change (see [Note: rules that combine settings] in zero/config/rules.py).

"auto" values: see [Note: "auto" values] in zero/config/loading.py.

The package, one concern a file: `errors.py` (ConfigError, readable messages from pydantic's),
`sections.py`, `optimizer.py` and `parallel.py` (the section models), `model.py` (`ZeroConfig`, the
root), `features.py` (the keys we refuse or warn about, one row each, from which the section models
get their fields), `rules.py` (settings that cannot go together), `loading.py` (`load_config`,
`resolve_auto`, the batch rule), `elasticity.py` (the `elasticity` section's batch arithmetic).
"""
from zero.config.errors import ConfigError, ConfigWarning
from zero.config.features import UNIMPLEMENTED_FEATURES, UnimplementedFeature
from zero.config.loading import load_config, resolve_auto
from zero.config.model import ZeroConfig
from zero.config.optimizer import SUPPORTED_OPTIMIZERS, AdamParams, OptimizerConfig
from zero.config.scheduler import (
    DEEPSPEED_SCHEDULERS,
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zero.config.sections import (
    AUTO,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ParallelWriteConfig,
    ZeroOptimizationConfig,
)

__all__ = [
    "ConfigError", "ConfigWarning", "ZeroConfig", "load_config", "resolve_auto", "UNIMPLEMENTED_FEATURES",
    "UnimplementedFeature", "DEEPSPEED_VERSION",
]

DEEPSPEED_VERSION = "0.17"  # defaults and key names follow DeepSpeed master of 2025 (>= v0.17)

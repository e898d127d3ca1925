"""DeepSpeed's public names on zero: `import zero.deepspeed as deepspeed` runs DeepSpeed scripts.

A thin map onto zero's real modules (see docs/migrating-from-deepspeed.md). A name DeepSpeed has
and zero does not raises an error that says what to use instead, when it is used; the packages of
a feature zero lacks altogether (`deepspeed.moe`, `deepspeed.inference`, ...) raise ImportError with
the reason when imported.
"""
from __future__ import annotations

import argparse

from zero import __version__  # noqa: F401
from zero.deepspeed import accelerator, checkpointing, comm, ops, runtime, utils, zero  # noqa: F401
from zero.deepspeed._missing import NotAvailableError, missing  # noqa: F401
from zero.deepspeed.comm import init_distributed  # noqa: F401
from zero.deepspeed.engine import DeepSpeedEngine


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None, **kwargs):
    """`deepspeed.initialize`: also takes the config from `args.deepspeed_config` (as set by
    `add_config_arguments` and `--deepspeed_config ds.json`)."""
    if mpu is not None:
        raise ValueError("deepspeed.initialize(mpu=...): zero takes model parallelism from the config (pipeline.stages, "
                         "tensor_parallel.size; see docs/parallelism.md), not from an mpu object; leave mpu unset")
    if config is None and config_params is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    from zero.engine.launch import launch

    return launch(DeepSpeedEngine, args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn, config=config,
                       config_params=config_params, dist_init_required=dist_init_required, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`deepspeed.add_config_arguments`: --deepspeed, --deepspeed_config (and the old --deepscale names)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (zero) training")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def __getattr__(name: str):
    return missing("deepspeed", name)

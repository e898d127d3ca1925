"""`deepspeed.checkpointing`: activation checkpointing, on torch.utils.checkpoint."""
from __future__ import annotations

import torch.utils.checkpoint

from zero.deepspeed._missing import missing

_configured = False


def checkpoint(function, *args):
    """Run `function(*args)` without keeping its activations; they are recomputed in backward
    (torch's non-reentrant checkpoint, which works with stage 3's gathering)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Accepted for DeepSpeed scripts. zero checkpoints activations with torch's checkpoint, which keeps
    no extra copies; partitioning and CPU checkpointing of activations are not implemented."""
    global _configured
    if mpu_ is not None or partition_activations or checkpoint_in_cpu or contiguous_checkpointing:
        import warnings

        warnings.warn("zero: deepspeed.checkpointing.configure: partition_activations, checkpoint_in_cpu, "
                      "contiguous_checkpointing and mpu have no effect in zero (activations are checkpointed with "
                      "torch.utils.checkpoint)", stacklevel=2)
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Nothing to reset: torch's checkpoint keeps no state between steps."""


def __getattr__(name: str):
    return missing("deepspeed.checkpointing", name)

"""`deepspeed.checkpointing`: activation checkpointing, on torch.utils.checkpoint."""
from __future__ import annotations

from zero import activations as _activations
from zero.deepspeed._missing import missing

_configured = False


def checkpoint(function, *args):
    """Run `function(*args)` without keeping its activations; they are recomputed in backward. With
    `configure(partition_activations=True)` / `checkpoint_in_cpu=True` the kept inputs are partitioned
    over the model-parallel group / held in host memory (zero.activations, ZeRO-R)."""
    return _activations.checkpoint(function, *args)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's configure: `partition_activations` splits the checkpointed inputs over `mpu_`'s
    model-parallel group (`mpu_.get_model_parallel_group()`), `checkpoint_in_cpu` keeps them in host
    memory (see [Note: ZeRO-R checkpoints] in zero/activations.py). `contiguous_checkpointing`,
    `num_checkpoints`, `synchronize` and `profile` are DeepSpeed memory-layout and timing knobs with no
    counterpart here (a warning if set)."""
    global _configured
    group = mpu_.get_model_parallel_group() if mpu_ is not None and hasattr(mpu_, "get_model_parallel_group") else None
    _activations.configure(partition_activations, checkpoint_in_cpu, group)
    if contiguous_checkpointing or synchronize or profile:
        import warnings

        warnings.warn("zero: deepspeed.checkpointing.configure: contiguous_checkpointing, synchronize and profile have "
                      "no effect in zero", stacklevel=2)
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Nothing to reset: the checkpoints keep no state between steps."""


def __getattr__(name: str):
    return missing("deepspeed.checkpointing", name)

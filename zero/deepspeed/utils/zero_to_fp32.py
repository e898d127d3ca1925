"""`deepspeed.utils.zero_to_fp32` on zero's checkpoints (see zero/checkpoint/consolidate.py)."""
from __future__ import annotations

import torch

from zero.checkpoint.consolidate import get_fp32_state_dict, to_fp32
from zero.deepspeed._missing import missing


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The full fp32 state dict of a zero checkpoint saved at any world size and stage (`lazy_mode`:
    the tensors are read at once either way)."""
    return get_fp32_state_dict(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load a checkpoint's fp32 weights into a plain `model` (strict) and return it."""
    model.load_state_dict(get_fp32_state_dict(checkpoint_dir, tag), strict=True)
    return model


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the weights in `dtype` into `output_dir`: `pytorch_model.bin` by default, as DeepSpeed
    does (shards and `pytorch_model.bin.index.json` above `max_shard_size`), or safetensors files
    (`model.safetensors`, ...) with `safe_serialization=True`. Returns the files written."""
    return to_fp32(checkpoint_dir, output_dir, tag, max_shard_size, dtype, safe_serialization,
                   exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's argument order)."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.utils.zero_to_fp32` on zero's checkpoints (see zero/checkpoint/consolidate.py)."""
from __future__ import annotations

import torch

from zero.checkpoint.consolidate import get_fp32_state_dict, to_fp32


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The full fp32 state dict of a zero checkpoint saved at any world size and stage."""
    return get_fp32_state_dict(checkpoint_dir, tag)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load a checkpoint's fp32 weights into a plain `model` (strict) and return it."""
    model.load_state_dict(get_fp32_state_dict(checkpoint_dir, tag), strict=True)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, tag=None, max_shard_size="5GB",
                                               safe_serialization=True, exclude_frozen_parameters=False):
    """Write the fp32 weights as safetensors shards (and index) into `output_dir`."""
    if not safe_serialization:
        raise ValueError("zero writes safetensors only (no pickle); drop safe_serialization=False")
    return to_fp32(checkpoint_dir, output_dir, tag, max_shard_size, torch.float32)

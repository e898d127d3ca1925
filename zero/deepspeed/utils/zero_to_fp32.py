"""`deepspeed.utils.zero_to_fp32` on zero's checkpoints (see zero/checkpoint/consolidate.py)."""
from __future__ import annotations

import torch

from zero.checkpoint.consolidate import get_fp32_state_dict, to_fp32
from zero.deepspeed._missing import missing


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The full fp32 state dict of a zero checkpoint saved at any world size and stage."""
    return get_fp32_state_dict(checkpoint_dir, tag)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load a checkpoint's fp32 weights into a plain `model` (strict) and return it."""
    model.load_state_dict(get_fp32_state_dict(checkpoint_dir, tag), strict=True)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, tag=None, max_shard_size="5GB",
                                               safe_serialization=False, exclude_frozen_parameters=False):
    """Write the fp32 weights into `output_dir`: `pytorch_model.bin` by default, as DeepSpeed
    does (shards and `pytorch_model.bin.index.json` above `max_shard_size`), or safetensors files
    (`model.safetensors`, ...) with `safe_serialization=True`. Returns the files written."""
    return to_fp32(checkpoint_dir, output_dir, tag, max_shard_size, torch.float32, safe_serialization)


def __getattr__(name: str):
    return missing(__name__, name)

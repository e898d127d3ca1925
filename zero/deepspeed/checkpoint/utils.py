"""`deepspeed.checkpoint.utils`: the file names of DeepSpeed's checkpoints (for scripts that read or
convert them; zero's own checkpoints are laid out by zero.checkpoint) and clone_tensors_for_torch_save."""
from __future__ import annotations

import os

import torch

from zero.deepspeed._missing import missing


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The path of a DeepSpeed checkpoint's model-states file for a model-parallel rank given as a string
    (`"00"`): `<base_folder>/mp_rank_00_model_states.pt`."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """The path of a DeepSpeed checkpoint's ZeRO optimizer-states file for a data- and model-parallel rank:
    `<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp, 2 digits>_optim_states.pt`."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """The path of a DeepSpeed pipeline checkpoint's file for one layer and tensor-parallel rank:
    `<base_folder>/<layer_id>-model_<tp, 2 digits>_model_states.pt`."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}_model_states.pt")


def clone_tensors_for_torch_save(item, device: torch.device | str = "cpu"):
    """`item` (tensors in lists, tuples and dicts) with every tensor copied to `device`, so that
    `torch.save` writes each tensor alone rather than the whole storage it is a view of."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def __getattr__(name: str):
    return missing(__name__, name)

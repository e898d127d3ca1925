"""A plain state dict from a zero checkpoint saved at any world size and stage (DeepSpeed's
`zero_to_fp32`), in Python or as safetensors shards for `load_state_dict` / `from_pretrained`.

    python -m zero.checkpoint to-fp32 CKPT_DIR OUT_DIR [--tag T] [--max-shard-size 5GB] [--dtype bf16]

Each tensor is put together from the chunks every rank saved (see [Note: checkpoint chunks]),
one at a time: trainable parameters from their fp32 master, frozen ones and buffers from the
model's copy. Memory stays at the largest tensor plus one output shard.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from zero.checkpoint.placement import to_whole
from zero.checkpoint.tags import CheckpointError, read_state, resolve_tag

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9 bytes (also KB, MB, KiB, MiB, GiB, or a plain number of bytes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS | {"": 1}:
        raise ValueError(f"max shard size {text!r}: expected a number with an optional unit (KB, MB, GB, GiB)")
    return int(float(m.group(1)) * _UNITS.get(m.group(2).upper(), 1))


def _chunks_by_name(tensor_dir: Path) -> dict[str, list[tuple[int, str, int]]]:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    md = HuggingFaceStorageReader(str(tensor_dir)).read_metadata()
    out: dict[str, list[tuple[int, str, int]]] = {}
    for index, info in md.storage_data.items():
        out.setdefault(index.fqn, []).append((int(index.offset[0]), str(info.relative_path), int(info.shape[0])))
    return out


def iter_full_tensors(checkpoint_dir: str | os.PathLike, tag: str | None = None, dtype: torch.dtype = torch.float32,
                      exclude_frozen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every saved tensor, one at a time, floating ones in `dtype`; without
    the parameters that were frozen (requires_grad=False) when saved, with `exclude_frozen`."""
    from safetensors import safe_open

    path = resolve_tag(checkpoint_dir, tag)
    state = read_state(path)
    chunks = _chunks_by_name(path / "tensors")
    for name, info in state["tensors"].items():
        if exclude_frozen and info["parameter"] and not info["trainable"]:
            continue
        key = f"master/{name}" if info["trainable"] and f"master/{name}" in chunks else f"model/{name}"
        if key not in chunks:
            continue  # excluded when saved (exclude_frozen_parameters)
        shape = info["shape"]
        numel = math.prod(shape)
        parts = sorted(chunks[key])
        full = None
        covered = 0
        for offset, file, length in parts:
            with safe_open(file, framework="pt") as f:
                piece = f.get_tensor(key)
            if full is None:
                full = torch.empty(numel, dtype=piece.dtype)
            full[offset : offset + length].copy_(piece)
            covered += length
        if covered < numel:
            raise CheckpointError(f"{path / 'tensors'}: {key} has {covered} of its {numel} elements; a rank's file "
                                  f"is missing")
        out = to_whole(full, shape, info.get("layout"))  # tensor-parallel slices back in place
        yield name, out.to(dtype) if out.is_floating_point() else out


def get_fp32_state_dict(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                        dtype: torch.dtype = torch.float32, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """The model's full state dict (tied parameters under every name, as `state_dict()`)."""
    path = resolve_tag(checkpoint_dir, tag)
    out = dict(iter_full_tensors(checkpoint_dir, tag, dtype, exclude_frozen))
    for alias, target in read_state(path).get("tied", {}).items():
        if target in out:
            out[alias] = out[target]
    return out


def to_fp32(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, tag: str | None = None,
            max_shard_size: str | int = "5GB", dtype: torch.dtype = torch.float32,
            safe_serialization: bool = True, exclude_frozen: bool = False) -> list[str]:
    """Write safetensors shards and `model.safetensors.index.json` (HuggingFace's layout; one
    `model.safetensors` when everything fits one shard). Tied parameters are saved once, as
    HuggingFace does. With `safe_serialization=False`, torch.save files in HuggingFace's older
    layout instead (`pytorch_model.bin`, or `pytorch_model-0000i-of-0000n.bin` shards and
    `pytorch_model.bin.index.json`): plain tensor dicts, which `torch.load(weights_only=True)`
    reads. Returns the files written."""
    from safetensors.torch import save_file

    def save(tensors: dict, path: Path) -> None:
        if safe_serialization:
            save_file(tensors, str(path), metadata={"format": "pt"})
        else:
            torch.save(tensors, path)

    stem, suffix = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    limit = parse_size(max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        nonlocal current, size
        if current:
            save(current, out / f".shard-{len(shards)}.tmp")
            shards.append(list(current))
            current, size = {}, 0

    for name, t in iter_full_tensors(checkpoint_dir, tag, dtype, exclude_frozen):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            flush()
        current[name] = t.contiguous()
        size += nbytes
        total += nbytes
    flush()
    files = []
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"{stem}.{suffix}" if len(shards) == 1 else f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{suffix}"
        os.replace(out / f".shard-{i}.tmp", out / final)
        files.append(str(out / final))
        weight_map.update(dict.fromkeys(names, final))
    if len(shards) > 1:
        index = out / f"{stem}.{suffix}.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        files.append(str(index))
    return files


def load_sharded_safetensors(out_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read what `to_fp32` wrote back into one state dict (for checks and plain torch users)."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    single = out / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(out / file)))
    return state

"""Checkpoints: the consolidated 16-bit model (stage 3 gathers it one parameter at a time).

Files are written to a temporary name in the same directory and moved into place, so a crash
never leaves a half-written checkpoint under the final name.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from zero.comm import Comm


def atomic_save(obj, path: str | os.PathLike) -> None:
    """torch.save to a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@torch.no_grad()
def consolidated_state_dict(module: nn.Module, comm: Comm, exclude_frozen_parameters: bool = False) -> dict | None:
    """The module's full state dict on rank 0 (None on other ranks); every rank must call it.

    Sharded parameters are gathered one at a time, so no rank ever holds more than one full
    parameter beyond rank 0's output. Tied parameters appear under every name, as in
    `module.state_dict()`, and are gathered once.
    """
    from zero.init import GatheredParameters

    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and exclude_frozen_parameters and not value.requires_grad:
            continue
        if id(value) in done:
            if comm.rank == 0:
                out[name] = done[id(value)]
            continue
        if getattr(value, "_zero", None) is not None:
            with GatheredParameters([value]):
                copy = value.detach().cpu().clone() if comm.rank == 0 else None
        else:
            copy = value.detach().cpu().clone() if comm.rank == 0 else None
        done[id(value)] = copy
        if comm.rank == 0:
            out[name] = copy
    return out if comm.rank == 0 else None

"""Joining the process group a launcher describes, leaving it at exit, and the device a rank computes on."""
from __future__ import annotations

import atexit
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from zero.parallel.comm import Comm, collective_timeout_s


def init_distributed(dist_backend: str | None = None, timeout_s: float | None = None, init_method: str | None = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Join the torch.distributed group that torchrun (or a similar launcher) describes, or the
    one `init_method`, `rank` and `world_size` describe (torch's `init_process_group` arguments).

    Does nothing if a group is already initialised, or when neither a launcher environment nor
    an `init_method` is there (a world of one). The backend is NCCL when CUDA is available, gloo
    otherwise.

    Args:
        dist_backend: override the backend ("nccl", "gloo").
        timeout_s: the process group's collective timeout in seconds (default: ZERO_COLLECTIVE_TIMEOUT,
            1800), after which NCCL's watchdog ends a hung collective; see [Note: bounded waits]
            in zero/parallel/comm.py.
        init_method: where the ranks meet ("tcp://host:port", "file:///path"); default the
            launcher's environment ("env://").
        rank, world_size: this process's rank and the number of ranks (-1: from the environment).
    """
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    if dist.is_initialized():
        return
    if not launched and init_method in (None, "env://"):
        if rank != -1 or world_size != -1:
            raise ValueError(f"init_distributed(rank={rank}, world_size={world_size}) without init_method, and no "
                             f"launcher set MASTER_ADDR/WORLD_SIZE: pass init_method='tcp://host:port' (or "
                             f"'file:///shared/path') too, or launch with torchrun")
        return  # a world of one
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {}
    if "nccl" in backend:  # bind the rank to its GPU up front (no device guessing, eager communicator)
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else max(rank, 0) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if timeout_s is None:
        timeout_s = collective_timeout_s()
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """[Note: gloo at exit]
    A gloo group still alive when the interpreter shuts down can abort the process from its worker
    threads ("terminate called without an active exception", pytorch/pytorch#190489): measured on
    torch 2.13, 2 ranks exiting after a few collectives abort in about half the runs once a torch
    optimizer exists. `destroy_process_group()` alone is not enough there, because a reference
    cycle keeps the group alive; destroying it and then collecting garbage, while the interpreter
    is still whole, brings it to 0 in 12 runs. So the group zero created, zero also takes down."""
    if dist.is_initialized():
        dist.destroy_process_group()
        import gc

        gc.collect()


def compute_device(comm: Comm) -> torch.device:
    """The current CUDA device, unless there is none or the process group is gloo-only (CPU ranks)."""
    if not torch.cuda.is_available() or (comm.distributed and not comm.uses_nccl):
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    local = os.environ.get("LOCAL_RANK")
    if comm.distributed and local is not None and int(local) != device.index and torch.cuda.device_count() > 1:
        warnings.warn(f"zero: LOCAL_RANK is {local} but the current CUDA device is {device}; call "
                      f"torch.cuda.set_device(LOCAL_RANK) before init_process_group (or let zero.initialize do it), "
                      f"or several ranks will share one GPU", stacklevel=3)
    return device

"""Where a run keeps its optimizer state and runs its update: one class per place.

[Note: offload policies]
A run's optimizer state (master weights, moments, any rule's declared state; see [Note: declared
state] in zero/optim/rules.py) lives where its offload policy says, and the `StateStore`
(zero/offload/store.py) made from the policy allocates it there, iterates it in tiles for the host
step, and gives checkpoints and accessors their views of it:
- `OnDevice`: with the model, updated where the model computes (no offload).
- `CPUOffload`: in host memory (page-locked where asked), updated by the host step in tiles
  (zero/offload/host.py): DeepSpeed's `offload_optimizer.device: cpu`.
- `NVMeOffload`: in files on a local drive, read into host buffers tile by tile for the same host
  step and written back (zero/offload/nvme.py): DeepSpeed's `offload_optimizer.device: nvme`.
The storages, the step and the readers go through the store and do not change with the place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zero.ops.adam_formats import Q8_BLOCK

if TYPE_CHECKING:
    from zero.config import ZeroConfig


class OffloadPolicy:
    """Where optimizer state lives (see [Note: offload policies])."""

    on_host = False  # state in host memory: the update runs there, on host copies of the gradients
    pin_memory = False
    tile_elements = 1 << 22
    num_threads: int | None = None
    on_disk = False  # state in files, read into host buffers for the step

    def describe(self) -> str:
        return "with the model"


@dataclass(frozen=True)
class OnDevice(OffloadPolicy):
    """No offload: the state lives with the model, updated where the model computes."""


@dataclass(frozen=True)
class CPUOffload(OffloadPolicy):
    """Optimizer offload to host memory (DeepSpeed's `offload_optimizer.device: cpu`).

    Args:
        pin_memory: page-lock host buffers (asynchronous copies; needs CUDA).
        tile_elements: elements per host-step tile (DeepSpeed's `sub_group_size`, capped, a
            multiple of the 8-bit moments' block).
        num_threads: host-step threads (see zero.offload.host.cpu_adam_threads).
    """

    pin_memory: bool = True
    tile_elements: int = 1 << 22  # a multiple of Q8_BLOCK
    num_threads: int = 1
    on_host = True

    def describe(self) -> str:
        return "in host memory"


@dataclass(frozen=True)
class NVMeOffload(CPUOffload):
    """Optimizer offload to files (ZeRO-Infinity; DeepSpeed's `offload_optimizer.device: nvme`):
    the host step of CPUOffload on tiles read from the files ahead of it and written back behind
    it (see [Note: NVMe data path] in zero/offload/nvme.py).

    Args:
        path: the directory of the swap files (`nvme_path`).
        buffer_count: host buffers of one tile's state each (`buffer_count`).
        pipeline_read, pipeline_write: read ahead / write behind the tile being stepped.
        block_size, queue_depth, threads: the `aio` section (bytes per request, requests queued,
            I/O threads).
    """

    path: str = ""
    buffer_count: int = 4
    pipeline_read: bool = True
    pipeline_write: bool = True
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    on_disk = True

    def describe(self) -> str:
        return f"in files under {self.path}"


@dataclass(frozen=True)
class ParamNVMe:
    """Stage-3 parameter shards in files (ZeRO-Infinity; DeepSpeed's `offload_param.device: nvme`),
    read ahead of the modules that use them (see [Note: parameters on NVMe] in
    zero/offload/param_swap.py).

    Args:
        path: the directory of the swap files (`nvme_path`).
        buffer_count: host buffers of one unit's shard each (`buffer_count`).
        buffer_size: elements a buffer may hold (`buffer_size`; the largest unit's shard must fit).
        max_in_cpu: elements of shards kept in host memory (`max_in_cpu`).
        pin_memory: page-lock the buffers and the shards in host memory.
        block_size, queue_depth, threads: the `aio` section.
    """

    path: str
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1


def param_nvme_policy(cfg: ZeroConfig) -> ParamNVMe | None:
    """The policy `zero_optimization.offload_param.device: nvme` (and `aio`) ask for, else None."""
    op = cfg.zero_optimization.offload_param
    if cfg.zero_optimization.stage != 3 or op is None or op.device != "nvme":
        return None
    aio = cfg.aio
    return ParamNVMe(path=str(op.nvme_path), buffer_count=op.buffer_count, buffer_size=op.buffer_size,
                     max_in_cpu=op.max_in_cpu, pin_memory=op.pin_memory, block_size=aio.block_size,
                     queue_depth=aio.queue_depth, threads=aio.intra_op_parallelism)


def offload_policy(cfg: ZeroConfig, num_threads: int) -> OffloadPolicy:
    """The policy `zero_optimization.offload_optimizer` (and `aio`) ask for.

    Args:
        cfg: the config.
        num_threads: host-step threads.
    """
    zc, opt = cfg.zero_optimization, cfg.zero_optimization.offload_optimizer
    tile = max(Q8_BLOCK, min(zc.sub_group_size or 1 << 22, 1 << 22)) // Q8_BLOCK * Q8_BLOCK  # whole 8-bit blocks
    if opt is None or opt.device == "none":
        return OnDevice()
    if opt.device == "cpu":
        return CPUOffload(pin_memory=opt.pin_memory, tile_elements=tile, num_threads=num_threads)
    aio = cfg.aio
    return NVMeOffload(pin_memory=opt.pin_memory, tile_elements=tile, num_threads=num_threads, path=str(opt.nvme_path),
                       buffer_count=opt.buffer_count, pipeline_read=opt.pipeline_read,
                       pipeline_write=opt.pipeline_write, block_size=aio.block_size, queue_depth=aio.queue_depth,
                       threads=aio.intra_op_parallelism)

"""Where a run keeps its optimizer state and runs its update: one class per place.

[Note: offload policies]
A run's optimizer state (master weights, moments, any rule's declared state; see [Note: declared
state] in zero/optim/rules.py) lives where its offload policy says, and the `StateStore`
(zero/offload/store.py) made from the policy allocates it there, iterates it in tiles for the host
step, and gives checkpoints and accessors their views of it:
- `OnDevice`: with the model, updated where the model computes (no offload).
- `CPUOffload`: in host memory (page-locked where asked), updated by the host step in tiles
  (zero/offload/host.py): DeepSpeed's `offload_optimizer.device: cpu`.
A new place for state (NVMe, with tiles fetched from and written back to files) is a new policy
here and a store that fetches and writes back; the storages, the step and the readers go through
the store and do not change.
"""
from __future__ import annotations

from dataclasses import dataclass


class OffloadPolicy:
    """Where optimizer state lives (see [Note: offload policies])."""

    on_host = False  # state in host memory: the update runs there, on host copies of the gradients
    pin_memory = False
    tile_elements = 1 << 22
    num_threads: int | None = None

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

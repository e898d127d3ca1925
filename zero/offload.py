"""ZeRO-Offload: the fp32 master weights, Adam's moments and the update live in host memory.

[Note: offload data path]
Per rank and step, with Psi/N the rank's share of the parameters:
1. Backward: as soon as a gradient shard is final for the step (its bucket or unit was reduced on
   the accumulation-boundary micro-step), it is copied to a host staging buffer of the same dtype
   (`HostAdam.grad_ready`), asynchronously on CUDA (pinned memory), while backward goes on. That
   is the 2 Psi/N bytes (16-bit) that leave the device.
2. Step: the CPU Adam (AVX-512/AVX2, OpenMP on the rank's share of the cores) updates the host
   fp32 master, exp_avg and exp_avg_sq tile by tile, and writes the tile's new 16-bit values in
   the same pass. Each finished tile is copied back to the device (asynchronously, through two
   alternating pinned buffers) while the next tile is being updated: the 2 Psi/N bytes that come
   back. The step ends when the last copy has landed.
3. The model's 16-bit parameters never leave the device (stage 3 with `offload_param` keeps their
   shards on the host too, and stages a shard onto the device only to all-gather it).

On a machine without a GPU the host is the device. The same code path still runs, with its own
host buffers and real copies, which is what the CPU tests exercise.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function


def cpu_adam_threads() -> int:
    """Threads the host Adam uses: $ZERO_CPU_ADAM_THREADS, else this host's cores divided evenly
    among the ranks on it (torchrun's LOCAL_WORLD_SIZE), so ranks do not fight over cores."""
    if os.environ.get("ZERO_CPU_ADAM_THREADS"):
        return max(1, int(os.environ["ZERO_CPU_ADAM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def host_empty(like: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty host tensor shaped like `like`, pinned when asked and CUDA is there to pin for."""
    t = torch.empty(like.shape, dtype=dtype or like.dtype, device="cpu")
    return t.pin_memory() if pin and torch.cuda.is_available() else t


@dataclass(frozen=True)
class OffloadOptions:
    """How optimizer offload runs.

    Args:
        pin_memory: pin host buffers (faster asynchronous copies; needs CUDA).
        tile_elements: elements per CPU Adam tile (DeepSpeed's `sub_group_size`, capped).
        num_threads: CPU Adam threads (see cpu_adam_threads).
        overlap: copy gradients out during backward and pipeline the copy-back tile by tile;
            False does every copy inside the step, one whole shard at a time (for comparison).
    """

    pin_memory: bool = True
    tile_elements: int = 1 << 22
    num_threads: int = 1
    overlap: bool = True


class _Copy:
    """A copy that may still be running: an event on CUDA, nothing to wait for on the CPU."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor):
        dst.copy_(src, non_blocking=True)
        self.event = None
        if src.is_cuda or dst.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostAdam:
    """The host side of an offloaded optimizer: gradient staging, tiled CPU Adam, copies back.

    Args:
        slots: the optimizer's slots (group, master, grad, exp_avg, exp_avg_sq, out16); master,
            exp_avg and exp_avg_sq are host tensors, grad and out16 live where the model is.
        options: OffloadOptions.
    """

    def __init__(self, slots, options: OffloadOptions):
        self.options = options
        self.grads = [host_empty(s[2], options.pin_memory) for s in slots]
        self.index = {id(s[2]): i for i, s in enumerate(slots)}
        self.pending: dict[int, _Copy] = {}
        # two alternating staging tiles per 16-bit dtype: one being filled, one being copied
        self.staging: dict[torch.dtype, list[torch.Tensor]] = {}
        self.times = {"grad_copy_wait": 0.0, "cpu_adam": 0.0, "param_copy_wait": 0.0}

    def grad_ready(self, grad: torch.Tensor) -> None:
        """A gradient shard is final for this step: start copying it to the host."""
        i = self.index.get(id(grad))
        if i is not None and self.options.overlap:
            with record_function("zero::offload_grad_copy"):
                self.pending[i] = _Copy(self.grads[i], grad)

    def step(self, slots, adam, out16_on_host: list[bool]) -> None:
        """Run `adam(group, master, grad, exp_avg, exp_avg_sq, out16)` on host tiles and copy the
        results to each slot's out16 (which lives on the device unless `out16_on_host[i]`)."""
        ring: list[_Copy | None] = [None, None]
        k = 0
        for i, (group, master, grad, exp_avg, exp_avg_sq, out16) in enumerate(slots):
            start = time.perf_counter()
            (self.pending.pop(i, None) or _Copy(self.grads[i], grad)).wait()  # not copied during backward: now
            self.times["grad_copy_wait"] += time.perf_counter() - start
            n = master.numel()
            tile = self.options.tile_elements if self.options.overlap else max(n, 1)
            for lo in range(0, n, tile):
                hi = min(n, lo + tile)
                staged = out16 is not None and out16.dtype != torch.float32 and not out16_on_host[i]
                if staged:  # the 16-bit result goes through a staging tile, then to the device
                    start = time.perf_counter()
                    if ring[k % 2] is not None:
                        ring[k % 2].wait()  # its previous copy must have landed before it is reused
                    self.times["param_copy_wait"] += time.perf_counter() - start
                    target = self._staging_tile(out16.dtype, k % 2, hi - lo)
                elif out16 is not None and out16.dtype != torch.float32:
                    target = out16[lo:hi]  # a host shard (offload_param): written in place
                else:
                    target = None
                start = time.perf_counter()
                with record_function("zero::cpu_adam_tile"):
                    adam(group, master[lo:hi], self.grads[i][lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], target)
                self.times["cpu_adam"] += time.perf_counter() - start
                if out16 is not None and (staged or out16.dtype == torch.float32):
                    with record_function("zero::offload_param_copy"):  # fp32 training copies the master itself
                        ring[k % 2] = _Copy(out16[lo:hi], target if staged else master[lo:hi])
                    k += 1
        start = time.perf_counter()
        for c in ring:
            if c is not None:
                c.wait()
        self.times["param_copy_wait"] += time.perf_counter() - start

    def _staging_tile(self, dtype: torch.dtype, which: int, numel: int) -> torch.Tensor:
        bufs = self.staging.setdefault(dtype, [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)])
        if bufs[which].numel() < numel:
            t = torch.empty(numel, dtype=dtype)
            bufs[which] = t.pin_memory() if self.options.pin_memory and torch.cuda.is_available() else t
        return bufs[which][:numel]

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grads) + sum(
            t.numel() * t.element_size() for bufs in self.staging.values() for t in bufs)

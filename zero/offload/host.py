"""ZeRO-Offload: the fp32 master weights, the optimizer state and the update live in host memory.

[Note: offload data path]
Per rank and step, with Psi/N the rank's share of the parameters:
1. Backward: as soon as a gradient shard is final for the step (its bucket or unit was reduced on
   the accumulation-boundary micro-step), it is copied to a host staging buffer of the same dtype
   (`HostAdam.grad_ready`). On CUDA the copy runs on a copy stream, after the reduction that
   produced the shard and beside the rest of backward, into page-locked memory. That is the
   2 Psi/N bytes (16-bit) that leave the device.
2. Step: the CPU Adam (AVX-512/AVX2, OpenMP on the rank's share of the cores) updates the host
   fp32 master, exp_avg and exp_avg_sq tile by tile, and writes the tile's new 16-bit values in
   the same pass. Each finished tile is copied back to the device on the copy stream, through two
   alternating page-locked tiles, while the next tile is being updated: the 2 Psi/N bytes that
   come back. The compute stream waits for the last of them before the parameters are used.
   Other update rules step on the same host masters and the state they declare (see [Note:
   declared state] in zero/optim/rules.py), on gradients fetched to the host (`HostAdam.fetch`):
   Lion and Adagrad with zero's native CPU kernels, other client optimizers with torch's step,
   Muon with Newton-Schulz where the model computes.
3. The model's 16-bit parameters never leave the device (stage 3 with `offload_param` keeps their
   shards on the host too, and stages a shard onto the device only to all-gather it).

On a machine without a GPU the host is the device. The same code path still runs, with its own
host buffers and real copies, which is what the CPU tests exercise.

[Note: page-locked host memory]
`tensor.pin_memory()` copies into a second, pinned tensor (twice the host memory for a moment),
and torch's pinned allocator rounds every block up to a power of two and caches freed blocks. Host
state here is allocated pageable and then page-locked in place with `cudaHostRegister`: no copy,
no rounding. The registrations are undone when the optimizer that owns the memory is collected.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch.autograd.profiler import record_function

if TYPE_CHECKING:
    from zero.offload.store import StateStore


def cpu_adam_threads() -> int:
    """Threads the host Adam uses: $ZERO_CPU_ADAM_THREADS, else this host's cores divided evenly
    among the ranks on it (torchrun's LOCAL_WORLD_SIZE), so ranks do not fight over cores."""
    if os.environ.get("ZERO_CPU_ADAM_THREADS"):
        return max(1, int(os.environ["ZERO_CPU_ADAM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _unregister(tensors: list[torch.Tensor]) -> None:
    """Unregister page-locked host tensors (a weakref finalizer: it may run inside any
    allocation's garbage collection, even inside torch's own CUDA initialisation, so it never
    initialises CUDA itself: with nothing registered, or CUDA never initialised, it does nothing)."""
    if not tensors or not torch.cuda.is_initialized():
        tensors.clear()
        return
    try:
        cudart = torch.cuda.cudart()
        for t in tensors:
            cudart.cudaHostUnregister(t.data_ptr())
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
        pass
    tensors.clear()


def _clear_cuda_error() -> None:
    """cudaGetLastError(), which torch's cudart binding lacks: through the CUDA runtime library
    this process loaded (torch's), found by its exported symbol or in /proc/self/maps."""
    import ctypes

    candidates = [None]
    try:
        with open("/proc/self/maps") as maps:
            candidates += sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        pass
    for name in candidates:
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class HostMemory:
    """Host tensors for offloaded state; see [Note: page-locked host memory].

    Args:
        owner: the object whose lifetime the registrations follow (the optimizer).
    """

    def __init__(self, owner: object):
        self._registered: list[torch.Tensor] = []
        weakref.finalize(owner, _unregister, self._registered)

    def empty(self, shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        """An uninitialised host tensor, page-locked when `pin` and CUDA is there to pin for."""
        t = torch.empty(shape, dtype=dtype, device="cpu")
        if not pin or not torch.cuda.is_available() or t.numel() == 0 or self.register(t):
            return t
        try:  # torch's pinned allocator (it rounds sizes up, so it is the second choice)
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        except RuntimeError as exc:
            _clear_cuda_error()
            warnings.warn(f"zero: {t.untyped_storage().nbytes()} bytes of host memory could not be page-locked "
                          f"({exc}); offload copies of this tensor run from pageable memory, slower and not "
                          f"overlapped", stacklevel=2)
            return t

    def register(self, t: torch.Tensor) -> bool:
        """Page-lock host tensor `t` in place (until the owner is collected); False if refused."""
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0:
            self._registered.append(t)
            return True
        # registration refused (host memory short, or a sandbox that does not allow it): clear the
        # runtime's last error, or the next kernel launch check (torch's or ours) would report it
        _clear_cuda_error()
        return False

    def empty_pageable(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype, pin=False)


class _Copy:
    """A copy that may still be running: on CUDA it runs on `stream` and records an event."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, stream):
        self.event = None
        if stream is None:
            dst.copy_(src)
            return
        stream.wait_stream(torch.cuda.current_stream())  # after whatever produced `src`
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def wait(self) -> None:
        """Block the host until the copy has landed."""
        if self.event is not None:
            self.event.synchronize()

    def join(self) -> None:
        """Make the current stream wait for the copy (the host goes on)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class _Write:
    """A write of a staging tile to a swap file (an aio request) that may still be running."""

    def __init__(self, request):
        self.request = request

    def wait(self) -> None:
        self.request.wait()

    join = wait  # the next reads of the file must see it: the host waits


class HostAdam:
    """The host side of an offloaded optimizer: gradient staging, tiled updates, copies back.

    Args:
        slots: the optimizer's slots (zero.stages.storage.Slot): masters and state are in the
            store; gradients and 16-bit outputs live where the model is.
        store: the state store (zero/offload/store.py): its policy, its host memory, its tiles.
        swap: where stage 3 keeps parameter shards on NVMe (zero/offload/param_swap.py), or None:
            an output in it is written through a staging tile with the aio op.
    """

    def __init__(self, slots, store: StateStore, swap=None):
        self.store = store
        self.swap = swap
        options = self.options = store.policy
        memory = self.memory = store.memory
        on_cuda = any(s.grad.is_cuda for s in slots)
        self.stream = torch.cuda.Stream() if on_cuda else None
        if on_cuda and not options.pin_memory:
            warnings.warn("zero: offload_optimizer.pin_memory is false, so every copy between the GPU and the host "
                          "blocks the host (set pin_memory: true to overlap them with backward)", stacklevel=3)
        self.grads = [memory.empty(s.grad.shape, s.grad.dtype, options.pin_memory) for s in slots]
        self.index = {id(s.grad): i for i, s in enumerate(slots)}  # a slot's gradient shard is one object throughout
        self.pending: dict[int, _Copy] = {}
        # two alternating staging tiles per 16-bit dtype: one being filled, one being copied
        self.staging: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
        self.times = {"grad_copy_wait": 0.0, "cpu_adam": 0.0, "param_copy_wait": 0.0}

    def grad_ready(self, grad: torch.Tensor) -> None:
        """A gradient shard is final for this step: start copying it to the host."""
        i = self.index.get(id(grad))
        if i is not None:
            with record_function("zero::offload_grad_copy"):
                self.pending[i] = _Copy(self.grads[i], grad, self.stream)

    def discard(self) -> None:
        """Forget copies of a step that will not happen (a skipped step, zero_grad): later
        writes to the gradient shards wait for them, and no later step reads them."""
        for c in self.pending.values():
            c.join()
        self.pending.clear()

    def fetch(self, slot) -> torch.Tensor:
        """The slot's gradient in host memory, once its copy landed (copied now if it was not yet)."""
        i = self.index[id(slot.grad)]
        start = time.perf_counter()
        (self.pending.pop(i, None) or _Copy(self.grads[i], slot.grad, self.stream)).wait()
        self.times["grad_copy_wait"] += time.perf_counter() - start
        return self.grads[i]

    def step(self, slots, update, out16_on_host: bool) -> None:
        """Run `update(tile, out16)` on host tiles of `slots` (an element-wise rule's update of the
        tile, a Slot whose gradient is the host copy, writing its 16-bit result into `out16`) and
        copy the results to each slot's out16, which lives on the device unless `out16_on_host`.
        Tiles are whole 8-bit blocks (`tile_elements` is a multiple of Q8_BLOCK)."""
        ring: list[_Copy | None] = [None, None]
        k = 0
        work = [(slot, lo, hi) for slot in slots for lo, hi in self.store.tiles(slot.master.numel())]
        grads: dict[int, torch.Tensor] = {}
        for slot, lo, hi, make in self.store.walk(work):
            if id(slot) not in grads:  # not copied yet: now
                grads = {id(slot): self.fetch(slot)}
            grad, out16 = grads[id(slot)], slot.out16
            staged = out16 is not None and out16.dtype != torch.float32 and not out16_on_host
            on_disk = out16 is not None and self.swap is not None and self.swap.holds(out16)
            if staged or on_disk:  # through a staging tile, then to the device (or to the swap file)
                start = time.perf_counter()
                if ring[k % 2] is not None:
                    ring[k % 2].wait()  # its previous copy must have landed before it is reused
                self.times["param_copy_wait"] += time.perf_counter() - start
                target = self._staging_tile(out16.dtype, k % 2, hi - lo, aligned=on_disk)
            elif out16 is not None and out16.dtype != torch.float32:
                target = out16[lo:hi]  # a host shard (offload_param): written in place
            else:
                target = None
            start = time.perf_counter()
            with record_function("zero::cpu_adam_tile"):
                tile = make(grad[lo:hi], None if on_disk and out16.dtype == torch.float32 else target)
                update(tile, None if on_disk and out16.dtype == torch.float32 else target)
            self.times["cpu_adam"] += time.perf_counter() - start
            if on_disk:  # parameters on NVMe: the shard's new values to its region of the swap file
                if out16.dtype == torch.float32:  # fp32 training: the shard is a copy of the master
                    target.copy_(tile.master)
                ring[k % 2] = _Write(self.swap.write(target, out16[lo:hi]))
                k += 1
            elif out16 is not None and (staged or out16.dtype == torch.float32):
                with record_function("zero::offload_param_copy"):  # fp32 training copies the master itself
                    ring[k % 2] = _Copy(out16[lo:hi], target if staged else tile.master, self.stream)
                if not staged and self.store.policy.on_disk:
                    ring[k % 2].wait()  # the tile's master is a buffer the store reuses once this returns
                k += 1
        for c in ring:  # the parameters are used next on the compute stream
            if c is not None:
                c.join()

    def _staging_tile(self, dtype: torch.dtype, which: int, numel: int, aligned: bool = False) -> torch.Tensor:
        """One of two alternating staging tiles of `dtype` (`aligned`: page-aligned, for direct
        writes to a swap file)."""
        key = (dtype, aligned)
        bufs = self.staging.setdefault(key, [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)])
        if bufs[which].numel() < numel:
            if aligned:
                from zero.ops.aio import aligned_empty

                bufs[which] = aligned_empty(numel * dtype.itemsize).view(dtype)
                if self.options.pin_memory:
                    self.memory.register(bufs[which])
            else:
                bufs[which] = self.memory.empty(numel, dtype, self.options.pin_memory)
        return bufs[which][:numel]

    def host_tensors(self) -> list[torch.Tensor]:
        """Host buffers of its own (gradient staging and copy-back tiles)."""
        return [*self.grads, *(t for bufs in self.staging.values() for t in bufs)]

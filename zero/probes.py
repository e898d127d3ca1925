"""Measure memory instead of counting it: what autograd really holds, and allocator peaks.

[Note: measuring memory on the CPU]
A GPU has an allocator counter (`torch.cuda.max_memory_allocated`); the CPU allocator has none.
Two measurements stand in for it here, and both see real storages, not an engine's bookkeeping:

- `SavedTensorProbe` records, through `torch.autograd.graph.saved_tensors_hooks`, every tensor
  autograd saves for backward. `held_bytes()` is the size of the distinct storages those tensors
  (and any extra tensors given, such as the module's parameters) point to *now*: a storage that
  was freed (resized to 0) counts 0 bytes, one that something still holds counts in full. This
  is how a "released" parameter that autograd still holds a view of is caught.
- `AllocatorPeak` is the peak of bytes allocated (minus freed) by torch's allocator inside the
  `with` block, above the level at its start. On CUDA it reads the allocator's own counters; on
  the CPU it reads the allocation and free events torch's profiler records with
  `profile_memory=True` (c10's CPU allocator reports each one, with its address). A free is
  counted only for a block allocated inside the `with` block (the profiler also reports frees of
  blocks whose allocation an earlier profiling session saw), so the CPU figure is the peak of what
  was allocated inside the block: exactly what a phase adds.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`, at their current size."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class SavedTensorProbe:
    """Context manager: remember (weakly) every tensor autograd saves for backward inside it.

    Tensors are returned unchanged by the pack hook, so autograd behaves exactly as without the
    probe; the probe only keeps weak references and asks, later, what their storages hold.
    """

    def __init__(self) -> None:
        self._saved: list[weakref.ref] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self._saved.append(weakref.ref(t))
        except TypeError:  # pragma: no cover - tensor subclasses without weakref support
            pass
        return t

    def __enter__(self) -> SavedTensorProbe:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def saved(self) -> list[torch.Tensor]:
        """The saved tensors still alive (autograd frees them as backward consumes them)."""
        return [t for t in (r() for r in self._saved) if t is not None]

    def held_bytes(self, extra: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of distinct storages held by the saved tensors and by `extra`, right now."""
        return distinct_storage_bytes([*self.saved(), *extra])


class AllocatorPeak:
    """Context manager: `peak` = most bytes allocated above the starting level inside the block,
    `end` = bytes allocated inside the block that are still allocated at its end.

    Args:
        device: "cuda" to read the CUDA caching allocator's counters, "cpu" (default) to read
            the CPU allocator's events from torch's profiler. See [Note: measuring memory on
            the CPU].
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.peak = 0
        self.end = 0
        self._prof = None

    def __enter__(self) -> AllocatorPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        live: dict[int, int] = {}  # address -> bytes of each block allocated inside the block
        total = peak = 0
        for _, ptr, nbytes in _cpu_allocations(self._prof):
            if nbytes > 0:
                live[ptr] = live.get(ptr, 0) + nbytes
                total += nbytes
            elif ptr in live:  # a free of a block allocated before the block: not ours
                total -= live.pop(ptr)
            peak = max(peak, total)
        self.peak = peak
        self.end = total


def _cpu_allocations(prof) -> list[tuple[int, int, int]]:
    """(time, address, bytes: + allocated, - freed) of each CPU allocator event `prof` recorded, in order."""
    from torch._C._profiler import _ExtraFields_Allocation

    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        extra = e.extra_fields
        if isinstance(extra, _ExtraFields_Allocation) and extra.device.type == "cpu":
            out.append((e.start_time_ns, extra.ptr, extra.alloc_size))
        todo.extend(e.children)
    return sorted(out)

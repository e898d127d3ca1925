"""Stage-3 parameter shards on NVMe (ZeRO-Infinity's parameter offload).

[Note: parameters on NVMe]
Under `offload_param.device: nvme` each unit's shard (see [Note: parameter units] in
zero/stages/unit.py) lives in host memory or in a swap file of its own (a SwapFile of
zero/offload/nvme.py: one 4 KiB-aligned region per unit, mapped into memory):
- In host memory: the persistent parameters (gathered once per step) and the first units in model
  order while their shards stay within `max_in_cpu` elements. The rest are on disk.
- The mapping is what checkpoints, accessors and load_state_dict read and write, as they would a
  host shard. The host step of optimizer offload writes the updated shards with the aio op from
  staging tiles (zero/offload/host.py); an optimizer stepping where the model computes writes them
  through the mapping. The gathers do not go through it:
1. Read ahead. The stage-3 runtime follows the recorded order of units (see [Note: prefetch and
   reuse] in zero/stages/stage3.py): beyond the all-gathers it prefetches, it starts reading the
   shards of the next units on disk into free host buffers with the aio op (zero/ops/aio.py,
   O_DIRECT where aligned). There are `buffer_count` buffers, each the size of the largest shard
   on disk (at most `buffer_size` elements, checked at initialize).
2. Gather. A unit's all-gather takes its buffer as its source (waiting for the read if it still
   runs, or reading now if nothing read it ahead; on a GPU the buffer is copied to the device
   first).
3. Release. Once the all-gather is done the buffer takes the next read (on a GPU, once the copy
   to the device is).
Reads ahead must not outlive the values they read: an optimizer step, a checkpoint load and a
write through an accessor or load_state_dict drop them (`drop`, `forget`). A direct read sees
what was written through the mapping: the kernel writes dirty mapped pages back before it.

Host memory is then the buffers, the host shards, and the page cache the kernel gives the
mapping's writes (reclaimable; never charged to the process's data limit).
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from zero.offload.host import HostMemory
from zero.offload.nvme import SwapFile, _aligned, _settle, _wait_all
from zero.offload.policy import ParamNVMe
from zero.ops.aio import aligned_empty


@dataclasses.dataclass
class _Buffer:
    data: torch.Tensor  # aligned host bytes
    event: object = None  # on a GPU: recorded after the last copy out of it
    extra: bool = False  # made for one gather when every buffer fed another (see ParamSwap._spare)


@dataclasses.dataclass
class _Read:
    buffer: _Buffer
    view: torch.Tensor  # the shard's values, once `request` is done
    request: object


class ParamSwap:
    """The shards on disk of one model's units, and the buffers they are read into (see [Note:
    parameters on NVMe]).

    Args:
        policy: the ParamNVMe policy.
        memory: page-locks the buffers when `policy.pin_memory`.
    """

    def __init__(self, policy: ParamNVMe, memory: HostMemory):
        self.policy = policy
        self.memory = memory
        self.swap = SwapFile(policy.path, "params.bin", policy.threads, policy.queue_depth, policy.block_size)
        self._nbytes = 0
        self._buffers: list[_Buffer] = []
        self._free: list[_Buffer] = []
        self._ahead: collections.OrderedDict[int, _Read] = collections.OrderedDict()  # unit -> started, not taken
        self._taken: dict[int, _Read] = {}  # unit -> the source of its all-gather in flight
        self.bytes = {"read": 0, "written": 0}
        self.reads = {"ahead": 0, "on_demand": 0, "extra_buffers": 0}
        self.times = {"read_wait": 0.0}

    def new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A unit's shard: a mapped region of the swap file."""
        return self.swap.new((numel,), dtype)

    def holds(self, t: torch.Tensor) -> bool:
        """Is `t` (a view of) a shard on disk?"""
        return self.swap.holds(t)

    def write(self, buf: torch.Tensor, shard: torch.Tensor):
        """Start writing new values of (a piece of) a shard on disk from `buf` (a Request): the
        host step's updated parameters, with the aio op instead of through the mapping."""
        self.bytes["written"] += buf.numel() * buf.element_size()
        return self.swap.write(buf, shard)

    def size_buffers(self, nbytes: int) -> None:
        """Make the `buffer_count` buffers, each `nbytes` (the largest shard on disk)."""
        self._nbytes = _aligned(nbytes)
        self._buffers = [_Buffer(self._empty()) for _ in range(self.policy.buffer_count)]
        self._free = list(self._buffers)

    def _empty(self) -> torch.Tensor:
        buf = aligned_empty(self._nbytes)
        if self.policy.pin_memory:
            self.memory.register(buf)
        return buf

    def buffers(self) -> list[torch.Tensor]:
        return [b.data for b in self._buffers]

    @property
    def size(self) -> int:
        """Bytes reserved in the swap file."""
        return self.swap.size

    def close(self) -> None:
        """Wait for the reads in flight, stop the I/O threads and remove the swap file."""
        self.drop()
        self.swap.close()

    # -- reads

    def fetch(self, unit) -> bool:
        """Start reading `unit`'s shard ahead of its all-gather; False when no buffer is free."""
        if not unit.gathered or unit.index in self._ahead or unit.index in self._taken:
            return True  # (a unit of Muon's whole matrices only gathers from their owners' copies)
        if not self._free:
            return False
        self._ahead[unit.index] = self._read(unit, self._free.pop())
        self.reads["ahead"] += 1
        return True

    def take(self, unit) -> torch.Tensor:
        """`unit`'s shard in a host buffer, for its all-gather: held until `give_back`."""
        r = self._ahead.pop(unit.index, None)
        if r is None:
            r = self._read(unit, self._spare())
            self.reads["on_demand"] += 1
        try:
            self.times["read_wait"] += _wait_all([r.request])
        except OSError:  # the buffer is free again, and the unit not taken
            if not r.buffer.extra:
                self._free.append(r.buffer)
            raise
        self._taken[unit.index] = r
        return r.view

    def give_back(self, unit, copied: bool) -> None:
        """`unit`'s all-gather is done with its buffer; `copied`: it was copied to a GPU on the
        current stream, and the buffer's next read waits for that copy."""
        r = self._taken.pop(unit.index)
        if copied:
            r.buffer.event = torch.cuda.Event()
            r.buffer.event.record()
        if r.buffer.extra:
            if r.buffer.event is not None:
                r.buffer.event.synchronize()
        else:
            self._free.append(r.buffer)

    def drop(self) -> None:
        """Forget every read ahead (the shards' values changed, or the run ends)."""
        while self._ahead:
            _, r = self._ahead.popitem()
            _settle([r.request])
            self._free.append(r.buffer)

    def forget(self, unit) -> None:
        """Forget a read ahead of `unit`'s shard (its values changed)."""
        r = self._ahead.pop(unit.index, None)
        if r is not None:
            _settle([r.request])
            self._free.append(r.buffer)

    def _read(self, unit, buf: _Buffer) -> _Read:
        if buf.event is not None:  # its last copy to the device must have landed
            buf.event.synchronize()
            buf.event = None
        shard = unit.shard
        nbytes = shard.numel() * shard.element_size()
        view = buf.data[:nbytes].view(shard.dtype)
        self.bytes["read"] += nbytes
        return _Read(buf, view, self.swap.read(view, shard))

    def _spare(self) -> _Buffer:
        """A buffer for a read nothing started ahead: a free one, else the one of the read furthest
        ahead, else (every buffer feeds an all-gather in flight, as when a pass leaves its recorded
        order) one more for this gather alone, counted in `reads["extra_buffers"]`."""
        if self._free:
            return self._free.pop()
        if self._ahead:
            _, r = self._ahead.popitem()
            _settle([r.request])
            return r.buffer
        self.reads["extra_buffers"] += 1
        return _Buffer(self._empty(), extra=True)

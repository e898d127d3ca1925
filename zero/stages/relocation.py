"""Model states moved off the device and back: `engine.offload_states()` / `engine.reload_states()`.

[Note: states away]
An RLHF loop holds a training engine and generates with another model between its steps; while
it generates, the training engine's states only take device memory. `offload_states` copies
each device storage that holds a model state (the stage's parameter buffers or shards, fp32
masters, gradient buffers, Adam moments; a client optimizer's state) to host memory and resizes
the device storage to 0 bytes; `reload_states` gives each storage its size back and copies the
bytes in. The tensors that view those storages (parameters, shard views, the optimizer's slots)
are the same objects with the same offsets throughout, so nothing else needs to be told: after
the reload, training goes on bit for bit as without the round trip. Gathered stage-3 parameters
are released first (they are copies of the shards). States already in host memory (optimizer
and parameter offload) stay where they are. The host copies are allocated at the first offload
and kept for the next one (page-locked where CUDA can pin), so an offload per step costs copies,
not allocations.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from zero.offload import HostMemory

# DeepSpeed's OffloadStateTypeEnum values -> the memory-report kinds that hold them
STATE_KINDS = {
    "optim_states": ("optimizer_states", "client_optimizer_states"),
    "hp_params": ("fp32_master",),
    "lp_params": ("params", "persistent_full"),
    "lp_grads": ("grads",),
    "contiguous_grad_buffer": (),  # zero's reduce buffers live only while gradients are reduced
}


def kinds_of(include: Iterable | None) -> set[str]:
    """The memory-report kinds of DeepSpeed's `include` (OffloadStateTypeEnum members or their
    string values; None: every state)."""
    if include is None:
        return {k for kinds in STATE_KINDS.values() for k in kinds}
    out = set()
    for item in include:
        name = getattr(item, "value", item)
        if name not in STATE_KINDS:
            raise ValueError(f"offload_states(include=...): unknown state {item!r}; expected some of "
                             f"{sorted(STATE_KINDS)} (deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum)")
        out.update(STATE_KINDS[name])
    return out


class OffloadedStates:
    """The device storages of some model states, with their bytes in host memory (see
    [Note: states away]).

    Args:
        host_memory: the allocator of page-locked host tensors.
    """

    def __init__(self, host_memory: HostMemory):
        self.host_memory = host_memory
        self.away: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (device storage, host copy)
        self._copies: dict[int, torch.UntypedStorage] = {}  # kept across round trips, by device storage

    @property
    def active(self) -> bool:
        return bool(self.away)

    def offload(self, parts: dict[str, list[torch.Tensor]], kinds: set[str], pin: bool, non_blocking: bool) -> int:
        """Move the device storages of `parts[kind]` for `kinds` to host memory; returns the bytes
        moved. An alias (a storage two kinds share) moves once."""
        seen = {device._cdata for device, _ in self.away}
        moved = 0
        for kind in sorted(kinds):
            for t in parts.get(kind, []):
                storage = t.untyped_storage()
                key = storage._cdata
                if storage.nbytes() == 0 or key in seen:
                    continue
                seen.add(key)
                host = self._copies.get(key)
                if host is None or host.nbytes() != storage.nbytes():
                    host = self.host_memory.empty(storage.nbytes(), torch.uint8, pin).untyped_storage()
                    self._copies[key] = host
                host.copy_(storage, non_blocking=non_blocking)
                self.away.append((storage, host))
                moved += storage.nbytes()
        if non_blocking and moved and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the device bytes must be copied before they are freed
        for storage, _ in self.away:
            if storage.nbytes():
                storage.resize_(0)
        return moved

    def reload(self, non_blocking: bool) -> None:
        """Give every storage its bytes back from the host copies."""
        for storage, host in self.away:
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=non_blocking)
        self.away = []

    def host_bytes(self) -> int:
        return sum(host.nbytes() for _, host in self.away)

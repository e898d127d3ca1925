"""Model states moved off the device and back: `engine.offload_states()` / `engine.reload_states()`.

[Note: states away]
An RLHF loop holds a training engine and generates with another model between its steps; while
it generates, the training engine's states only take device memory. `offload_states` copies
each device storage that holds a model state of the kinds asked for (DeepSpeed's
OffloadStateTypeEnum: the stage's parameter buffers or shards, fp32 masters, gradient buffers,
every optimizer's state, 1-bit Adam's per-rank state) to host memory and resizes the device
storage to 0 bytes; `reload_states` gives each storage its size back and copies the bytes in. The tensors that
view those storages (parameters, shard views, the optimizer's slots) are the same objects with the
same offsets throughout, so nothing else needs to be told, except that data pointers change
(nothing may key on them). After the reload, training goes on bit for bit as without the round trip.

- Gathered stage-3 parameters are released first (they are copies of the shards).
- States already in host memory (optimizer and parameter offload) stay where they are.
- Kinds may go away in several calls (a kind already away is skipped), as in DeepSpeed. A hook on
  the module (whoever calls it) refuses a forward while the parameters are away, or, with autograd
  on, the gradient buffers; the engine refuses a backward without both, and a step or a save
  without everything.
- States are moved only between a step and the next backward: a gradient reduction may still be
  running between them.
- The host copies are allocated at the first offload and kept for the next one (page-locked where
  CUDA can pin), so an offload per step costs copies, not allocations.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

# DeepSpeed's OffloadStateTypeEnum values -> the memory-report kinds that hold them
STATE_KINDS = {
    "optim_states": ("optimizer_states", "rank_state"),
    "hp_params": ("fp32_master",),
    "lp_params": ("params", "persistent_full"),
    "lp_grads": ("grads",),
    "contiguous_grad_buffer": (),  # zero's reduce buffers live only while gradients are reduced
}
FORWARD_NEEDS = set(STATE_KINDS["lp_params"])
BACKWARD_NEEDS = FORWARD_NEEDS | set(STATE_KINDS["lp_grads"])


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


def model_states(optimizer) -> tuple[dict[str, list[torch.Tensor]], set[str]]:
    """(kind -> the tensors holding it, kinds already in host memory) of a zero optimizer: its
    storage's (every optimizer's state among them, see [Note: declared state] in
    zero/optim/rules.py) and its per-rank state (1-bit Adam's error feedback)."""
    parts, host_kinds = optimizer.storage.memory_parts()
    if optimizer.storage.store.on_host:
        host_kinds = host_kinds | optimizer.storage.store.host_kinds() | {"rank_state"}
    parts["rank_state"] = list(optimizer.rank_state().values())
    return parts, host_kinds


class StatesAway:
    """The model states of one engine that are in host memory now (see [Note: states away]).

    Args:
        optimizer: the engine's zero optimizer (its storage holds the states).
        modules: the modules whose forward needs the parameters (the model, or a pipeline's parts).
    """

    def __init__(self, optimizer, modules: list[nn.Module]):
        self.optimizer = optimizer
        self.modules = modules
        self.kinds: set[str] = set()
        self.away: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (device storage, host copy)
        self._copies: dict[int, torch.UntypedStorage] = {}  # kept across round trips, by device storage
        self._hooks: list = []

    def offload(self, include, pin: bool, non_blocking: bool) -> int:
        """Move the device storages of the states `include` names to host memory; returns the
        bytes moved. An alias (a storage two kinds share) moves once."""
        kinds = kinds_of(include) - self.kinds  # checked before anything moves
        self.optimizer.storage.release_gathered()
        parts, host_kinds = model_states(self.optimizer)
        kinds -= host_kinds
        seen = {device._cdata for device, _ in self.away}
        moving: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        for kind in sorted(kinds):
            for t in parts.get(kind, []):
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or storage._cdata in seen:
                    continue
                seen.add(storage._cdata)
                host = self._copies.get(storage._cdata)
                if host is None or host.nbytes() != storage.nbytes():
                    host = self.optimizer.storage.host_memory.empty(storage.nbytes(), torch.uint8, pin).untyped_storage()
                host.copy_(storage, non_blocking=non_blocking)
                moving.append((storage, host))
        if non_blocking and moving and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the device bytes must be copied before they are freed
        # nothing has changed until here: now the device memory is given up
        for storage, host in moving:
            self._copies[storage._cdata] = host
            storage.resize_(0)
        self.away += moving
        self.kinds |= kinds
        if self.kinds & (BACKWARD_NEEDS | self.optimizer.storage.forward_kinds) and not self._hooks:
            self._hooks = [m.register_forward_pre_hook(self._refuse_forward, prepend=True) for m in self.modules]
        return sum(host.nbytes() for _, host in moving)

    def reload(self, non_blocking: bool) -> None:
        """Give every storage its bytes back from the host copies."""
        for storage, host in self.away:
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=non_blocking)
        self.away, self.kinds = [], set()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def check(self, what: str, needs: set[str] | None = None) -> None:
        """Raise if the kinds `what` needs (None: all) are away."""
        missing = self.kinds if needs is None else self.kinds & needs
        if missing:
            raise RuntimeError(f"{what}: model states are offloaded to host memory ({', '.join(sorted(missing))}; "
                               f"engine.offload_states()); call engine.reload_states() first")

    def _refuse_forward(self, module, args) -> None:
        """A forward needs the parameters; with autograd on, a backward may follow, which needs
        the gradient buffers too."""
        extra = self.optimizer.storage.forward_kinds  # stage 3 gathers Muon's matrices from their masters
        self.check("forward", (BACKWARD_NEEDS if torch.is_grad_enabled() else FORWARD_NEEDS) | extra)

    def host_bytes(self) -> int:
        return sum(host.nbytes() for _, host in self.away)

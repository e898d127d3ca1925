"""The state store: where a storage's optimizer state is allocated, how the host step walks it in
tiles, and the views checkpoints and accessors read and write (see [Note: offload policies] in
zero/offload/policy.py)."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from zero.offload.host import HostMemory
from zero.offload.policy import OffloadPolicy, OnDevice
from zero.ops.adam_formats import decode_moment, encode_moment
from zero.state import StateSpec

STATE_KINDS = ("fp32_master", "optimizer_states")  # the memory-report kinds a store holds


class StateStore:
    """The optimizer state of one storage, where `policy` puts it.

    Args:
        policy: where the state lives (OnDevice, CPUOffload).
        device: where the model computes (the state's place without offload).
        owner: the object whose lifetime page-locked registrations follow.
        step_number: the number of the coming optimizer step (decoded views go stale with a step).
    """

    def __init__(self, policy: OffloadPolicy | None, device: torch.device, owner: object,
                 step_number: Callable[[], int]):
        self.policy = policy or OnDevice()
        self.device = device
        self.memory = HostMemory(owner)  # page-locked host tensors, also for the storage's other host buffers
        self.step_number = step_number
        self._decoded: dict = {}

    @property
    def on_host(self) -> bool:
        return self.policy.on_host

    def host_kinds(self) -> set[str]:
        """The memory-report kinds this store keeps off the device (in host memory or in files)."""
        return set(STATE_KINDS) if self.on_host else set()

    def disk_kinds(self) -> set[str]:
        """Of those, the kinds kept in files (NVMe offload)."""
        return set()

    def buffers(self) -> list[torch.Tensor]:
        """Host buffers of its own (NVMe offload's tile buffers)."""
        return []

    def close(self) -> None:
        """Release what outlives the process otherwise (NVMe offload's swap files); nothing here."""
        return None

    def in_files(self, t: torch.Tensor) -> bool:
        """Is `t` a view of state kept in a swap file (NVMe offload)?"""
        return False

    # -- allocation

    def new(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero tensor of state: in host memory under a host policy (page-locked if asked), else on
        the device."""
        if self.on_host:
            return self.memory.empty(shape, dtype, self.policy.pin_memory).zero_()
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def new_states(self, specs: tuple[StateSpec, ...], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero optimizer state for the master `like`, as `specs` declares it (see [Note: declared
        state] in zero/optim/rules.py): per-element and per-block tensors with the other state; a
        per-slot scalar in host memory, where torch optimizers keep their step counts."""
        return {spec.name: torch.zeros((), dtype=spec.dtype) if spec.per == "scalar" else
                self.new((spec.numel(like.numel()),), spec.dtype) for spec in specs}

    def new_master(self, shard: torch.Tensor, dtype: torch.dtype, alias: bool) -> torch.Tensor:
        """The master of `shard` (this rank's part of the parameters): the shard itself when it is
        its own master (`alias`), else a new tensor in `dtype` (values set by the caller)."""
        return shard if alias else self.new(shard.shape, dtype)

    # -- the host step's walk

    def tiles(self, numel: int) -> Iterator[tuple[int, int]]:
        """[lo, hi) of each tile of a slot of `numel` elements, in order (whole 8-bit blocks:
        `tile_elements` is a multiple of Q8_BLOCK)."""
        step = self.policy.tile_elements
        for lo in range(0, numel, step):
            yield lo, min(numel, lo + step)

    def walk(self, work: list[tuple]) -> Iterator[tuple]:
        """The host step's tiles: for each (slot, lo, hi) of `work`, in order, yield (slot, lo, hi,
        `make`), where `make(grad, out16)` is the tile as a Slot, its state ready to update. The
        tile is updated before the next one is asked for (in host memory the state is there
        already: views, and nothing to write back; NVMe offload reads ahead and writes behind)."""
        for slot, lo, hi in work:
            yield slot, lo, hi, functools.partial(slot.tile, lo, hi)

    # -- the views checkpoints and accessors read and write

    def begin_views(self) -> None:
        """A checkpoint or an accessor is about to collect views (`view`), or is done reading them:
        forget decoded copies (a reader keeps what it holds alive)."""
        self._decoded = {}

    def view(self, key, spec: StateSpec, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """What checkpoints read and write of one state: the tensor itself, flat (a scalar as one
        element), or, for 8-bit codes, a bf16 copy of their exact values (see [Note: 8-bit moments
        in checkpoints]). Writes into that copy are encoded back by `commit_views`."""
        t = state[spec.name]
        if spec.scales is None:
            return t.view(1) if spec.per == "scalar" else t
        if self.__dict__.get("_decoded_at") != self.step_number():  # a step since: the copies are stale
            self._decoded, self._decoded_at = {}, self.step_number()
        if (key, spec.name) not in self._decoded:
            scales = state[spec.scales]
            value = decode_moment(t, scales, spec.name).to(torch.bfloat16)
            self._decoded[(key, spec.name)] = (value, t, scales, spec.name)
        return self._decoded[(key, spec.name)][0]

    def commit_views(self) -> None:
        """[Note: 8-bit moments in checkpoints]
        8-bit moments are saved as bf16 tensors of their exact values: every code stands for a
        number with 4 significant bits and an fp32 exponent, which bf16 holds exactly. Loading
        re-encodes them per block; in the layout that saved them the blocks are the same, so the
        same codes and scales come back (a bitwise resume); in another layout (world size, stage)
        the values are re-quantized in the new blocks. An fp32 or bf16 checkpoint loads into 8-bit
        moments the same way, and 8-bit ones into fp32/bf16 moments as their values."""
        for value, codes, scales, name in self._decoded.values():
            new_codes, new_scales = encode_moment(value.float(), name)
            codes.copy_(new_codes)
            scales.copy_(new_scales)
        self._decoded = {}


def make_store(policy: OffloadPolicy | None, device: torch.device, owner: object,
               step_number: Callable[[], int]) -> StateStore:
    """The store for `policy` (see [Note: offload policies] in zero/offload/policy.py)."""
    if policy is not None and policy.on_disk:
        from zero.offload.nvme import FileStore

        return FileStore(policy, device, owner, step_number)
    return StateStore(policy, device, owner, step_number)

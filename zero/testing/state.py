"""An optimizer's shard state as plain host tensors, for tests that compare two runs' optimizer
states slot by slot (offloaded or not). Checkpoints (`engine.save_checkpoint`) are how a state
moves between runs."""
from __future__ import annotations

from typing import Any

import torch


def shard_state(optimizer) -> list[dict[str, Any]]:
    """This rank's optimizer state, slot by slot, as host tensors in their stored formats:
    {"group", "step", "master"} and the state the slot's rule declares, by name (Adam's
    "exp_avg" and "exp_avg_sq", with "exp_avg.scale" and "exp_avg_sq.scale" for 8-bit moments).
    The layout is the same whether the state lives on the device or (offloaded) on the host, so
    the state moves between the two."""
    copy = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
    return [{"group": s.group, "step": optimizer.step_count, "master": copy(s.master),
             **{k: copy(t) for k, t in s.state.items()}} for s in optimizer.slots()]


@torch.no_grad()
def load_shard_state(optimizer, state: list[dict[str, Any]]) -> None:
    """Load what `shard_state` returned (from this or an offloaded/non-offloaded twin) and
    refresh the model's 16-bit parameters from the loaded master; every slot is checked before
    any is loaded."""
    slots = optimizer.slots()
    if len(state) != len(slots):
        raise ValueError(f"shard state has {len(state)} slots, this optimizer has {len(slots)}")
    for i, (slot, saved) in enumerate(zip(slots, state)):
        tensors = ("master", *slot.state)
        absent = [k for k in ("group", "step", *tensors) if not isinstance(saved, dict) or k not in saved]
        if absent:
            raise ValueError(f"shard state slot {i} lacks {', '.join(map(repr, absent))}; load_shard_state takes "
                             f"what shard_state() returned: per slot a dict with 'group', 'step', "
                             f"{', '.join(map(repr, tensors))}")
        for key in tensors:
            value, want = saved[key], slot.master if key == "master" else slot.state[key]
            if not isinstance(value, torch.Tensor) or saved["group"] != slot.group or value.shape != want.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"shard state slot {i}: {key!r} of group {saved['group']} / shape {shape} "
                                 f"does not match group {slot.group} / shape {tuple(want.shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"shard state slot {i}: {key!r} holds non-finite values (inf or NaN); "
                                 f"refusing to load them into the optimizer")
    for slot, saved in zip(slots, state):
        slot.master.copy_(saved["master"])
        for key, t in slot.state.items():
            t.copy_(saved[key])
        if slot.out16 is not None:
            slot.out16.copy_(slot.master)
    optimizer.step_count = state[0]["step"] if state else 0
    optimizer.publish()

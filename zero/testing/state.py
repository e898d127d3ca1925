"""An optimizer's shard state as plain host tensors, for tests that compare two runs' optimizer
states slot by slot (offloaded or not). Checkpoints (`engine.save_checkpoint`) are how a state
moves between runs."""
from __future__ import annotations

from typing import Any

import torch


def shard_state(optimizer) -> list[dict[str, Any]]:
    """This rank's optimizer state, slot by slot, as host tensors in their stored formats:
    {"group", "master", "exp_avg", "exp_avg_sq", "scales"} plus the step count ("scales": the
    8-bit moments' block scales, else None). The layout is the same whether the state lives on
    the device or (offloaded) on the host, so the state moves between the two."""
    copy = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
    return [{"group": s[0], "step": optimizer.step_count, "master": copy(s[1]), "exp_avg": copy(s[3]),
             "exp_avg_sq": copy(s[4]), "scales": None if s.scales is None else tuple(copy(t) for t in s.scales)}
            for s in optimizer.slots()]


@torch.no_grad()
def load_shard_state(optimizer, state: list[dict[str, Any]]) -> None:
    """Load what `shard_state` returned (from this or an offloaded/non-offloaded twin) and
    refresh the model's 16-bit parameters from the loaded master; every slot is checked before
    any is loaded."""
    slots = optimizer.slots()
    if len(state) != len(slots):
        raise ValueError(f"shard state has {len(state)} slots, this optimizer has {len(slots)}")
    tensors = ("master", "exp_avg", "exp_avg_sq")
    for i, ((g, master, _, _, _, _), saved) in enumerate(zip(slots, state)):
        absent = [k for k in ("group", "step", *tensors) if not isinstance(saved, dict) or k not in saved]
        if absent:
            raise ValueError(f"shard state slot {i} lacks {', '.join(map(repr, absent))}; load_shard_state takes "
                             f"what shard_state() returned: per slot a dict with 'group', 'step', "
                             f"{', '.join(map(repr, tensors))}")
        for key in tensors:
            value = saved[key]
            if not isinstance(value, torch.Tensor) or saved["group"] != g or value.shape != master.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"shard state slot {i}: {key!r} of group {saved['group']} / shape {shape} "
                                 f"does not match group {g} / shape {tuple(master.shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"shard state slot {i}: {key!r} holds non-finite values (inf or NaN); "
                                 f"refusing to load them into the optimizer")
    for slot, saved in zip(slots, state):
        _, master, _, ea, eas, out16 = slot
        master.copy_(saved["master"])
        ea.copy_(saved["exp_avg"])
        eas.copy_(saved["exp_avg_sq"])
        for t, s in zip(slot.scales or (), saved.get("scales") or ()):
            t.copy_(s)
        if out16 is not None:
            out16.copy_(master)
    optimizer.step_count = state[0]["step"] if state else 0
    optimizer.publish()

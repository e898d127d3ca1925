"""Model-state bytes by kind, measured from the storages an engine holds (see Engine.memory_report).

Each storage counts once, under the first kind that holds it, at its current size: an fp32 master
that is the parameter buffer itself (fp32 training) is not counted twice, and a freed (resized to
0) stage-3 buffer counts 0 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODEL_STATE_KINDS = ("params", "grads", "fp32_master", "optimizer_states")


def measure_kinds(parts: dict[str, list[torch.Tensor]], host_kinds: set[str],
                  disk_kinds: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
    """Bytes per kind, plus `model_states_total`, `device_bytes`, `host_bytes` and `disk_bytes`.

    Args:
        parts: kind -> the tensors holding it (views are fine: their storages are measured).
        host_kinds: kinds placed off the device (offloaded); the others live on the device.
        disk_kinds: of those, the kinds kept in files (NVMe offload), not in host memory.
    """
    seen: set[int] = set()
    report: dict[str, int] = {}
    for kind, tensors in parts.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
        report[kind] = total
    for kind in MODEL_STATE_KINDS:
        report.setdefault(kind, 0)
    report["model_states_total"] = sum(report[k] for k in MODEL_STATE_KINDS)
    report["host_bytes"] = sum(v for k, v in report.items() if k in host_kinds and k not in disk_kinds)
    report["disk_bytes"] = sum(v for k, v in report.items() if k in disk_kinds)
    report["device_bytes"] = sum(v for k, v in report.items() if k in parts and k not in host_kinds)
    return report


class BufferGauge:
    """Bytes of some kind of buffer alive now, and the most alive at once. Owners add a buffer's
    storage size when they allocate it and subtract it when they free it."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes


@dataclass
class Gauges:
    """What an optimizer measures besides its model states.

    Args:
        reduce_buffers: gradient buffers being filled or reduced (stage 2 staging, stage 3 sends,
            stage 0/1 casts to the communication dtype).
        gather_buffers: stage 3 all-gather outputs before they are copied into units.
        gathered: stage 3 full parameter buffers of units (persistent units excluded).
        secondary: hpZ's secondary shards (a node's share of each gathered unit, kept from forward
            for backward).
        collective_temporaries: what ZeRO++'s quantized collectives and the two-hop gather hold
            while they run (int8 messages, reordered parts, partial sums; zero/zeropp).
    """

    reduce_buffers: BufferGauge = field(default_factory=BufferGauge)
    gather_buffers: BufferGauge = field(default_factory=BufferGauge)
    gathered: BufferGauge = field(default_factory=BufferGauge)
    secondary: BufferGauge = field(default_factory=BufferGauge)
    collective_temporaries: BufferGauge = field(default_factory=BufferGauge)

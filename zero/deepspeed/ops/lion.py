"""`deepspeed.ops.lion`: DeepSpeedCPULion and FusedLion, as client optimizers for zero.initialize.

Both are zero.optim.lion.Lion, which the engine runs on each rank's shards of the fp32 master (see
[Note: other optimizers on shards] in zero/optim/choice.py).
"""
from __future__ import annotations

from zero.deepspeed._missing import missing
from zero.optim.lion import Lion


class DeepSpeedCPULion:
    """`DeepSpeedCPULion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0)`."""

    def __new__(cls, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        return Lion(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion:
    """`FusedLion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0)`."""

    def __new__(cls, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)


def __getattr__(name: str):
    return missing(__name__, name)

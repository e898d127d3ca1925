"""Argument checks shared by CPUAdam and FusedAdam, run before any buffer is touched."""
from __future__ import annotations

import math


def check_adam_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the first bad hyperparameter.

    Args:
        lr: learning rate, finite and >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: term added to the denominator, finite and >= 0.
        weight_decay: finite and >= 0.
    """
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    for name, b in (("betas[0]", b1), ("betas[1]", b2)):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")

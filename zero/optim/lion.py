"""Element-wise optimizers zero provides beside torch's, for the config's `optimizer.type`.

They are ordinary torch optimizers; the engine runs them on each rank's shards (see [Note: other
optimizers on shards] in zero/optim/choice.py).
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the update is the
    sign of an interpolation of the momentum and the gradient; decoupled weight decay.

        c = beta1 * m + (1 - beta1) * g;  p -= lr * (sign(c) + weight_decay * p);  m = beta2 * m + (1 - beta2) * g

    Args:
        params: parameters or param groups.
        lr: learning rate (typically 3-10x smaller than AdamW's).
        betas: (beta1, beta2).
        weight_decay: decoupled weight decay.
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: expected lr >= 0, betas in [0, 1), weight_decay >= 0; got {lr}, {betas}, "
                             f"{weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss

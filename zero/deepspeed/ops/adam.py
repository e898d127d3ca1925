"""`deepspeed.ops.adam`: DeepSpeedCPUAdam and FusedAdam, as client optimizers for zero.initialize.

Both are torch.optim.AdamW/Adam objects carrying the hyperparameters: the engine's partitioned
optimizer steps with zero's own CPU Adam or fused CUDA Adam kernels (optimizer offload picks the CPU
one), so the name decides nothing but Adam versus AdamW. Every argument is honoured or refused.
"""
from __future__ import annotations

import torch

from zero.deepspeed._missing import missing


class _ZeroGradInPlace:
    """zero_grad() zeroes the gradients in place unless told otherwise: FusedAdam(set_grad_none=False)."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none)


class _AdamZeroingGrads(_ZeroGradInPlace, torch.optim.Adam):
    pass


class _AdamWZeroingGrads(_ZeroGradInPlace, torch.optim.AdamW):
    pass


def _adam(params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad, set_grad_none=True):
    if amsgrad:
        raise ValueError("amsgrad is not supported by zero's partitioned Adam")
    if not bias_correction:
        raise ValueError("bias_correction=False: set \"bias_correction\": false in the config's optimizer params "
                         "instead of on the client optimizer")
    if set_grad_none:
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    else:
        cls = _AdamWZeroingGrads if adamw_mode else _AdamZeroingGrads
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class DeepSpeedCPUAdam:
    """`DeepSpeedCPUAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)`: a client optimizer
    for zero.initialize.

    `fp32_optimizer_states=False` keeps the moments in the parameters' (training) dtype, as in
    DeepSpeed: under zero.initialize that is `optimizer.params.state_dtype` = the training dtype
    ("bf16" under bf16; fp32 training keeps fp32 moments; fp16 is refused there, zero has no fp16
    moments).
    """

    def __new__(cls, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        optimizer = _adam(model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad)
        if not fp32_optimizer_states:
            optimizer.zero_state_dtype = "model"  # read by zero.initialize (Engine)
        return optimizer


class FusedAdam:
    """`FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
    weight_decay=0, amsgrad=False, set_grad_none=True)`: a client optimizer for zero.initialize.

    `set_grad_none` is what the object's `zero_grad()` does: True sets the gradients to None, False
    zeroes them in place (an explicit `zero_grad(set_to_none=...)` wins). Under zero.initialize the
    engine owns the gradients and its own `zero_grad()` decides.
    """

    def __new__(cls, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                weight_decay=0.0, amsgrad=False, set_grad_none=True):
        return _adam(params, lr, bias_correction, betas, eps, weight_decay, adam_w_mode, amsgrad, set_grad_none)


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.ops.adam`: DeepSpeedCPUAdam and FusedAdam, as client optimizers for zero.initialize.

Both are torch.optim.AdamW/Adam objects carrying the hyperparameters: the engine's partitioned
optimizer steps with zero's own CPU Adam or fused CUDA Adam kernels (optimizer offload picks the CPU
one), so the name decides nothing but Adam versus AdamW.
"""
from __future__ import annotations

import torch

from zero.deepspeed._missing import missing


def _adam(params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad):
    if amsgrad:
        raise ValueError("amsgrad is not supported by zero's partitioned Adam")
    if not bias_correction:
        raise ValueError("bias_correction=False: set \"bias_correction\": false in the config's optimizer params "
                         "instead of on the client optimizer")
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class DeepSpeedCPUAdam:
    """`DeepSpeedCPUAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0, amsgrad=False, adamw_mode=True)`: a client optimizer for zero.initialize."""

    def __new__(cls, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad)


class FusedAdam:
    """`FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
    weight_decay=0, amsgrad=False)`: a client optimizer for zero.initialize."""

    def __new__(cls, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                weight_decay=0.0, amsgrad=False, set_grad_none=True):
        return _adam(params, lr, bias_correction, betas, eps, weight_decay, adam_w_mode, amsgrad)


def __getattr__(name: str):
    return missing(__name__, name)

"""The kernel tests' form of one Adam step: zero.ops.adam.adam_step with the step's numbers as
keywords (step=, lr=, betas=, ..., fmt=) beside the tensors' keywords (out16=, simd=, ...)."""
from __future__ import annotations

from collections.abc import Callable

from zero.ops.adam import AdamArgs, adam_step

STEP_ARGS = ("step", "lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction", "grad_scale", "fmt")


def keyword_step(checked: bool | None) -> Callable[..., None]:
    """`adam_step(param, grad, exp_avg, exp_avg_sq, AdamArgs(...), checked=checked, **rest)` taking
    the AdamArgs fields as keywords (checked: True, False, or None for the torch reference)."""

    def step(param, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
        rest = dict(kwargs)
        args = AdamArgs(**{k: rest.pop(k) for k in STEP_ARGS if k in rest})
        adam_step(param, grad, exp_avg, exp_avg_sq, args, checked=checked, **rest)

    return step

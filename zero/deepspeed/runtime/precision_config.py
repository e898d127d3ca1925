"""`deepspeed.runtime.precision_config`: the `fp16` and `bf16` sections of a DeepSpeed config as
DeepSpeed's pydantic models, with DeepSpeed's fields, defaults and checks.

These describe the JSON; zero's engine reads the same sections with its own models
(zero.config.FP16Config / BF16Config), which also say which of DeepSpeed's knobs zero refuses or
ignores (`fp16_master_weights_and_grads`, `bf16_optimizer_states`, ...). A config these models
accept is therefore not necessarily one zero trains with: build the engine to find out.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationInfo, field_validator, model_validator

from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.config_utils import DeepSpeedConfigModel

# the keys of DeepSpeed's dynamic loss scaler arguments (deepspeed.runtime.fp16.loss_scaler)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # the section's old name, still read
BFLOAT16_FORMAT = """
BFLOAT16 parameters should be of the format:
"bf16": {
  "enabled": true,
  "immediate_grad_update": false,
  "check_grad_overflow": true
}
"""

FP16 = "fp16"
FP16_FORMAT = """
FP16 parameters should be of the format:
"fp16": {
  "enabled": true,
  "auto_cast": false,
  "loss_scale": 0,
  "initial_scale_power": 16,
  "loss_scale_window": 1000,
  "hysteresis": 2,
  "consecutive_hysteresis": false,
  "min_loss_scale": 1
}
"""


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """The `bf16` section (old name `bfloat16`)."""

    enabled: bool = False
    """Train (or run) with bf16 parameters and gradients."""

    immediate_grad_update: bool = False
    """Apply each gradient to the master weights as soon as it is ready instead of at the step."""

    check_grad_overflow: bool = True
    """Look for inf/nan gradients before the optimizer step and skip the step when there are any."""

    bf16_master_weights_and_grads: bool = False
    """Keep the ZeRO optimizer's master weights and gradients in bf16 instead of fp32."""

    bf16_optimizer_states: bool = False
    """Keep the optimizer states in bf16 (only with bf16_master_weights_and_grads)."""


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """The `fp16` section: fp16 mixed precision with a static or dynamic loss scale."""

    enabled: bool = False
    """Train (or run) with fp16 parameters and gradients."""

    auto_cast: bool = False
    """Cast floating-point inputs of forward to fp16."""

    loss_scale: float = 0
    """The static loss scale; 0 (default) selects dynamic loss scaling."""

    initial_scale_power: int = 16
    """Dynamic loss scaling starts at 2**initial_scale_power."""

    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale is raised."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is lowered (the delayed shift)."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow."""

    min_loss_scale: int = 1
    """The dynamic loss scale's floor."""

    fp16_master_weights_and_grads: bool = False
    """Keep master weights in fp16 instead of fp32 (DeepSpeed: with DeepSpeedCPUAdam only)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _check_loss_scale(cls, v: Any) -> float:
        if isinstance(v, bool):
            raise ValueError("fp16.loss_scale must be a number, not a boolean")
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"fp16.loss_scale must be a number, got {v!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"fp16.loss_scale must be finite, got {v}")
        if v < 0:
            raise ValueError(f"fp16.loss_scale must be >= 0 (0 selects dynamic loss scaling), got {v}")
        return v

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _check_integer(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic would turn True into 1 and accept it; refuse booleans and non-finite floats first
        key = f"fp16.{info.field_name}"
        if isinstance(v, bool):
            raise ValueError(f"{key} must be an integer, not a boolean")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{key} must be finite, got {v}")
        try:
            int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer, got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _check_dynamic_scaling(self) -> DeepSpeedFP16Config:
        # the window and the floor matter only when the scale is dynamic; a static config may carry anything
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError("fp16.loss_scale_window must be > 0 with dynamic loss scaling (loss_scale 0), "
                                 f"got {self.loss_scale_window}")
            if self.min_loss_scale <= 0:
                raise ValueError("fp16.min_loss_scale must be > 0 with dynamic loss scaling (loss_scale 0), "
                                 f"got {self.min_loss_scale}")
        return self

    def initial_dynamic_scale(self) -> int:
        """2**initial_scale_power, the first dynamic loss scale."""
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's arguments, under DeepSpeed's keys (`init_scale`, `scale_window`,
        `delayed_shift`, `consecutive_hysteresis`, `min_scale`)."""
        return {
            INITIAL_LOSS_SCALE: self.initial_dynamic_scale(),
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """The `bf16` section of a config dict (or its old name `bfloat16`), defaults where absent."""
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    """The `fp16` section of a config dict, defaults where absent."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))


def __getattr__(name: str):
    return missing(__name__, name)

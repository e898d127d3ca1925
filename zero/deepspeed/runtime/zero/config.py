"""`deepspeed.runtime.zero.config`: the `zero_optimization` section as DeepSpeed's
`DeepSpeedZeroConfig`, which is zero's own section model (see [Note: DeepSpeed's section classes
are zero's] in zero/deepspeed/runtime/zero/offload_config.py)."""
from __future__ import annotations

import enum
import types
from typing import Any, ClassVar, Optional

from pydantic import Field, model_validator

from zero.config.errors import _fmt, _raise, _warn
from zero.config.sections import ZeroOptimizationConfig
from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.zero.offload_config import (  # noqa: F401 - DeepSpeed's module has them too
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    ZeroSection,
    as_section,
)

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(enum.IntEnum):
    """The values of `zero_optimization.stage`."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


_FIELDS = ZeroOptimizationConfig.model_fields


class DeepSpeedZeroConfig(ZeroSection, ZeroOptimizationConfig):
    """`zero_optimization`: zero's section (every DeepSpeed key, its alias `stage3_*`, its default,
    and its deprecated spellings `cpu_offload`, `cpu_offload_param`,
    `stage3_gather_fp16_weights_on_model_save`), with the offload sections as DeepSpeed's classes.

    `DeepSpeedZeroConfig(**d)` validates as `load_config` does (see [Note: DeepSpeed's section
    classes are zero's]); `DeepSpeedZeroConfig.of(cfg.zero_optimization)` views a loaded config's
    section. The stage is an int, as DeepSpeed stores it; compare it with `ZeroStageEnum`.
    """

    zero_path: ClassVar[str] = ZERO_OPTIMIZATION

    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = Field(
        None, description=_FIELDS["offload_param"].description)
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = Field(
        None, description=_FIELDS["offload_optimizer"].description)

    @model_validator(mode="after")
    def _deepspeed_sections(self) -> DeepSpeedZeroConfig:
        """The offload sections zero's validator made from `cpu_offload`/`cpu_offload_param`, as
        DeepSpeed's classes (runs after zero's validators)."""
        d = self.__dict__
        d["offload_param"] = as_section(DeepSpeedZeroOffloadParamConfig, self.offload_param)
        d["offload_optimizer"] = as_section(DeepSpeedZeroOffloadOptimizerConfig, self.offload_optimizer)
        return self

    @classmethod
    def of(cls, section: Optional[ZeroOptimizationConfig]) -> Optional[DeepSpeedZeroConfig]:
        """A loaded config's `zero_optimization` as this class, offload sections included, without
        validating it again."""
        view = as_section(cls, section)
        if view is not None and view is not section:
            view._deepspeed_sections()
        return view

    # DeepSpeed settings zero has no key for: the value DeepSpeed uses by default, which is what
    # zero does (a config that sets one of these keys is refused as unknown).
    @property
    def compute_grad_norm(self) -> bool:
        """Stages 1/2 compute the global gradient norm at every step (zero always does)."""
        return True

    @property
    def parameter_alignment(self) -> bool:
        """DeepSpeed's 16-byte padding between parameters in flat buffers (zero does not pad so)."""
        return False

    @property
    def save_muon_momentum_buffer_in_memory(self) -> bool:
        """DeepSpeed's Muon + NVMe setting (zero has neither)."""
        return False

    @property
    def leaf_module(self) -> types.SimpleNamespace:
        """DeepSpeed's config-driven stage-3 leaf modules: none; zero marks leaves with
        `zero.set_z3_leaf_modules` (`deepspeed.utils.set_z3_leaf_modules`)."""
        return types.SimpleNamespace(classes=[], names=[], name_suffixes=[])


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """The `zero_optimization` section of a DeepSpeed config dict, validated as zero does (the old
    boolean form `"zero_optimization": true` means stage 1, with a warning)."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        _warn("'zero_optimization': true/false is deprecated; use {'stage': N}")
        section = {"stage": 1 if section else 0}
    if not isinstance(section, dict):
        _raise([((ZERO_OPTIMIZATION,), f"expected a dictionary (or true/false), got {_fmt(section)}")])
    return DeepSpeedZeroConfig(**section)


def __getattr__(name: str):
    return missing(__name__, name)

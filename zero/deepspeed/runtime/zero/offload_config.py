"""`deepspeed.runtime.zero.offload_config`: DeepSpeed's offload sections, built on zero's.

[Note: DeepSpeed's section classes are zero's]
DeepSpeed code builds config sections itself (`DeepSpeedZeroConfig(**d)`) and reads them
(`engine.zero_offload_optimizer().pipeline`). Here each of those classes is a subclass of zero's
own section model (zero/config/sections.py), so building one validates exactly as `load_config`
does: a misspelt key, a bad value or a refused DeepSpeed feature is a `ConfigError` naming its full
path (`zero_optimization.offload_optimizer.device`), a key zero ignores warns, and every DeepSpeed
field exists with its value. What DeepSpeed derives from the fields (`pipeline`) or keeps as a
setting zero does not have is a read-only property. `of(section)` turns a section of an already
loaded `ZeroConfig` into the DeepSpeed class without validating it again (no second warning).
"""
from __future__ import annotations

import enum
from typing import Any, ClassVar, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from zero.config.errors import _issues_from, _raise, _submodel
from zero.config.features import _check_unimplemented
from zero.config.sections import OffloadOptimizerConfig, OffloadParamConfig
from zero.deepspeed._missing import missing


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded state lives: zero implements "none" and "cpu" ("nvme" is refused by the config)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The engine states `engine.offload_states(include=...)` moves (DeepSpeed's names)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


S = TypeVar("S", bound=BaseModel)


def as_section(cls: type[S], section: Optional[BaseModel]) -> Optional[S]:
    """`section` (a validated zero section, or None) as an instance of its DeepSpeed subclass `cls`,
    with the same values and set keys, without validating it again."""
    if section is None or isinstance(section, cls):
        return section
    return cls.model_construct(_fields_set=set(section.model_fields_set), **dict(section))


class ZeroSection:
    """Base of the DeepSpeed section classes (see [Note: DeepSpeed's section classes are zero's]):
    building one directly validates with zero's rules and reports at the section's full path.

    Args (of the constructor):
        strict: DeepSpeed's switch to keep "auto" values; ignored: zero always reads "auto" on a
            known key as not given (see [Note: "auto" values] in zero/config/loading.py).
        **data: the section's keys, in DeepSpeed's spelling.
    """

    zero_path: ClassVar[str]  # the section's dotted path in the whole config

    def __init__(self, strict: bool = False, **data: Any) -> None:
        issues = None
        try:
            super().__init__(**data)
        except ValidationError as err:
            issues = _issues_from(err, type(self), tuple(self.zero_path.split(".")))
        if issues:
            _raise(issues)
        _check_features_of(self, self.zero_path)

    @classmethod
    def of(cls, section: Optional[BaseModel]):
        """The zero section `section` (of a loaded config) as this DeepSpeed class; None stays None."""
        return as_section(cls, section)


def _check_features_of(section: BaseModel, path: str) -> None:
    """Refuse or warn about the DeepSpeed keys zero does not implement that `section` (at `path`)
    sets, as `load_config` does for a whole config: the section is placed in a config whose other
    keys keep their defaults, which set nothing."""
    from zero.config.model import ZeroConfig

    keys = path.split(".")
    parents: list[type] = [ZeroConfig]
    for key in keys[:-1]:
        parents.append(_submodel(parents[-1].model_fields[key].annotation))
    node: BaseModel = section
    for parent, key in zip(reversed(parents), reversed(keys)):
        node = parent.model_construct(**{key: node})
    _check_unimplemented(node)


class DeepSpeedZeroOffloadParamConfig(ZeroSection, OffloadParamConfig):
    """`zero_optimization.offload_param` (stage-3 parameter shards on the CPU): zero's section,
    with DeepSpeed's fields `device`, `nvme_path`, `buffer_count`, `buffer_size`, `max_in_cpu`,
    `pin_memory` (zero's default is false, DeepSpeed's was until 0.18)."""

    zero_path: ClassVar[str] = "zero_optimization.offload_param"


class DeepSpeedZeroOffloadOptimizerConfig(ZeroSection, OffloadOptimizerConfig):
    """`zero_optimization.offload_optimizer` (fp32 master weights, Adam state and step on the CPU):
    zero's section, with DeepSpeed's fields `device`, `nvme_path`, `buffer_count`, `pin_memory`
    (zero's default is false, DeepSpeed's was until 0.18), `pipeline_read`, `pipeline_write`,
    `fast_init`, `ratio`, `super_offload`, and the derived `pipeline`."""

    zero_path: ClassVar[str] = "zero_optimization.offload_optimizer"

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived flag: NVMe reads or writes overlap the optimizer step's tiles."""
        return self.pipeline_read or self.pipeline_write

    @property
    def cpuadam_cores_perc(self) -> float:
        """DeepSpeed's share of CPU cores for SuperOffload's CPU Adam (its default; zero refuses
        super_offload, and its CPU Adam uses torch's thread count)."""
        return 0.8


def __getattr__(name: str):
    return missing(__name__, name)

"""What to say about a DeepSpeed name zero does not have.

[Note: absent names]
A DeepSpeed script often imports more than it uses (`from deepspeed.moe.layer import MoE` at
the top of a file that trains without experts). So a DeepSpeed name that zero knows and lacks
imports fine and fails when used: it resolves to a stand-in class whose call, attribute access or
instantiation of a subclass raises `NotAvailableError` with the reason and what to use instead.
`isinstance(x, StandIn)` is simply False. A missing DeepSpeed package (`deepspeed.moe.layer`,
`deepspeed.inference`, ...) is a module made on import by `_AbsentPackages`, whose every name is such
a stand-in. A name zero does not know at all (a typo, or a part of DeepSpeed nobody asked for) is an
AttributeError at once, as for any module.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import types

# DeepSpeed packages with no counterpart here (everything under them), and what to use instead
ABSENT_PACKAGES = {
    "deepspeed.moe": "expert parallelism is not implemented; MoE layers train as ordinary modules "
                     "(zero.set_z3_leaf_modules keeps an MoE block one unit under stage 3)",
    "deepspeed.profiling": "use torch.profiler; engine.wall_clock_report() and engine.comm_report() give zero's "
                           "breakdown",
    "deepspeed.launcher": "launch with torchrun",
    "deepspeed.compression": "compression training is not implemented",
    "deepspeed.inference": "inference engines are not implemented",
    "deepspeed.sequence": "sequence parallelism is not implemented",
    "deepspeed.ops.transformer": "DeepSpeed's fused transformer layers are not implemented; use torch's layers "
                                 "(F.scaled_dot_product_attention)",
    "deepspeed.ops.lamb": "LAMB is refused: its trust ratio needs whole parameters, which ZeRO partitions",
    "deepspeed.runtime.zero.tiling": "TiledLinear is not implemented; stage 3 gathers one module at a time "
                                     "(split a huge Linear into several modules)",
    "deepspeed.utils.groups": "zero's process groups are its mesh's: zero.tp.mesh(config).group('pp' | 'dp' | 'tp') "
                              "(see docs/parallelism.md); DeepSpeed's group helpers are not provided",
    "deepspeed.utils.timer": "use engine.wall_clock_report() for zero's timings, or torch.profiler",
    "deepspeed.runtime.sequence_parallel": "sequence parallelism is not implemented",
    "deepspeed.runtime.zero.mics": "MiCS (hierarchical partitioning) is not implemented; use stage 3",
    "deepspeed.runtime.config": "zero's config is read by zero.config (ZeroConfig, a pydantic model of the same JSON)",
    "deepspeed.runtime.fp16": "mixed precision is the engine's (the config's fp16 and bf16 sections; "
                              "engine.loss_scale)",
    "deepspeed.runtime.bf16_optimizer": "mixed precision is the engine's (the config's bf16 section)",
}

# single DeepSpeed names with no counterpart here
ABSENT_NAMES = {
    "deepspeed.init_inference": "inference engines are not implemented; use the model directly (under stage 3, "
                                "with zero.integrations.hf.from_pretrained and model.generate)",
    # deepspeed.zero is deepspeed.runtime.zero (zero/deepspeed/zero.py): its names are listed once
    **{f"deepspeed.runtime.zero.{where}ZeroParamType": "zero's stage-3 parameters tell their state by ds_status; "
                                                       "there are no remote parameters"
       for where in ("", "partition_parameters.")},
    "deepspeed.runtime.zero.TiledLinear": "TiledLinear is not implemented; stage 3 gathers one module at a time "
                                          "(split a huge Linear into several modules)",
    "deepspeed.runtime.zero.TiledLinearReturnBias": "TiledLinear is not implemented",
    "deepspeed.runtime.zero.DeepSpeedZeRoOffload": "stage 3's parameter gathering and offload belong to the engine "
                                                   "zero.initialize builds (there is no separate object); to gather "
                                                   "the whole model for generation use "
                                                   "deepspeed.zero.unwrap_model_for_generation",
    "deepspeed.runtime.zero.DeepSpeedTensorOverride": "zero.Init does not wrap torch's tensor constructors: "
                                                      "parameters are made with the dtype and device they ask for, "
                                                      "and zero.Init(dtype=...) casts the shards",
    "deepspeed.runtime.fp16.onebit.adam.OnebitAdam": "1-bit Adam runs inside the engine: set \"optimizer\": "
                                                    "{\"type\": \"OneBitAdam\"} in the config (docs/onebit.md)",
    "deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam": "0/1 Adam runs inside the engine: set \"optimizer\": "
                                                      "{\"type\": \"ZeroOneAdam\"} in the config (docs/onebit.md)",
    "deepspeed.checkpointing.model_parallel_cuda_manual_seed": "zero's tensor slices keep no separate model-parallel "
                                                               "generator (docs/parallelism.md, Dropout); seed every "
                                                               "rank alike with torch.manual_seed",
}


class NotAvailableError(NotImplementedError):
    """A DeepSpeed name zero lacks was used (see [Note: absent names])."""


class _AbsentAttribute(NotAvailableError, AttributeError):
    """An attribute of a stand-in was read: also an AttributeError, so hasattr(), inspect and
    mock.create_autospec see a missing attribute."""


class _StandIn(type):
    """The metaclass of stand-ins: calling one or reading its attributes raises."""

    def __call__(cls, *args, **kwargs):
        raise NotAvailableError(cls._message)

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise _AbsentAttribute(cls._message)

    def __repr__(cls) -> str:
        return f"<{cls._full}: not available in zero>"


class _AbsentModule(types.ModuleType):
    """A module of an absent package; calling it (a lowercase name that was a function) raises."""

    def __call__(self, *args, **kwargs):
        raise NotAvailableError(f"{self.__name__.removeprefix('zero.')} is not available in zero: "
                                f"{_reason(self.__name__.removeprefix('zero.'))}")


def _reason(full: str) -> str | None:
    """Why `full` is absent: its own entry, or that of the absent package that holds it."""
    if full in ABSENT_NAMES:
        return ABSENT_NAMES[full]
    return next((r for p, r in ABSENT_PACKAGES.items() if full == p or full.startswith(p + ".")), None)


def _is_submodule(name: str) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return False
    return spec is not None and spec.origin is not None  # a real file (not one of _AbsentPackages')


@functools.cache
def stand_in(full: str, reason: str) -> type:
    """A class standing for the DeepSpeed name `full` (see [Note: absent names])."""
    message = f"{full} is not available in zero: {reason}"
    return _StandIn(full.rsplit(".", 1)[-1], (), {"_full": full, "_message": message, "__module__": "zero.deepspeed"})


def missing(module: str, name: str):
    """Module `__getattr__` of the compatibility layer: `module.name` that does not exist here.

    `module` is the DeepSpeed name of the module or its zero name (`zero.deepspeed.utils`).
    Returns a stand-in (or the absent package) for a name DeepSpeed has and zero lacks; raises
    AttributeError for any other name.
    """
    if name.startswith("__"):
        raise AttributeError(name)
    full = f"{module.removeprefix('zero.')}.{name}"
    if full in ABSENT_PACKAGES or _is_submodule(f"zero.{full}"):  # `deepspeed.runtime.zero.stage3` without an import
        return importlib.import_module(f"zero.{full}")
    if name.islower() and full not in ABSENT_NAMES and _reason(module.removeprefix("zero.")) is not None:
        return importlib.import_module(f"zero.{full}")  # in an absent package: `deepspeed.moe.layer` is a module
    reason = _reason(full)
    if reason is None:
        raise AttributeError(f"{full} is not part of zero's DeepSpeed compatibility layer (see "
                             f"docs/migrating-from-deepspeed.md for what is)")
    return stand_in(full, reason)


class _AbsentPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `zero.deepspeed.<missing package>` importable: a module of stand-ins."""

    def find_spec(self, fullname, path, target=None):
        full = fullname.removeprefix("zero.")
        if fullname.startswith("zero.deepspeed.") and full not in ABSENT_NAMES and _reason(full) is not None:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _AbsentModule(spec.name)

    def exec_module(self, module) -> None:
        full = module.__name__.removeprefix("zero.")
        module.__doc__ = f"{full}: not available in zero ({_reason(full)})"
        module.__getattr__ = lambda name: missing(full, name)


if not any(isinstance(f, _AbsentPackages) for f in sys.meta_path):  # once, behind the real modules
    sys.meta_path.append(_AbsentPackages())

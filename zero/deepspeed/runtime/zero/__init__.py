"""`deepspeed.runtime.zero`, which is also `deepspeed.zero` (one module, as in DeepSpeed: see
zero/deepspeed/zero.py)."""
from __future__ import annotations

import contextlib

from zero.deepspeed._missing import missing
from zero.init import (  # noqa: F401
    GatheredParameters,
    Init,
    register_external_parameter,
    set_z3_leaf_modules,  # not in DeepSpeed's module (deepspeed.utils has it); kept for zero's older path
    unregister_external_parameter,
)
from zero.partition.shards import ZeroParamStatus  # noqa: F401


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """The model with every parameter gathered for the block (as DeepSpeed's, for generation loops
    that would otherwise gather each layer at every token)."""
    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters())):
        yield module


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.zero`."""
from __future__ import annotations

import contextlib

from zero.deepspeed._missing import missing
from zero.init import (  # noqa: F401 - `deepspeed.zero` is this module in DeepSpeed
    GatheredParameters,
    Init,
    register_external_parameter,
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

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
    """The model with every parameter gathered for the block, and under stage 3 without the
    hooks that would gather and release each module around every forward (put back after), as
    DeepSpeed's: for generation loops that run many forwards."""
    module = getattr(model, "module", model)
    runtime = getattr(getattr(model, "optimizer", None), "parameter_offload", None)
    with GatheredParameters(list(module.parameters())):
        if runtime is not None:
            for handle in runtime.forward_hooks:
                handle.remove()
            runtime.forward_hooks = []
        try:
            yield module
        finally:
            if runtime is not None:
                runtime._register_hooks_recursively(runtime.module)


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.zero`: Init, GatheredParameters, external parameters."""
from zero.deepspeed._missing import missing
from zero.init import (  # noqa: F401
    GatheredParameters,
    Init,
    register_external_parameter,
    set_z3_leaf_modules,
    unregister_external_parameter,
)


def __getattr__(name: str):
    return missing("deepspeed.zero", name)

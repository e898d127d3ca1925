"""`deepspeed.runtime.zero.partition_parameters`."""
from zero.deepspeed._missing import missing
from zero.init import GatheredParameters, Init, register_external_parameter, unregister_external_parameter  # noqa: F401
from zero.partition.shards import ZeroParamStatus  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.zero.partition_parameters`."""
from zero.init import GatheredParameters, Init  # noqa: F401
from zero.partition.shards import ZeroParamStatus  # noqa: F401

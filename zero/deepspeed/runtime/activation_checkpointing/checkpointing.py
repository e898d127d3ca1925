"""`deepspeed.runtime.activation_checkpointing.checkpointing`: the same module as `deepspeed.checkpointing`."""
import sys

from zero.deepspeed import checkpointing

sys.modules[__name__] = checkpointing  # one module under both names

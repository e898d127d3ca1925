"""`deepspeed.ops`: the optimizers scripts import by name."""
from zero.deepspeed.ops import adam  # noqa: F401

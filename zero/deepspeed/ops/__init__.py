"""`deepspeed.ops`: the optimizers scripts import by name."""
from zero.deepspeed.ops import adam, op_builder  # noqa: F401

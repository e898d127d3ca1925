"""Native ops: CPU Adam and fused GPU Adam.

Nothing is compiled when this package is imported; each op is built the first time it is used.
`python -m zero.ops build` builds every op this machine can build; `python -m zero.env` reports.
"""
from zero.ops.builder import OPS, OpUnavailable, is_built, load, missing
from zero.ops.cpu_adam import CPUAdam, cpu_adam_step
from zero.ops.fused_adam import FusedAdam

__all__ = ["CPUAdam", "cpu_adam_step", "FusedAdam", "OPS", "OpUnavailable", "is_built", "load", "missing"]

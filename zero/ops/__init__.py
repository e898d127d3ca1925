"""Native ops: CPU Adam, fused GPU Adam, 1-bit pack/unpack, block-sparse attention (CPU and GPU).

Nothing is compiled when this package is imported; each op is built the first time it is used
(builder.py). adam.py is the one Adam step (`adam_step`, `AdamArgs`, `torch_adam_step`) for every
device and state format. `python -m zero.ops build` builds every op this machine can build;
`python -m zero.env` reports. simd.py reads the CPU ops' `simd=` and `num_threads=`; fallback.py
is the one rule for an op that cannot be built ([Note: native-op fallback]).
"""
from zero.ops.adam import AdamArgs, adam_step, torch_adam_step
from zero.ops.builder import OPS, OpUnavailable, is_built, load, missing
from zero.ops.cpu_adam import CPUAdam
from zero.ops.fused_adam import FusedAdam

__all__ = ["AdamArgs", "adam_step", "torch_adam_step", "CPUAdam", "FusedAdam", "OPS", "OpUnavailable", "is_built", "load", "missing"]

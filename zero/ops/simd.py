"""The `simd=` and `num_threads=` arguments of the CPU ops (cpu_adam, onebit, sparse_attention).

Every CPU kernel picks AVX-512, AVX2 or portable C at run time with the one detection in
csrc/common/simd.c (see [Note: SIMD levels] in csrc/common/simd.h); each CPU op exports that
detection as `simd_levels()`. `simd_code(simd, op)` checks a `simd=` argument against the op that
is about to run it, so forcing a level for the 1-bit or sparse-attention op builds that op only,
never the Adam op.
"""
from __future__ import annotations

import torch

from zero.ops.builder import load

SIMD_NAMES = ("scalar", "avx2", "avx512")  # in the kernels' numbering: ZERO_SIMD_SCALAR = 0, ...
BEST = -1  # ZERO_SIMD_BEST: the best level this CPU runs
SIMD_CODES: dict[str | None, int] = {None: BEST, **{name: code for code, name in enumerate(SIMD_NAMES)}}
CPU_OPS = ("cpu_adam", "onebit", "sparse_attention")  # the ops whose kernels take a SIMD level


def simd_levels(op: str = "cpu_adam") -> list[str]:
    """SIMD levels this CPU runs, best first (e.g. ["avx512", "avx2", "scalar"]), as op `op` sees them.

    Every CPU op links the same detection, so they all give the same answer; asking the op that is
    about to run builds nothing else.

    Args:
        op: one of CPU_OPS; it is built (once) if it is not yet.

    Raises:
        OpUnavailable: the op cannot be built here.
    """
    if op not in CPU_OPS:
        raise ValueError(f"simd_levels: op must be one of {list(CPU_OPS)}, got {op!r}")
    return list(load(op).simd_levels())


def simd_code(simd: str | None, op: str, what: str = "simd") -> int:
    """The kernels' code for a `simd=` argument: None (best available) or a level op `op` runs here.

    Args:
        simd: None, "scalar", "avx2" or "avx512".
        op: the CPU op that will run with it (see `simd_levels`).
        what: the argument's name in error messages.

    Raises:
        ValueError: `simd` is not a level name, or not one this CPU runs (the message lists those).
        OpUnavailable: a level was forced and `op` cannot be built here.
    """
    if simd is None:
        return BEST
    if simd not in SIMD_NAMES:
        raise ValueError(f"{what} must be None (best available) or one of {list(SIMD_NAMES)}, got {simd!r}")
    available = simd_levels(op)
    if simd not in available:
        raise ValueError(f"{what}={simd!r} is not available on this CPU; available: {available}")
    return SIMD_CODES[simd]


def num_threads(threads: int | None, what: str = "num_threads") -> int:
    """The kernels' thread count for a `num_threads=` argument: None = torch.get_num_threads(); an
    int as given (<= 0 = OpenMP's default for the ops that document it).

    Raises:
        ValueError: `threads` is neither None nor an int.
    """
    if threads is None:
        return torch.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise ValueError(f"{what} must be an int or None, got {threads!r}")
    return threads

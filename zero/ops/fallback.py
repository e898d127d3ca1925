"""The one rule every caller of a native op follows when the op cannot be built.

[Note: native-op fallback]
A call site hands `run_native` the op's name, the native call, and the torch reference that
computes the same thing where one exists:

    bits, scales = run_native("onebit", lambda: <native pack>, lambda: pack_reference(...),
                              what="1-bit pack")

The native call is tried. If it raises OpUnavailable (no compiler, a compile error, no nvcc, an
unwritable cache: the op cannot be built or loaded here), then

* with a reference, the reference runs, and a warning names the op and why, once per op and
  process;
* without one, an OpUnavailable names the op, who needed it, why it is unavailable and where to
  look.

The builder remembers a failed build (zero/ops/builder.py), so an op is tried once per process: a
call site that falls back at every step pays a dict lookup, not a compile. Nothing here predicts
buildability with `builder.missing()`: a machine with a compiler can still fail to compile, and the
only reliable answer is the build itself.

The native call must raise OpUnavailable before it writes anything, so that the reference starts
from the caller's inputs as they were: every entry point of zero.ops checks its arguments and loads
its op before it touches a buffer.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

from zero.ops.builder import OpUnavailable

T = TypeVar("T")

_warned: set[str] = set()  # ops whose fallback was announced in this process


def run_native(op: str, native: Callable[[], T], reference: Callable[[], T] | None = None, *, what: str) -> T:
    """Run `native`; if op `op` cannot be built here, run `reference` (warning once) or raise.

    See [Note: native-op fallback].

    Args:
        op: the native op `native` uses (a name of zero.ops.builder.OPS).
        native: the call through the op; it must raise OpUnavailable before writing anything.
        reference: the torch computation of the same result, or None where there is none.
        what: who needs the op, for people ("1-bit pack", "block-sparse attention forward").

    Returns:
        What `native` (or, in its place, `reference`) returned.

    Raises:
        OpUnavailable: the op cannot be built here and there is no reference; the message says why.
    """
    try:
        return native()
    except OpUnavailable as exc:
        if reference is None:
            raise OpUnavailable(
                f"{what} needs the native op '{op}', which has no torch fallback and cannot be used here: {exc}\n"
                f"(`python -m zero.env` lists what this machine has and lacks; `python -m zero.ops build {op}` "
                f"retries the build with its full output)"
            ) from exc
        if op not in _warned:
            _warned.add(op)
            warnings.warn(f"zero: native op '{op}' is unavailable, so {what} uses its slower torch reference "
                          f"(same results to fp32 round-off): {exc}", stacklevel=3)
        return reference()

"""`deepspeed.ops.op_builder`: builders that answer for zero's own native ops (zero/ops/builder.py)."""
from __future__ import annotations

from zero.deepspeed._missing import missing
from zero.ops import builder


class _Builder:
    """`is_compatible()`: can the op be built or loaded here; `load()`: build (once) and load it."""

    NAME = ""  # DeepSpeed's op name
    OP = ""  # zero's op name

    def __init__(self):
        self.name = self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = builder.missing(self.OP)
        if reason is not None and verbose:
            print(f"{self.NAME}: {reason}")
        return reason is None

    def load(self, verbose: bool = True):
        return builder.load(self.OP)

    def absolute_name(self) -> str:
        return f"zero.ops.{self.OP}"


class CPUAdamBuilder(_Builder):
    NAME, OP = "cpu_adam", "cpu_adam"


class FusedAdamBuilder(_Builder):
    NAME, OP = "fused_adam", "fused_adam"


def __getattr__(name: str):
    return missing("deepspeed.ops.op_builder", name)

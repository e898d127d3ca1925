"""`deepspeed.ops.op_builder`: builders that answer for zero's own native ops (zero/ops/builder.py)."""
from __future__ import annotations

import re

from zero.deepspeed._missing import NotAvailableError, missing
from zero.ops import builder


class _Builder:
    """`is_compatible()`: can the op be built or loaded here; `load()`: build (once) and load it."""

    NAME = ""  # DeepSpeed's op name
    OP = ""  # zero's op name

    def __init__(self):
        self.name = self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = builder.missing(self.OP) if self.OP else f"zero has no {self.NAME} op"
        if reason is not None and verbose:
            print(f"{self.NAME}: {reason}")
        return reason is None

    def load(self, verbose: bool = True):
        if not self.OP:
            raise NotAvailableError(f"deepspeed.ops.op_builder.{type(self).__name__}: zero has no {self.NAME} op "
                                    f"(zero builds cpu_adam and fused_adam)")
        return builder.load(self.OP)

    def absolute_name(self) -> str:
        return f"zero.ops.{self.OP}"


class CPUAdamBuilder(_Builder):
    NAME, OP = "cpu_adam", "cpu_adam"


class FusedAdamBuilder(_Builder):
    NAME, OP = "fused_adam", "fused_adam"


def __getattr__(name: str):
    if name.endswith("Builder") and name[0].isupper():  # any other DeepSpeed op: not compatible here
        op = name.removesuffix("Builder")
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", op).lower()  # AsyncIO: async_io
        return type(name, (_Builder,), {"NAME": snake})
    return missing(__name__, name)

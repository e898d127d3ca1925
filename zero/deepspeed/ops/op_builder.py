"""`deepspeed.ops.op_builder`: DeepSpeed's op builders, answering for zero's own ops (zero/ops/builder.py).

Every builder DeepSpeed 0.19.8 has is here under its name with DeepSpeed's op name (`NAME`). Those of the
ops zero has answer for them: `CPUAdamBuilder` and `FusedAdamBuilder` build zero's `cpu_adam` and
`fused_adam` kernels (on a machine without a CUDA GPU, FusedAdam's is `cpu_adam`, as DeepSpeed's CPU
accelerator builds a host FusedAdam); the Lion builders are compatible everywhere, because zero's Lion
(zero.optim.lion.Lion, behind deepspeed.ops.lion) is torch code with no native op. The others are not
compatible, and `load()` says so.
"""
from __future__ import annotations

from zero.deepspeed._missing import NotAvailableError, missing
from zero.ops import builder as _ops  # not `builder`: DeepSpeed's package has a module of that name

LION = "lion"  # an op zero runs as torch code: nothing to build or load

# DeepSpeed's builder classes: their op name, and zero's op for it (None: zero has none)
BUILDERS: dict[str, tuple[str, str | None]] = {
    "AsyncIOBuilder": ("async_io", None),
    "CCLCommBuilder": ("deepspeed_ccl_comm", None),
    "CPUAdagradBuilder": ("cpu_adagrad", None),
    "CPUAdamBuilder": ("cpu_adam", "cpu_adam"),
    "CPULionBuilder": ("cpu_lion", LION),
    "DeepCompileBuilder": ("dc", None),
    "EvoformerAttnBuilder": ("evoformer_attn", None),
    "FPQuantizerBuilder": ("fp_quantizer", None),
    "FlashAttentionBuilder": ("flash_attn", None),
    "FusedAdamBuilder": ("fused_adam", "fused_adam"),
    "FusedLambBuilder": ("fused_lamb", None),
    "FusedLionBuilder": ("fused_lion", LION),
    "GDSBuilder": ("gds", None),
    "InferenceBuilder": ("transformer_inference", None),
    "InferenceCoreBuilder": ("inference_core_ops", None),
    "InferenceCutlassBuilder": ("cutlass_ops", None),
    "NotImplementedBuilder": ("deepspeed_not_implemented", None),
    "PinMemoryBuilder": ("pin_memory", None),
    "QuantizerBuilder": ("quantizer", None),
    "RaggedOpsBuilder": ("ragged_device_ops", None),
    "RaggedUtilsBuilder": ("ragged_ops", None),
    "RandomLTDBuilder": ("random_ltd", None),
    "ShareMemCommBuilder": ("deepspeed_shm_comm", None),
    "SpatialInferenceBuilder": ("spatial_inference", None),
    "StochasticTransformerBuilder": ("stochastic_transformer", None),
    "TransformerBuilder": ("transformer", None),
    "UtilsBuilder": ("utils", None),
}


class OpBuilder:
    """The base of the builders: `is_compatible()`: can the op be built or loaded here; `load()`: build
    (once) and load it."""

    NAME = ""  # DeepSpeed's op name
    OP: str | None = None  # zero's op (LION: torch code)

    def __init__(self):
        self.name = self.NAME

    def _missing(self) -> str | None:
        """Why the op cannot run here, or None."""
        if self.OP is None:
            return f"zero has no {self.NAME} op"
        return None if self.OP == LION else _ops.missing(self.OP)

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = self._missing()
        if reason is not None and verbose:
            print(f"{self.NAME}: {reason}")
        return reason is None

    def load(self, verbose: bool = True):
        if self.OP is None:
            raise NotAvailableError(f"deepspeed.ops.op_builder.{type(self).__name__}: zero has no {self.NAME} op "
                                    f"(zero builds cpu_adam and fused_adam)")
        if self.OP == LION:
            raise NotAvailableError(f"deepspeed.ops.op_builder.{type(self).__name__}: zero's Lion is torch code "
                                    f"(zero.optim.lion.Lion) with no native op to load; use "
                                    f"deepspeed.ops.lion.DeepSpeedCPULion or FusedLion")
        return _ops.load(self.OP)

    def absolute_name(self) -> str:
        return f"zero.ops.{self.OP}"


class _FusedAdamBuilder(OpBuilder):
    """Without a CUDA GPU DeepSpeed's CPU accelerator builds its FusedAdam for the host, and zero's
    FusedAdam steps host tensors with the CPU Adam kernel: there the op is `cpu_adam`."""

    OP = "fused_adam"

    def __init__(self):
        import torch

        super().__init__()
        if not torch.cuda.is_available():
            self.OP = "cpu_adam"  # what is_compatible() asks about

    def load(self, verbose: bool = True):
        if self.OP == "cpu_adam":
            raise NotAvailableError("deepspeed.ops.op_builder.FusedAdamBuilder: without a CUDA GPU zero's FusedAdam "
                                    "(deepspeed.ops.adam.FusedAdam) steps host tensors with the CPU Adam kernel, "
                                    "which CPUAdamBuilder().load() loads; there is no multi-tensor op to load here")
        return super().load(verbose)


for _name, (_op_name, _op) in BUILDERS.items():
    _base = _FusedAdamBuilder if _op == "fused_adam" else OpBuilder
    globals()[_name] = type(_name, (_base,), {"NAME": _op_name, "OP": _op, "__module__": __name__})
del _name, _op_name, _op, _base


def __getattr__(name: str):
    return missing(__name__, name)

"""Adam/AdamW on the CPU: the native kernel (csrc/adam/cpu_adam.c) as a torch optimizer.

* `CPUAdam`: a `torch.optim.Optimizer` for fp32 CPU parameters, a drop-in for
  `torch.optim.AdamW` (or `torch.optim.Adam` with `adamw_mode=False`). Its `state_dict()` has
  torch's Adam layout, so state moves between the two both ways.
* One step on flat tensors is `zero.ops.adam.adam_step`, the one entry point for every device and
  state format (the engine's hot path calls it unchecked).

The kernel picks AVX-512, AVX2 or portable C at run time; `simd_levels()` lists what this CPU runs
and `simd=` forces one (every level computes the same bits; the tests run each against torch).
zero.ops.simd reads `simd=` and `num_threads=` for every CPU op.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero.ops import simd as _simd
from zero.ops.adam_common import (
    AdamOptimizerBase,
    bump_versions,
    check_tensor,
)
from zero.ops.builder import load

_OP = "cpu_adam"


def _op():
    return load(_OP)


def simd_levels() -> list[str]:
    """SIMD levels the kernel can run on this CPU, best first (e.g. ["avx512", "avx2", "scalar"])."""
    return _simd.simd_levels(_OP)


def _check_tensor(
    t: Any, name: str, dtypes: tuple[torch.dtype, ...], numel: int | None = None, *, contiguous: bool = True
) -> None:
    """Raise ValueError unless `t` is a (contiguous) dense CPU tensor of one of `dtypes` (and `numel`)."""
    check_tensor(t, name, dtypes, numel, contiguous=contiguous, device_type="cpu")


# ----------------------------------------------------------------------------- optimizer


class CPUAdam(AdamOptimizerBase):
    """Adam/AdamW for float32 CPU parameters, one native pass per parameter per step.

    With the default `adamw_mode=True` it computes what `torch.optim.AdamW` computes (to fp32
    round-off); with `adamw_mode=False`, what `torch.optim.Adam` computes. `state_dict()` uses
    torch's Adam layout (per parameter: "step" as a float32 scalar tensor, "exp_avg",
    "exp_avg_sq"), so a state dict saved by either optimizer loads into the other.

    Args:
        params: float32 CPU parameters (contiguous), or dicts of parameter groups.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`. The default
            is 0 (as in torch.optim.Adam and DeepSpeed), not torch.optim.AdamW's 0.01.
        adamw_mode: True: decoupled weight decay like torch.optim.AdamW; False: L2 like torch.optim.Adam.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        amsgrad: must be False; AMSGrad is not implemented.
        num_threads: OpenMP threads per step; None = torch.get_num_threads().
        simd: "avx512", "avx2" or "scalar" to force a code path; None = best available.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        *,
        num_threads: int | None = None,
        simd: str | None = None,
    ) -> None:
        self.num_threads = num_threads
        self.simd = simd
        super().__init__(params, lr, betas, eps, weight_decay, adamw_mode, bias_correction, amsgrad)

    def _check_options(self) -> None:
        self._simd_code = _simd.simd_code(self.simd, _OP)
        _simd.num_threads(self.num_threads)  # validate now, resolve at each step (torch's thread count may change)

    def _check_param(self, p: Any, name: str) -> None:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(
                f"{name} is a {p.dtype} tensor on {p.device}; CPUAdam updates float32 CPU parameters only "
                f"(keep an fp32 CPU master copy, or use zero.ops.FusedAdam for GPU parameters)"
            )
        if not p.is_contiguous():
            raise ValueError(f"{name} is not contiguous; CPUAdam needs contiguous parameters")

    def _check_tensor(
        self, t: Any, name: str, dtypes: tuple[torch.dtype, ...], param: torch.Tensor, *, contiguous: bool = True
    ) -> None:
        _check_tensor(t, name, dtypes, param.numel(), contiguous=contiguous)

    def _update(self, work: list[tuple[dict, list]]) -> None:
        threads = _simd.num_threads(self.num_threads)
        op = _op() if work else None  # built (or found missing) before any state changes
        for group, items in work:
            for p, target in items:
                step = self._next_step(p)
                state = self.state[p]
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                op.adam_step(
                    p, grad, state["exp_avg"], state["exp_avg_sq"], target,
                    float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                    float(group["weight_decay"]), 1.0, step, bool(group["adamw_mode"]),
                    bool(group["bias_correction"]), self._simd_code, threads,
                )  # fmt: skip
                bump_versions((p, target))

"""Adam/AdamW on the CPU with the native kernel (csrc/adam/cpu_adam.c).

Two ways in:

* `cpu_adam_step(...)`: one step over flat contiguous CPU tensors. This is what the engine calls
  on each rank's fp32 master shard (ZeRO-Offload), optionally unscaling the gradient and writing
  the updated parameters to a 16-bit buffer in the same pass.
* `CPUAdam`: a `torch.optim.Optimizer` for fp32 CPU parameters, a drop-in for
  `torch.optim.AdamW` (or `torch.optim.Adam` with `adamw_mode=False`). Its `state_dict()` has
  torch's Adam layout, so state moves between the two both ways.

Every argument is checked, with a ValueError naming the offending one, before any buffer is
written. The kernel picks AVX-512, AVX2 or portable C at run time; `simd_levels()` lists what
this CPU runs and `simd=` forces one (the tests run every level against torch).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zero.ops.adam_args import check_adam_hyperparameters
from zero.ops.builder import load

# SIMD level names in the kernel's numbering (ZERO_SIMD_SCALAR = 0, ...; csrc/adam/cpu_adam.h).
SIMD_NAMES = ("scalar", "avx2", "avx512")
_BEST = -1

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT16_DTYPES = (torch.bfloat16, torch.float16)


def _op():
    return load("cpu_adam")


def simd_levels() -> list[str]:
    """SIMD levels the kernel can run on this CPU, best first (e.g. ["avx512", "avx2", "scalar"])."""
    return list(_op().simd_levels())


def _simd_code(simd: str | None, what: str = "simd") -> int:
    if simd is None:
        return _BEST
    if simd not in SIMD_NAMES:
        raise ValueError(f"{what} must be None (best available) or one of {list(SIMD_NAMES)}, got {simd!r}")
    available = simd_levels()
    if simd not in available:
        raise ValueError(f"{what}={simd!r} is not available on this CPU; available: {available}")
    return SIMD_NAMES.index(simd)


def _num_threads(num_threads: int | None, what: str = "num_threads") -> int:
    if num_threads is None:
        return torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise ValueError(f"{what} must be an int or None, got {num_threads!r}")
    return num_threads


# ----------------------------------------------------------------------------- argument checks


def _check_tensor(
    t: Any, name: str, dtypes: tuple[torch.dtype, ...], numel: int | None = None, *, contiguous: bool = True
) -> None:
    """Raise ValueError unless `t` is a (contiguous) dense CPU tensor of one of `dtypes` (and `numel`)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense tensor, got layout {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but param has {numel}")


def _check_step_number(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the 1-based count of this step), got {step!r}")


def _check_grad_scale(grad_scale: Any) -> None:
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale) \
            or grad_scale <= 0:
        raise ValueError(f"grad_scale must be a finite number > 0 (1.0 = no scaling), got {grad_scale!r}")


# ----------------------------------------------------------------------------- functional step


def cpu_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    simd: str | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam/AdamW step in place on contiguous CPU buffers, in a single pass over memory.

    Computes, elementwise (see csrc/adam/cpu_adam.h):
    `g = grad / grad_scale`; AdamW: `param *= 1 - lr*weight_decay`, Adam: `g += weight_decay*param`;
    `m = beta1*m + (1-beta1)*g`; `v = beta2*v + (1-beta2)*g*g`;
    `param -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` with `bc = 1 - beta**step` (or 1).

    Args:
        param: float32 master parameters; updated in place. Any shape, contiguous.
        grad: gradient, float32, bfloat16 or float16, same number of elements; read only.
        exp_avg: float32 first moment, same number of elements; updated in place.
        exp_avg_sq: float32 second moment, same number of elements; updated in place.
        step: the 1-based number of this step (1 on the first call for these buffers).
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True for torch.optim.AdamW's decoupled decay, False for torch.optim.Adam's L2.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        grad_scale: the gradient is divided by this first (loss-scale unscaling and clipping in
            the same pass); 1.0 = none.
        out16: optional bfloat16/float16 buffer with param's number of elements; receives the
            updated param rounded to nearest even, bit-identical to `param.to(out16.dtype)`
            for every non-NaN value (a NaN is written as a canonical quiet NaN).
        simd: "avx512", "avx2" or "scalar" to force a code path; None = best available.
        num_threads: OpenMP threads; None = torch.get_num_threads(), <= 0 = OpenMP's default.

    Raises:
        ValueError: an argument is invalid; nothing has been written.
    """
    _check_tensor(param, "param", (torch.float32,))
    n = param.numel()
    _check_tensor(grad, "grad", GRAD_DTYPES, n)
    _check_tensor(exp_avg, "exp_avg", (torch.float32,), n)
    _check_tensor(exp_avg_sq, "exp_avg_sq", (torch.float32,), n)
    if out16 is not None:
        _check_tensor(out16, "out16", OUT16_DTYPES, n)
    _check_step_number(step)
    check_adam_hyperparameters(lr, betas, eps, weight_decay)
    _check_grad_scale(grad_scale)
    code = _simd_code(simd)
    threads = _num_threads(num_threads)
    _op().adam_step(
        param, grad, exp_avg, exp_avg_sq, out16,
        float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale),
        int(step), bool(adamw_mode), bool(bias_correction), code, threads,
    )  # fmt: skip
    _bump_versions(param, exp_avg, exp_avg_sq, out16)


def _bump_versions(*tensors: torch.Tensor | None) -> None:
    """Tell autograd these tensors were modified in place (the kernel writes through raw pointers),
    as torch's own in-place optimizer updates do, so stale saved tensors are detected."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is None:  # pragma: no cover - very old torch
        return
    for t in tensors:
        if t is not None and not t.is_inference():
            bump(t)


def stream_pass(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    simd: str | None = None, num_threads: int | None = None,
) -> None:  # fmt: skip
    """Bandwidth probe with the memory traffic of an fp32 Adam step (benchmark ceiling).

    Reads all four float32 buffers and writes param, exp_avg and exp_avg_sq (28 bytes per element),
    with the same tiling and threads as `cpu_adam_step`; each written buffer gets `grad` added.

    Args:
        param, grad, exp_avg, exp_avg_sq: contiguous float32 CPU tensors of equal size.
        simd: as for `cpu_adam_step`.
        num_threads: as for `cpu_adam_step`.
    """
    _check_tensor(param, "param", (torch.float32,))
    for t, name in ((grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
        _check_tensor(t, name, (torch.float32,), param.numel())
    _op().stream_pass(param, grad, exp_avg, exp_avg_sq, _simd_code(simd), _num_threads(num_threads))


# ----------------------------------------------------------------------------- optimizer


class CPUAdam(torch.optim.Optimizer):
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
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by CPUAdam; use torch.optim.AdamW(amsgrad=True)")
        self._simd_code = _simd_code(simd)
        _num_threads(num_threads)  # validate now, resolve at each step (torch's thread count may change)
        self.num_threads = num_threads
        self.simd = simd
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=bool(adamw_mode),
                        bias_correction=bool(bias_correction), amsgrad=False)  # fmt: skip
        super().__init__(params, defaults)

    # -- parameter groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group after checking its parameters and hyperparameters.

        Args:
            param_group: {"params": ..., optional per-group hyperparameters}, as for torch optimizers.
        """
        index = len(self.param_groups)
        param_group = dict(param_group)
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            param_group["params"] = [params]
        elif params is not None and not isinstance(params, set):  # torch itself rejects sets
            param_group["params"] = list(params)
        merged = {**self.defaults, **param_group}
        _check_group_hyperparameters(merged, index)
        for i, p in enumerate(param_group.get("params", [])):
            _check_param(p, f"param_groups[{index}]['params'][{i}]")
        super().add_param_group(param_group)

    # -- state dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by CPUAdam, torch.optim.AdamW or torch.optim.Adam.

        Groups saved by torch keep their hyperparameters; `adamw_mode` is taken from torch's
        `decoupled_weight_decay` when present (AdamW always sets it), else from this optimizer's
        current group. AMSGrad or maximize states are refused.

        Args:
            state_dict: as returned by `state_dict()` of one of those optimizers.
        """
        for i, group in enumerate(state_dict.get("param_groups", [])):
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    raise ValueError(f"state_dict param_groups[{i}] has {key}=True, which CPUAdam does not support")
        previous = [(g["adamw_mode"], g["bias_correction"]) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, (adamw_mode, bias_correction) in zip(self.param_groups, previous):
            if "adamw_mode" not in group:
                group["adamw_mode"] = bool(group.get("decoupled_weight_decay", adamw_mode))
            group.setdefault("bias_correction", bias_correction)
            group.setdefault("amsgrad", False)

    # -- step

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, out16: Sequence[torch.Tensor | None] | None = None
    ) -> float | None:
        """Update every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
            out16: optional 16-bit copy-out, one entry per parameter in the order
                `[p for g in param_groups for p in g["params"]]`. An entry is None or a contiguous
                bfloat16/float16 tensor with the parameter's number of elements; it receives the
                updated parameter rounded to nearest even (bit-identical to `p.to(dtype)` except for
                NaN bit patterns), written in the same pass as the update. Parameters without a
                gradient leave theirs untouched.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a parameter, gradient, state tensor, hyperparameter or out16 entry is
                invalid; checked for every parameter before any is updated.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work = self._collect(out16)
        threads = _num_threads(self.num_threads)
        op = _op() if work else None  # built (or found missing) before any state changes
        for group, p, target in work:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            step = int(state["step"].item()) + 1
            state["step"].fill_(step)
            grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            op.adam_step(
                p, grad, state["exp_avg"], state["exp_avg_sq"], target,
                float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                float(group["weight_decay"]), 1.0, step, bool(group["adamw_mode"]),
                bool(group["bias_correction"]), self._simd_code, threads,
            )  # fmt: skip
            _bump_versions(p, target)
        return loss

    def _collect(self, out16: Sequence[torch.Tensor | None] | None) -> list[tuple[dict, torch.Tensor, Any]]:
        """Check everything a step will touch and list (group, param, out16 entry) to update."""
        all_params = [p for g in self.param_groups for p in g["params"]]
        if out16 is not None:
            out16 = list(out16)
            if len(out16) != len(all_params):
                raise ValueError(f"out16 has {len(out16)} entries but the optimizer has {len(all_params)} parameters")
        work, flat = [], 0
        for gi, group in enumerate(self.param_groups):
            _check_group_hyperparameters(group, gi)
            for i, p in enumerate(group["params"]):
                name = f"param_groups[{gi}]['params'][{i}]"
                target = out16[flat] if out16 is not None else None
                flat += 1
                if p.grad is None:
                    continue
                _check_param(p, name)
                if p.grad.is_sparse:
                    raise ValueError(f"{name} has a sparse gradient; CPUAdam needs dense gradients")
                _check_tensor(p.grad, f"{name}.grad", GRAD_DTYPES, p.numel(), contiguous=False)
                state = self.state.get(p)
                if state:
                    for key in ("exp_avg", "exp_avg_sq"):
                        _check_tensor(state.get(key), f"state of {name}: {key}", (torch.float32,), p.numel())
                    if not isinstance(state.get("step"), torch.Tensor) or state["step"].numel() != 1:
                        raise ValueError(f"state of {name}: 'step' must be a scalar tensor, got {state.get('step')!r}")
                if target is not None:
                    _check_tensor(target, f"out16[{flat - 1}] (for {name})", OUT16_DTYPES, p.numel())
                work.append((group, p, target))
        return work


def _check_group_hyperparameters(group: dict[str, Any], index: int) -> None:
    try:
        check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    except ValueError as exc:
        raise ValueError(f"param_groups[{index}]: {exc}") from None
    if group.get("amsgrad"):
        raise ValueError(f"param_groups[{index}]: amsgrad=True is not supported by CPUAdam")


def _check_param(p: Any, name: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(
            f"{name} is a {p.dtype} tensor on {p.device}; CPUAdam updates float32 CPU parameters only "
            f"(keep an fp32 CPU master copy, or use zero.ops.FusedAdam for GPU parameters)"
        )
    if not p.is_contiguous():
        raise ValueError(f"{name} is not contiguous; CPUAdam needs contiguous parameters")

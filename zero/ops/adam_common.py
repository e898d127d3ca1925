"""What CPUAdam and FusedAdam share: argument checks and the torch.optim.Optimizer plumbing.

`cpu_adam.py` and `fused_adam.py` keep only what depends on the device: the native step call,
where a tensor must live, and (for the CPU) the SIMD and thread knobs. Every check here runs
before any buffer is touched, and raises a ValueError naming the offending argument.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT16_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- argument checks


def check_adam_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the first bad hyperparameter.

    Args:
        lr: learning rate, finite and >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: term added to the denominator, finite and >= 0.
        weight_decay: finite and >= 0.
    """
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    for name, b in (("betas[0]", b1), ("betas[1]", b2)):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def check_tensor(
    t: Any,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    numel: int | None = None,
    *,
    contiguous: bool = True,
    device_type: str | None = None,
) -> None:
    """Raise ValueError unless `t` is a (contiguous) dense tensor of one of `dtypes` (and `numel`).

    Args:
        t: the value to check.
        name: what to call it in the message.
        dtypes: the dtypes it may have.
        numel: the number of elements it must have (its param's), or None for any.
        contiguous: whether it must be contiguous.
        device_type: "cpu" or "cuda" to check the device type right after the layout; None
            leaves the device to the caller (FusedAdam checks devices after every dtype and size).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense tensor, got layout {t.layout}")
    if device_type is not None and t.device.type != device_type:
        raise ValueError(f"{name} must be a {device_type.upper()} tensor, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but param has {numel}")


def check_step_number(step: Any) -> None:
    """Raise ValueError unless `step` is the int 1-based count of this step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the 1-based count of this step), got {step!r}")


def check_grad_scale(grad_scale: Any) -> None:
    """Raise ValueError unless `grad_scale` is a finite number > 0."""
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale) \
            or grad_scale <= 0:
        raise ValueError(f"grad_scale must be a finite number > 0 (1.0 = no scaling), got {grad_scale!r}")


def bump_versions(tensors: Iterable[torch.Tensor | None]) -> None:
    """Tell autograd these tensors were modified in place (the kernel writes through raw pointers),
    as torch's own in-place optimizer updates do, so stale saved tensors are detected."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is None:  # pragma: no cover - very old torch
        return
    for t in tensors:
        if t is not None and not t.is_inference():
            bump(t)


# ----------------------------------------------------------------------------- optimizer


class AdamOptimizerBase(torch.optim.Optimizer):
    """The torch.optim.Optimizer half of CPUAdam and FusedAdam: groups, state dict, checks.

    `state_dict()` uses torch's Adam layout (per parameter: "step" as a float32 scalar tensor,
    "exp_avg", "exp_avg_sq"), so state moves to and from torch.optim.Adam/AdamW both ways.

    A subclass supplies `_update` (the native step over checked parameters), `_check_param`
    (what a parameter must be on its device) and `_check_tensor` (a grad, moment or out16
    tensor, including its device); it may override `_check_options` to check its own
    constructor options. The constructor's arguments are documented on CPUAdam and FusedAdam.
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
    ) -> None:
        name = type(self).__name__
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if amsgrad:
            raise ValueError(f"amsgrad=True is not supported by {name}; use torch.optim.AdamW(amsgrad=True)")
        self._check_options()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=bool(adamw_mode),
                        bias_correction=bool(bias_correction), amsgrad=False)  # fmt: skip
        super().__init__(params, defaults)

    # -- what a subclass supplies

    def _check_options(self) -> None:
        """Check the subclass's own constructor options (after the hyperparameters, before the params)."""

    def _update(self, work: list[tuple[dict, list]]) -> None:
        """Step every (param, out16 entry) of `work`, as listed by `_collect`, per group."""
        raise NotImplementedError

    def _check_param(self, p: Any, name: str) -> None:
        raise NotImplementedError

    def _check_tensor(
        self, t: Any, name: str, dtypes: tuple[torch.dtype, ...], param: torch.Tensor, *, contiguous: bool = True
    ) -> None:
        """Check a tensor that goes with `param` (dtype, size `param.numel()`, device)."""
        raise NotImplementedError

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
        self._check_group_hyperparameters(merged, index)
        for i, p in enumerate(param_group.get("params", [])):
            self._check_param(p, f"param_groups[{index}]['params'][{i}]")
        super().add_param_group(param_group)

    def _check_group_hyperparameters(self, group: dict[str, Any], index: int) -> None:
        try:
            check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        except ValueError as exc:
            raise ValueError(f"param_groups[{index}]: {exc}") from None
        if group.get("amsgrad"):
            raise ValueError(f"param_groups[{index}]: amsgrad=True is not supported by {type(self).__name__}")

    # -- state dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by CPUAdam, FusedAdam, torch.optim.AdamW or torch.optim.Adam.

        Moment tensors move to their parameter's device. Groups saved by torch keep their
        hyperparameters; `adamw_mode` is taken from torch's `decoupled_weight_decay` when present
        (AdamW always sets it), else from this optimizer's current group. AMSGrad or maximize
        states are refused.

        Args:
            state_dict: as returned by `state_dict()` of one of those optimizers.
        """
        for i, group in enumerate(state_dict.get("param_groups", [])):
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    raise ValueError(
                        f"state_dict param_groups[{i}] has {key}=True, which {type(self).__name__} does not support"
                    )
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
                bfloat16/float16 tensor on the parameter's device with its number of elements; it
                receives the updated parameter rounded to nearest even (bit-identical to
                `p.to(dtype)` for every non-NaN value), written in the same pass as the update.
                Parameters without a gradient leave theirs untouched.

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
        self._update(self._collect(out16))
        return loss

    def _next_step(self, p: torch.Tensor) -> int:
        """Create `p`'s state on its first step, count this step in it, and return the step number."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        step = int(state["step"].item()) + 1
        state["step"].fill_(step)
        return step

    def _collect(self, out16: Sequence[torch.Tensor | None] | None) -> list[tuple[dict, list]]:
        """Check everything a step will touch; list, per group, the (param, out16 entry) to update.

        Groups with nothing to update are left out."""
        all_params = [p for g in self.param_groups for p in g["params"]]
        if out16 is not None:
            out16 = list(out16)
            if len(out16) != len(all_params):
                raise ValueError(f"out16 has {len(out16)} entries but the optimizer has {len(all_params)} parameters")
        work, flat = [], 0
        for gi, group in enumerate(self.param_groups):
            self._check_group_hyperparameters(group, gi)
            items = []
            for i, p in enumerate(group["params"]):
                name = f"param_groups[{gi}]['params'][{i}]"
                target = out16[flat] if out16 is not None else None
                flat += 1
                if p.grad is None:
                    continue
                self._check_param(p, name)
                if p.grad.is_sparse:
                    raise ValueError(f"{name} has a sparse gradient; {type(self).__name__} needs dense gradients")
                self._check_tensor(p.grad, f"{name}.grad", GRAD_DTYPES, p, contiguous=False)
                state = self.state.get(p)
                if state:
                    for key in ("exp_avg", "exp_avg_sq"):
                        self._check_tensor(state.get(key), f"state of {name}: {key}", (torch.float32,), p)
                    if not isinstance(state.get("step"), torch.Tensor) or state["step"].numel() != 1:
                        raise ValueError(f"state of {name}: 'step' must be a scalar tensor, got {state.get('step')!r}")
                if target is not None:
                    self._check_tensor(target, f"out16[{flat - 1}] (for {name})", OUT16_DTYPES, p)
                items.append((p, target))
            if items:
                work.append((group, items))
        return work

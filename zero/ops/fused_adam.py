"""Adam/AdamW on the GPU with the fused multi-tensor kernel (csrc/adam/fused_adam.cu).

The GPU twin of `zero.ops.cpu_adam`, with the same names and behaviour. Two ways in:

* `fused_adam_step(...)`: one step over lists of CUDA tensors in one kernel launch (a few when
  the list is long or mixes devices or grad dtypes). This is what the engine calls on each
  rank's fp32 master shard, optionally unscaling the gradient and writing the updated
  parameters to 16-bit buffers in the same pass.
* `FusedAdam`: a `torch.optim.Optimizer` for fp32 CUDA parameters, a drop-in for
  `torch.optim.AdamW` (or `torch.optim.Adam` with `adamw_mode=False`). Its `state_dict()` has
  torch's Adam layout, so state moves between the two both ways.

Every argument is checked, with a ValueError naming the offending one, before anything is
launched; scalars and dtypes are checked before devices, so those checks need no GPU. The op is
compiled at first use, so importing this module works on a machine without CUDA.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zero.ops.adam_args import check_adam_hyperparameters
from zero.ops.builder import load

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT16_DTYPES = (torch.bfloat16, torch.float16)


def _op():
    return load("fused_adam")


# ----------------------------------------------------------------------------- argument checks


def _check_tensor(
    t: Any, name: str, dtypes: tuple[torch.dtype, ...], numel: int | None = None, *, contiguous: bool = True
) -> None:
    """Raise ValueError unless `t` is a (contiguous) dense tensor of one of `dtypes` (and `numel`).

    The device is checked separately (`_check_device`), after every dtype and size check."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but param has {numel}")


def _check_device(t: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    """Raise ValueError unless `t` is a CUDA tensor (on `device`, when given)."""
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} must be a CUDA tensor, got device {t.device} "
            f"(FusedAdam runs on the GPU; use zero.ops.CPUAdam for CPU tensors)"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but its param is on {device}")


def _check_step_number(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the 1-based count of this step), got {step!r}")


def _check_grad_scale(grad_scale: Any) -> None:
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale) \
            or grad_scale <= 0:
        raise ValueError(f"grad_scale must be a finite number > 0 (1.0 = no scaling), got {grad_scale!r}")


def _as_list(xs: Any, name: str, n: int | None = None) -> list:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise ValueError(f"{name} must be a list of tensors, got {type(xs).__name__}")
    if n is not None and len(xs) != n:
        raise ValueError(f"{name} has {len(xs)} entries but params has {n}")
    return list(xs)


def _bump_versions(tensors: Iterable[torch.Tensor | None]) -> None:
    """Tell autograd these tensors were modified in place (the kernel writes through raw pointers),
    as torch's own in-place optimizer updates do, so stale saved tensors are detected."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is None:  # pragma: no cover - very old torch
        return
    for t in tensors:
        if t is not None and not t.is_inference():
            bump(t)


# ----------------------------------------------------------------------------- functional step


def fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """One Adam/AdamW step in place over lists of CUDA tensors, in one fused launch.

    Computes, elementwise (see csrc/adam/fused_adam.h):
    `g = grad / grad_scale`; AdamW: `param *= 1 - lr*weight_decay`, Adam: `g += weight_decay*param`;
    `m = beta1*m + (1-beta1)*g`; `v = beta2*v + (1-beta2)*g*g`;
    `param -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` with `bc = 1 - beta**step` (or 1).
    The launch goes on the current CUDA stream of the params' device.

    Args:
        params: float32 CUDA master parameters, contiguous; updated in place.
        grads: one gradient per param, float32, bfloat16 or float16 (may differ between
            entries), contiguous, same number of elements and device; read only.
        exp_avgs: float32 first moments, one per param, same size and device; updated in place.
        exp_avg_sqs: float32 second moments, one per param, same size and device; updated in place.
        step: the 1-based number of this step, shared by every tensor in the call.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True for torch.optim.AdamW's decoupled decay, False for torch.optim.Adam's L2.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        grad_scale: every gradient is divided by this first (loss-scale unscaling and clipping in
            the same pass); 1.0 = none.
        out16: optional list with one entry per param: None, or a contiguous bfloat16/float16
            CUDA tensor with the param's number of elements that receives the updated param
            rounded to nearest even, bit-identical to `param.to(dtype)`.

    Raises:
        ValueError: an argument is invalid; nothing has been launched.
    """
    check_adam_hyperparameters(lr, betas, eps, weight_decay)
    _check_step_number(step)
    _check_grad_scale(grad_scale)
    params = _as_list(params, "params")
    n = len(params)
    grads = _as_list(grads, "grads", n)
    exp_avgs = _as_list(exp_avgs, "exp_avgs", n)
    exp_avg_sqs = _as_list(exp_avg_sqs, "exp_avg_sqs", n)
    outs = [None] * n if out16 is None else _as_list(out16, "out16", n)
    for i in range(n):
        _check_tensor(params[i], f"params[{i}]", (torch.float32,))
        size = params[i].numel()
        _check_tensor(grads[i], f"grads[{i}]", GRAD_DTYPES, size)
        _check_tensor(exp_avgs[i], f"exp_avgs[{i}]", (torch.float32,), size)
        _check_tensor(exp_avg_sqs[i], f"exp_avg_sqs[{i}]", (torch.float32,), size)
        if outs[i] is not None:
            _check_tensor(outs[i], f"out16[{i}]", OUT16_DTYPES, size)
    for i in range(n):
        _check_device(params[i], f"params[{i}]")
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i]),
                        ("out16", outs[i])):  # fmt: skip
            if t is not None:
                _check_device(t, f"{name}[{i}]", params[i].device)
    _launch(params, grads, exp_avgs, exp_avg_sqs, outs, step=step, lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
            grad_scale=grad_scale)  # fmt: skip


def _launch(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    outs: list[torch.Tensor | None],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float,
) -> None:
    """Call the op once per (device, grad dtype, out16 dtype) over already checked tensors."""
    batches: dict[tuple, tuple[list, ...]] = {}
    for p, g, m, v, o in zip(params, grads, exp_avgs, exp_avg_sqs, outs):
        if p.numel() == 0:
            continue
        key = (p.device, g.dtype, None if o is None else o.dtype)
        batch = batches.setdefault(key, ([], [], [], [], []))
        for lst, t in zip(batch, (p, g, m, v, o)):
            lst.append(t)
    if not batches:
        return
    op = _op()
    for (_, _, out_dtype), (ps, gs, ms, vs, os_) in batches.items():
        op.adam_step(
            ps, gs, ms, vs, [] if out_dtype is None else os_,
            float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale),
            int(step), bool(adamw_mode), bool(bias_correction),
        )  # fmt: skip
        _bump_versions(ps)
        _bump_versions(ms)
        _bump_versions(vs)
        _bump_versions(os_)


# ----------------------------------------------------------------------------- optimizer


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW for float32 CUDA parameters: one fused kernel launch per parameter group per step.

    With the default `adamw_mode=True` it computes what `torch.optim.AdamW` computes (to fp32
    round-off); with `adamw_mode=False`, what `torch.optim.Adam` computes. `state_dict()` uses
    torch's Adam layout (per parameter: "step" as a float32 scalar tensor, "exp_avg",
    "exp_avg_sq"), so a state dict saved by either optimizer loads into the other.

    Args:
        params: float32 CUDA parameters (contiguous), or dicts of parameter groups.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam) according to `adamw_mode`.
        adamw_mode: True: decoupled weight decay like torch.optim.AdamW; False: L2 like torch.optim.Adam.
        bias_correction: divide the moments by 1 - beta**step (torch always does).
        amsgrad: must be False; AMSGrad is not implemented.
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
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by FusedAdam; use torch.optim.AdamW(amsgrad=True)")
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
        """Load a state dict saved by FusedAdam, CPUAdam, torch.optim.AdamW or torch.optim.Adam.

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
                    raise ValueError(f"state_dict param_groups[{i}] has {key}=True, which FusedAdam does not support")
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
                bfloat16/float16 CUDA tensor with the parameter's number of elements; it receives
                the updated parameter rounded to nearest even (bit-identical to `p.to(dtype)`),
                written in the same pass as the update. Parameters without a gradient leave
                theirs untouched.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a parameter, gradient, state tensor, hyperparameter or out16 entry is
                invalid; checked for every parameter before anything is launched.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work = self._collect(out16)
        if work:
            _op()  # build or load the op before any state changes, so a failed build changes nothing
        for group, items in work:
            # Parameters of a group usually share their step count; those that skipped steps
            # (no grad) or came from another checkpoint may not, and take their own launch.
            by_step: dict[int, list] = {}
            for p, target in items:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                step = int(state["step"].item()) + 1
                state["step"].fill_(step)
                by_step.setdefault(step, []).append((p, target))
            for step, pairs in by_step.items():
                ps = [p for p, _ in pairs]
                _launch(
                    ps,
                    [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps],
                    [self.state[p]["exp_avg"] for p in ps],
                    [self.state[p]["exp_avg_sq"] for p in ps],
                    [t for _, t in pairs],
                    step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                    bias_correction=group["bias_correction"], grad_scale=1.0,
                )  # fmt: skip
        return loss

    def _collect(self, out16: Sequence[torch.Tensor | None] | None) -> list[tuple[dict, list]]:
        """Check everything a step will touch; list, per group, the (param, out16 entry) to update."""
        all_params = [p for g in self.param_groups for p in g["params"]]
        if out16 is not None:
            out16 = list(out16)
            if len(out16) != len(all_params):
                raise ValueError(f"out16 has {len(out16)} entries but the optimizer has {len(all_params)} parameters")
        work, flat = [], 0
        for gi, group in enumerate(self.param_groups):
            _check_group_hyperparameters(group, gi)
            items = []
            for i, p in enumerate(group["params"]):
                name = f"param_groups[{gi}]['params'][{i}]"
                target = out16[flat] if out16 is not None else None
                flat += 1
                if p.grad is None:
                    continue
                _check_param(p, name)
                if p.grad.is_sparse:
                    raise ValueError(f"{name} has a sparse gradient; FusedAdam needs dense gradients")
                _check_tensor(p.grad, f"{name}.grad", GRAD_DTYPES, p.numel(), contiguous=False)
                _check_device(p.grad, f"{name}.grad", p.device)
                state = self.state.get(p)
                if state:
                    for key in ("exp_avg", "exp_avg_sq"):
                        what = f"state of {name}: {key}"
                        _check_tensor(state.get(key), what, (torch.float32,), p.numel())
                        _check_device(state[key], what, p.device)
                    if not isinstance(state.get("step"), torch.Tensor) or state["step"].numel() != 1:
                        raise ValueError(f"state of {name}: 'step' must be a scalar tensor, got {state.get('step')!r}")
                if target is not None:
                    what = f"out16[{flat - 1}] (for {name})"
                    _check_tensor(target, what, OUT16_DTYPES, p.numel())
                    _check_device(target, what, p.device)
                items.append((p, target))
            if items:
                work.append((group, items))
        return work


def _check_group_hyperparameters(group: dict[str, Any], index: int) -> None:
    try:
        check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    except ValueError as exc:
        raise ValueError(f"param_groups[{index}]: {exc}") from None
    if group.get("amsgrad"):
        raise ValueError(f"param_groups[{index}]: amsgrad=True is not supported by FusedAdam")


def _check_param(p: Any, name: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.dtype != torch.float32:
        raise ValueError(
            f"{name} is a {p.dtype} tensor; FusedAdam updates float32 parameters only "
            f"(keep an fp32 master copy and pass the 16-bit one as out16)"
        )
    if not p.is_contiguous():
        raise ValueError(f"{name} is not contiguous; FusedAdam needs contiguous parameters")
    _check_device(p, name)

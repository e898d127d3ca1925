"""Muon (`"optimizer": {"type": "Muon"}`, or a client torch.optim.Muon): which parameters it updates,
how the config's keys reach its two halves, the update of one whole matrix, and which rank owns
each matrix. The stages keep the matrices whole on their owners: the `Owned` placement ([Note:
placements] in zero/stages/placement.py; stages 0-2) and [Note: owned parameters in units] in
zero/stages/owned.py (stage 3).

[Note: Muon and partitions]
Muon updates a matrix with its momentum orthogonalised by Newton-Schulz iterations, which need the
whole matrix; Adam's element-wise update does not, which is why ZeRO's flat chunks suit Adam. Under
ZeRO each 2-D Muon matrix gets one owner rank (matrices assigned whole, balanced by their
Newton-Schulz work); the owner updates it from the reduced gradient with `update_matrix`, which is
torch.optim.Muon's own update. The matrix's gradient is reduced to its owner instead of
reduce-scattered, and its new values are broadcast from the owner instead of all-gathered: the
same bytes (the comm report counts them as `reduce` and `broadcast_params`), in one collective per
matrix where Adam's path has one per bucket or unit. Every other parameter (1-D, embeddings, the output head) goes to AdamW, as DeepSpeed
splits them, and takes Adam's path. Stage 0 keeps every matrix on every rank, as it keeps Adam's
state. A parameter of more than two dimensions (a convolution) is orthogonalised as the
(out, rest) matrix, as DeepSpeed does; torch.optim.Muon itself takes 2-D parameters only.
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from zero.stages.placement import assign_owners, ns_cost  # noqa: F401 - where owners are chosen

# the config's optimizer params and the half they go to (DeepSpeed's routing; torch's Muon names)
MUON_ONLY = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")
ADAMW_ONLY = ("betas", "eps")
BOTH = ("weight_decay",)
ZERO_KEYS = ("lr", "muon_lr", "adam_lr", "ns_method")
NS_METHODS = ("standard",)  # torch.optim.Muon's Newton-Schulz; DeepSpeed's "gram" variant is not implemented


class MuonConfigError(ValueError):
    """A Muon setting zero cannot honour; the message names the key or the parameter."""


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's split: a parameter whose layer shape (`ds_shape` under zero.Init) has two or more
    dimensions and whose name contains neither "embed" nor "lm_head" gets Muon; `param.use_muon`
    set by the user decides instead.

    Raises:
        MuonConfigError: `use_muon` is True on a parameter of fewer than two dimensions.
    """
    shape = tuple(getattr(param, "ds_shape", param.shape))
    forced = getattr(param, "use_muon", None)
    if forced is not None:
        if forced and len(shape) < 2:
            raise MuonConfigError(f"parameter {name!r} has use_muon=True but shape {shape}: Muon orthogonalises "
                                  f"matrices, so a parameter of fewer than 2 dimensions must stay with AdamW")
        return bool(forced)
    return len(shape) >= 2 and "embed" not in name and "lm_head" not in name


def split(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str]]:
    """(names of the Muon parameters, names of the AdamW ones), trainable parameters only, each once."""
    muon, adamw, seen = [], [], set()
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (muon if uses_muon(name, p) else adamw).append(name)
    return muon, adamw


@dataclass
class MuonSettings:
    """The config's Muon params split for its two halves (torch.optim.Muon's and AdamW's arguments)."""

    muon: dict[str, Any] = field(default_factory=dict)
    adamw: dict[str, Any] = field(default_factory=dict)


def route(params: dict[str, Any]) -> MuonSettings:
    """DeepSpeed's routing of `"optimizer": {"type": "Muon", "params": {...}}`: `muon_lr` / `adam_lr`
    override `lr` for each half; momentum, nesterov, ns_coefficients, ns_steps and adjust_lr_fn go to
    Muon, betas and eps to AdamW, weight_decay to both. What is not given keeps torch's defaults
    (torch.optim.Muon's: Nesterov, 5 Newton-Schulz steps in bf16, the original lr adjustment).

    Raises:
        MuonConfigError: an unknown key, an unknown ns_method or adjust_lr_fn, or a bad ns_coefficients.
    """
    unknown = sorted(set(params) - set(MUON_ONLY) - set(ADAMW_ONLY) - set(BOTH) - set(ZERO_KEYS))
    if unknown:
        raise MuonConfigError(f"optimizer.params: {unknown} are not Muon keys (Muon takes "
                              f"{sorted(MUON_ONLY + ADAMW_ONLY + BOTH + ZERO_KEYS)})")
    method = params.get("ns_method", "standard")
    if method not in NS_METHODS:
        raise MuonConfigError(f"optimizer.params.ns_method: {method!r} is not implemented; zero runs torch.optim.Muon's "
                              f"Newton-Schulz ({', '.join(map(repr, NS_METHODS))}; DeepSpeed's 'gram' variant is not "
                              f"implemented)")
    fn = params.get("adjust_lr_fn")
    if fn not in (None, "original", "match_rms_adamw"):
        raise MuonConfigError(f"optimizer.params.adjust_lr_fn: {fn!r}; torch.optim.Muon takes 'original' or "
                              f"'match_rms_adamw'")
    coefficients = params.get("ns_coefficients")
    if coefficients is not None and (not isinstance(coefficients, (list, tuple)) or len(coefficients) != 3):
        raise MuonConfigError(f"optimizer.params.ns_coefficients: expected three numbers (a, b, c), got {coefficients!r}")
    out = MuonSettings()
    lr = params.get("lr")
    for half, own in ((out.muon, "muon_lr"), (out.adamw, "adam_lr")):
        value = params.get(own, lr)
        if value is not None:
            half["lr"] = value
    out.muon.update({k: tuple(params[k]) if k == "ns_coefficients" else params[k] for k in MUON_ONLY if k in params})
    out.adamw.update({k: tuple(params[k]) if k == "betas" else params[k] for k in ADAMW_ONLY if k in params})
    for k in BOTH:
        if k in params:
            out.muon[k] = out.adamw[k] = params[k]
    _check_values(out)
    return out


def _check_values(settings: MuonSettings) -> None:
    """The values each half takes, checked by the torch optimizers' own constructors, and what
    torch.optim.Muon checks only inside its step (ns_steps, nesterov), before anything changes."""
    muon = {**muon_defaults(), **settings.muon}
    steps, nesterov = muon["ns_steps"], muon["nesterov"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps < 100:
        raise MuonConfigError(f"optimizer.params.ns_steps: expected a whole number of Newton-Schulz steps in 1..99, "
                              f"got {steps!r}")
    if not isinstance(nesterov, bool):
        raise MuonConfigError(f"optimizer.params.nesterov: expected true or false, got {nesterov!r}")
    if not all(isinstance(c, (int, float)) and math.isfinite(c) for c in muon["ns_coefficients"]):
        raise MuonConfigError(f"optimizer.params.ns_coefficients: expected three finite numbers, got "
                              f"{muon['ns_coefficients']!r}")
    probe = [nn.Parameter(torch.zeros(2, 2))]
    for half, cls, values in (("Muon", torch.optim.Muon, settings.muon), ("AdamW", torch.optim.AdamW, settings.adamw)):
        try:
            cls(probe, **values)
        except (ValueError, TypeError) as e:
            raise MuonConfigError(f"optimizer.params, for the {half} half: {e}") from None


# what a Muon param group passes to the update (torch.optim.Muon's hyperparameters)
MUON_SETTINGS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
_TORCH_ONLY = ("differentiable", "foreach", "fused", "maximize", "capturable")


@functools.cache
def _torch_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    probe = cls([nn.Parameter(torch.zeros(2, 2))])
    return tuple((k, v) for k, v in probe.defaults.items() if k not in _TORCH_ONLY and k != "amsgrad")


def muon_defaults() -> dict[str, Any]:
    """torch.optim.Muon's defaults, read from torch (so they follow the installed version)."""
    return dict(_torch_defaults(torch.optim.Muon))


def adamw_defaults() -> dict[str, Any]:
    """The AdamW half's defaults: torch.optim.AdamW's, as zero's Adam param group keys."""
    return {**dict(_torch_defaults(torch.optim.AdamW)), "bias_correction": True, "adamw_mode": True}


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """The matrix Muon orthogonalises for `param`: its layer shape, a convolution's (out, rest) as
    DeepSpeed flattens it (torch.optim.Muon itself takes 2-D parameters only)."""
    shape = tuple(getattr(param, "ds_shape", param.shape))
    return shape[0], math.prod(shape[1:])


def param_groups(module: nn.Module, model_parameters, settings: MuonSettings) -> list[dict]:
    """The config's Muon: each of the caller's groups (or the model's parameters) split into a
    Muon half (`use_muon: True`, torch.optim.Muon's hyperparameters) and an AdamW half, by
    `uses_muon`; a group's own keys (an lr) apply to both halves. Empty halves are dropped later."""
    names = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, n)  # a tied weight keeps its first name (DeepSpeed's split sees that one)
    items = list(module.parameters() if model_parameters is None else model_parameters)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    muon = {**muon_defaults(), **settings.muon, "use_muon": True}
    adamw = {**adamw_defaults(), **settings.adamw, "use_muon": False}
    out = []
    for gi, g in enumerate(groups):
        if "use_muon" in g:
            raise MuonConfigError(f"model_parameters group {gi} has a 'use_muon' key: zero splits each group into "
                                  f"its Muon and AdamW halves itself; mark parameters with param.use_muon instead")
        own = {k: v for k, v in g.items() if k != "params"}
        params = list(g["params"])
        chosen = [uses_muon(names.get(p, ""), p) if p.requires_grad else False for p in params]
        out.append({**muon, **own, "params": [p for p, c in zip(params, chosen) if c]})
        out.append({**adamw, **own, "params": [p for p, c in zip(params, chosen) if not c]})
    return out


def client_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer, cfg=None) -> list[dict]:
    """A client torch.optim.Muon: its groups are the Muon half, with their own hyperparameters;
    every other trainable parameter of the model goes to AdamW. The AdamW half takes a Muon config
    section's `adam_lr`, `betas`, `eps` and `weight_decay` when the config has one; otherwise
    torch's AdamW defaults with the first group's lr and weight decay (as DeepSpeed's Muon gives
    `adam_lr` the lr when unset), which a warning names."""
    first = optimizer.param_groups[0]
    muon = [{**{k: v for k, v in g.items() if k not in _TORCH_ONLY}, "use_muon": True} for g in optimizer.param_groups]
    taken = {id(p) for g in optimizer.param_groups for p in g["params"]}
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
    section = getattr(cfg, "optimizer", None)
    if section is not None and section.type == "Muon":
        own = route(section.other_params).adamw
        ignored = sorted(set(section.other_params) & {*MUON_ONLY, "muon_lr", "ns_method"})
        if ignored:
            warnings.warn(f"zero: optimizer.params {ignored} do not apply: the client torch.optim.Muon's own settings "
                          f"drive its matrices (the section's AdamW keys drive the other parameters)", stacklevel=5)
    else:
        own = {"lr": first["lr"], "weight_decay": first["weight_decay"]}
        if rest:
            warnings.warn(f"zero: the {len(rest)} trainable parameter(s) outside the client torch.optim.Muon train with "
                          f"AdamW at its lr {first['lr']} and weight decay {first['weight_decay']}; set them with a "
                          f"config section \"optimizer\": {{\"type\": \"Muon\", \"params\": {{\"adam_lr\": ..., "
                          f"\"betas\": ..., \"weight_decay\": ...}}}}", stacklevel=5)
    return muon + [{**adamw_defaults(), **own, "use_muon": False, "params": rest}]


@torch.no_grad()
def update_matrix(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor,
                  ns_device: torch.device | None = None, **settings: Any) -> None:
    """torch.optim.Muon's step on one whole matrix, in place: `param` and `momentum_buffer` change.

    `settings` are torch.optim.Muon's arguments (lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps, adjust_lr_fn); missing ones take torch's defaults. The matrix is
    updated by torch's own functional Muon, so an owner rank under ZeRO computes exactly what a
    single-process torch.optim.Muon does.

    [Note: Newton-Schulz under offload]
    With optimizer offload the master and momentum are in host memory. `ns_device` (the GPU the
    model computes on) then takes the Newton-Schulz iterations, the only part that is not
    element-wise: the momentum and Nesterov steps run on the host, the update goes to the device in
    bf16 (Newton-Schulz's first step casts it to bf16, so nothing is lost), and the orthogonalised
    bf16 result comes back: 4 bytes per element on top of the gradient and parameter copies that
    Adam's offload makes too. The same steps as torch's Muon in the same order, so only the matrix
    products' rounding differs from a host-only update. Without a GPU (`ns_device` is the host)
    the host's BLAS runs them.
    """
    from torch.optim._muon import muon

    if param.ndim != 2 or grad.shape != param.shape or momentum_buffer.shape != param.shape:
        raise ValueError(f"update_matrix: a 2-D parameter, and its gradient and momentum of the same shape, got "
                         f"{tuple(param.shape)}, {tuple(grad.shape)}, {tuple(momentum_buffer.shape)}")
    merged = {**muon_defaults(), **settings}
    if ns_device is not None and torch.device(ns_device) != param.device:
        _update_across(param, grad, momentum_buffer, torch.device(ns_device), merged)
        return
    muon([param], [grad], [momentum_buffer], lr=merged["lr"], weight_decay=merged["weight_decay"],
         momentum=merged["momentum"], nesterov=merged["nesterov"], ns_coefficients=tuple(merged["ns_coefficients"]),
         eps=merged["eps"], ns_steps=merged["ns_steps"], adjust_lr_fn=merged["adjust_lr_fn"],
         has_complex=torch.is_complex(param))


def _update_across(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, device: torch.device,
                   s: dict[str, Any]) -> None:
    """torch.optim.Muon's single-tensor step with its Newton-Schulz iterations on `device`; see
    [Note: Newton-Schulz under offload]."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    grad = grad.to(param.device)  # blocking: the host reads it next
    buf.lerp_(grad, 1 - s["momentum"])
    update = grad.lerp(buf, s["momentum"]) if s["nesterov"] else buf
    ortho = _zeropower_via_newtonschulz(update.bfloat16().to(device), tuple(s["ns_coefficients"]), s["ns_steps"],
                                        s["eps"]).to(param.device)
    param.mul_(1 - s["lr"] * s["weight_decay"])
    param.add_(ortho, alpha=-_adjust_lr(s["lr"], s["adjust_lr_fn"], param.shape))

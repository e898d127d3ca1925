"""Which optimizer the engine runs and over which param groups: zero's Adam/AdamW, or another
element-wise optimizer on the shards (see [Note: other optimizers on shards])."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from zero.features import refused_optimizers
from zero.optim.rules import ClientRule

if TYPE_CHECKING:
    from zero.config import ZeroConfig


CLIENT_OPTIMIZERS = ("SGD", "Adagrad", "Lion")  # the config's types run as element-wise optimizers on the shards


def optimizer_class(kind: str) -> type:
    """The torch optimizer class of a config optimizer type other than Adam/AdamW."""
    if kind == "Lion":
        from zero.optim.lion import Lion

        return Lion
    return {"SGD": torch.optim.SGD, "Adagrad": torch.optim.Adagrad}[kind]


def _param_groups(module: nn.Module, model_parameters, defaults: dict) -> list[dict]:
    """Torch-style groups of trainable parameters, each with complete Adam hyperparameters."""
    if model_parameters is None:
        model_parameters = module.parameters()
    items = list(model_parameters)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out, seen = [], set()
    for gi, g in enumerate(groups):
        params = []
        for p in g["params"]:
            if not isinstance(p, nn.Parameter):
                raise ValueError(f"model_parameters group {gi} holds a {type(p).__name__}, expected nn.Parameter")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        group = {**defaults, **{k: v for k, v in g.items() if k != "params"}, "params": params}
        if params:
            out.append(group)
    if not out:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    return out


# [Note: other optimizers on shards]
# A client optimizer other than Adam/AdamW runs on each rank's shards: zero hands it the fp32 master
# pieces as parameters and their reduced, unscaled (and clipped) gradients. For an element-wise
# optimizer (each element's update depends only on that element's gradient and state) this gives
# exactly the unpartitioned result, with the state partitioned. Optimizers that look at whole
# tensors (factored moments, orthogonalisation, line searches, trust ratios) would see pieces, so
# they are refused; an optimizer class zero does not know is run with a warning.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam,
                torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)
_WHOLE_TENSOR = refused_optimizers()  # see [Note: the feature table] in zero/features.py


def optimizer_groups(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None, module: nn.Module,
                     model_parameters) -> tuple[ClientRule | None, list[dict], bool]:
    """What the engine's optimizer runs: (the client optimizer to run on the shards instead of
    zero's Adam, or None; the param groups, complete; whether they are Muon's and AdamW's)."""
    muon = muon_param_groups(cfg, optimizer, module, model_parameters)
    if muon is not None:
        return None, _param_groups(module, muon, {}), True
    client = client_step(cfg, optimizer)
    groups = model_parameters if optimizer is None else optimizer.param_groups
    return client, _param_groups(module, groups, _optimizer_defaults(cfg, optimizer, client)), False


def muon_param_groups(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None, module: nn.Module,
                      model_parameters) -> list[dict] | None:
    """The param groups of a Muon run (config type Muon, or a client torch.optim.Muon), each with
    `use_muon`; None when the run is not Muon's. See [Note: Muon and partitions] in zero/optim/muon.py."""
    from zero.optim import muon

    if optimizer is not None and isinstance(optimizer, torch.optim.Muon):
        return muon.client_param_groups(module, optimizer, cfg)
    if optimizer is None and cfg.optimizer is not None and cfg.optimizer.type == "Muon":
        return muon.param_groups(module, model_parameters, muon.route(cfg.optimizer.other_params))
    groups = optimizer.param_groups if optimizer is not None else model_parameters
    if isinstance(groups, (list, tuple)) and any(isinstance(g, dict) and "use_muon" in g for g in groups):
        raise ValueError("a param group has a 'use_muon' key, but the optimizer is not Muon: set "
                         "\"optimizer\": {\"type\": \"Muon\"} (zero splits the groups itself) or drop the key")
    return None


def client_step(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None) -> ClientRule | None:
    """The client optimizer to run on the shards instead of zero's Adam, or None for Adam/AdamW.
    See [Note: other optimizers on shards]."""
    if optimizer is not None:
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return None
        return ClientRule(type(optimizer), dict(optimizer.defaults))
    if cfg.optimizer is not None and cfg.optimizer.type in CLIENT_OPTIMIZERS:
        cls = optimizer_class(cfg.optimizer.type)
        return ClientRule(cls, dict(cls([torch.nn.Parameter(torch.zeros(1))], **cfg.optimizer.other_params).defaults))
    return None


def _check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    from zero.optim.lion import Lion

    name = type(optimizer).__name__
    if name in _WHOLE_TENSOR:
        raise ValueError(f"initialize(optimizer=...) got a {name}, which zero cannot run on partitioned shards: "
                         f"{_WHOLE_TENSOR[name]}. Use an element-wise optimizer (Adam, AdamW, SGD, Adagrad, "
                         f"RMSprop, ...); see [Note: other optimizers on shards] in zero/optim/choice.py")
    if not isinstance(optimizer, (*_ELEMENTWISE, Lion)):
        warnings.warn(f"zero: {name} is run on each rank's shards as if it were element-wise (each element's update "
                      f"depends only on its own gradient and state); if it looks at whole tensors, the result differs "
                      f"from unpartitioned training", stacklevel=4)


def _optimizer_defaults(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None, client: ClientRule | None) -> dict:
    """The hyperparameters of every param group: a client optimizer's (`client`, from
    `client_step`), or Adam's from the optimizer passed or the config's `optimizer` section."""
    if optimizer is not None:
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            _check_elementwise(optimizer)
            return dict(optimizer.defaults)
        d = optimizer.defaults
        if d.get("amsgrad"):
            raise ValueError("amsgrad is not supported by zero's partitioned Adam")
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
        return dict(lr=d["lr"], betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"],
                    bias_correction=True, adamw_mode=adamw)
    if cfg.optimizer is None:
        raise ValueError("no optimizer: add an 'optimizer' section to the config or pass initialize(optimizer=...)")
    if client is not None:
        return client.defaults
    p = cfg.optimizer.params
    return dict(lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay,
                bias_correction=p.bias_correction, adamw_mode=cfg.optimizer.adamw)

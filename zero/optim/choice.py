"""Which optimizer the engine runs and over which param groups: zero's Adam/AdamW, or another
element-wise optimizer on the shards (see [Note: other optimizers on shards])."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from zero.config import ZeroConfig


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
_WHOLE_TENSOR = {"LBFGS": "its line search needs the whole model in one closure",
                 "Adafactor": "its factored second moments need whole matrices",
                 "SparseAdam": "it takes sparse gradients",
                 "Lamb": "its trust ratio needs each parameter's whole norm", "LARS": "its trust ratio needs each "
                 "parameter's whole norm", "Shampoo": "its preconditioners need whole matrices"}


class ClientStep:
    """The update of a client optimizer class on this rank's shards (see [Note: other optimizers on
    shards]): it steps on the fp32 master pieces, as parameters sharing their storage, with its
    state sized like the shards. Built once, from the first step's slots.

    Args:
        cls: the torch optimizer class.
        defaults: its constructor's keyword arguments (a torch optimizer's `defaults`).
    """

    def __init__(self, cls: type, defaults: dict):
        self.cls, self.defaults = cls, defaults
        self._optimizer = None
        self._params: list[nn.Parameter] = []
        self._groups: list[int] = []

    def hyperparameters(self, group: dict) -> dict:
        """A zero param group's hyperparameters for the client optimizer: without the Adam keys
        every group carries (unless the client optimizer has them too)."""
        from zero.optim.step import ADAM_DEFAULTS

        return {k: v for k, v in group.items() if k != "params" and (k not in ADAM_DEFAULTS or k in self.defaults)}

    def _native_settings(self, param_groups: list[dict], slots: list) -> list[dict] | None:
        """Lion and Adagrad on host masters run zero's native CPU kernels (zero/ops/cpu_optim.py)
        on the slots' own fp32 state (Lion's momentum in exp_avg, Adagrad's sum in exp_avg_sq), as
        DeepSpeed's offload runs its CPU Lion and Adagrad: each slot's settings, checked, or None
        where the class itself must run (another class, maximize, a state elsewhere, a value the
        kernels do not take), decided before anything changes."""
        from zero.optim.lion import Lion

        if self.cls not in (Lion, torch.optim.Adagrad):
            return None
        out = []
        for gi, master, _, exp_avg, exp_avg_sq, _ in slots:
            h = {**self.defaults, **self.hyperparameters(param_groups[gi])}
            state = exp_avg if self.cls is Lion else exp_avg_sq
            numbers = [h["lr"], h["weight_decay"], *([h["eps"], h["lr_decay"]] if self.cls is not Lion else [])]
            if (h.get("maximize") or h.get("differentiable") or h.get("fused") or master.device.type != "cpu"
                    or state.dtype != torch.float32 or state.numel() != master.numel()
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in numbers)):
                return None
            out.append(h)
        return out

    def _native_step(self, settings: list[dict], slots: list, grad_scale: float, num_threads: int | None) -> None:
        from zero.ops.cpu_optim import adagrad_step, lion_step

        step = getattr(self, "_steps", 0) + 1
        for h, (_, master, grad, exp_avg, exp_avg_sq, out16) in zip(settings, slots):
            target = out16 if out16 is not None and out16.device.type == "cpu" and out16.dtype != torch.float32 \
                else None
            if self.cls is torch.optim.Adagrad:
                if step == 1 and h["initial_accumulator_value"]:
                    exp_avg_sq.fill_(h["initial_accumulator_value"])
                clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
                adagrad_step(master, grad, exp_avg_sq, clr=clr, eps=h["eps"], weight_decay=h["weight_decay"],
                             grad_scale=grad_scale, out16=target, num_threads=num_threads)
            else:
                lion_step(master, grad, exp_avg, lr=h["lr"], betas=tuple(h["betas"]), weight_decay=h["weight_decay"],
                          grad_scale=grad_scale, out16=target, num_threads=num_threads)
            if out16 is not None and target is None:  # a device parameter: one copy per slot
                out16.copy_(master)
        self._steps = step

    @torch.no_grad()
    def step(self, param_groups: list[dict], slots: list, grad_scale: float, num_threads: int | None = None) -> None:
        """One step of the client optimizer on `slots` (see ShardedAdam.slots), gradients divided by
        `grad_scale` (see [Note: one divisor]); the 16-bit outputs are written from the masters.
        `num_threads`: the host threads of the native kernels (optimizer offload's)."""
        settings = self._native_settings(param_groups, slots) if self._optimizer is None else None
        if settings is None and getattr(self, "_steps", 0):
            raise ValueError(f"{self.cls.__name__}: a param group now asks for what zero's native host step does not do "
                             f"(maximize, differentiable, fused, or a non-number setting), after steps that kept the "
                             f"state in zero's own tensors; set it before the first step")
        if settings is not None:
            self._native_step(settings, slots, grad_scale, num_threads)
            return
        if self._optimizer is None:
            by_group: dict[int, list] = {}
            for gi, master, *_ in slots:
                p = nn.Parameter(master, requires_grad=False)  # shares the master's storage
                by_group.setdefault(gi, []).append(p)
                self._params.append(p)
            self._groups = list(by_group)
            groups = [{**self.hyperparameters(param_groups[gi]), "params": ps} for gi, ps in by_group.items()]
            self._optimizer = self.cls(groups, **self.defaults)  # torch optimizers' defaults are their
            # constructor's keyword arguments
        for group, gi in zip(self._optimizer.param_groups, self._groups):  # the scheduler's lr, etc.
            group.update(self.hyperparameters(param_groups[gi]))
        for p, (_, _, grad, _, _, _) in zip(self._params, slots):
            p.grad = grad.float() / grad_scale
        self._optimizer.step()
        for p, (_, master, _, _, _, out16) in zip(self._params, slots):
            p.grad = None
            if out16 is not None:
                out16.copy_(master)


def optimizer_groups(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None, module: nn.Module,
                     model_parameters) -> tuple[ClientStep | None, list[dict], bool]:
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


def client_step(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None) -> ClientStep | None:
    """The client optimizer to run on the shards instead of zero's Adam, or None for Adam/AdamW.
    See [Note: other optimizers on shards]."""
    if optimizer is not None:
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return None
        return ClientStep(type(optimizer), dict(optimizer.defaults))
    from zero.config.optimizer import CLIENT_OPTIMIZERS, optimizer_class

    if cfg.optimizer is not None and cfg.optimizer.type in CLIENT_OPTIMIZERS:
        cls = optimizer_class(cfg.optimizer.type)
        return ClientStep(cls, dict(cls([torch.nn.Parameter(torch.zeros(1))], **cfg.optimizer.other_params).defaults))
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


def _optimizer_defaults(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None, client: ClientStep | None) -> dict:
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


def client_state_dtype(optimizer, cfg: ZeroConfig) -> str | None:
    """The moments' format a client optimizer object asks for, or None: DeepSpeedCPUAdam's
    `fp32_optimizer_states=False` means the training dtype, as in DeepSpeed."""
    from zero.config.errors import ConfigError
    from zero.stages.policies import adam_format

    if getattr(optimizer, "zero_state_dtype", None) != "model":
        return None
    if cfg.precision == "fp16":
        raise ConfigError("DeepSpeedCPUAdam(fp32_optimizer_states=False) under fp16: zero keeps Adam's moments as "
                          "fp32, bf16 or 8-bit codes, not fp16; train with bf16, or set optimizer.params.state_dtype")
    configured = adam_format(cfg).state
    if configured not in ("fp32", cfg.precision):
        raise ConfigError(f"DeepSpeedCPUAdam(fp32_optimizer_states=False) keeps the moments in the training dtype "
                          f"({cfg.precision}), but the config asks for {configured!r} moments "
                          f"(optimizer.params.state_dtype / bf16.bf16_optimizer_states): keep one of the two")
    return cfg.precision

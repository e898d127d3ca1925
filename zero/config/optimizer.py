"""The `optimizer` section: which optimizer the engine builds, and its parameters (Adam's, the
client optimizers' own, OneBitAdam's and ZeroOneAdam's), checked key by key."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from pydantic import Field, field_validator, model_validator

from zero.config.errors import _fmt
from zero.config.features import with_placeholders
from zero.config.sections import _lr, _Section
from zero.optim.choice import CLIENT_OPTIMIZERS, optimizer_class  # params: their own constructor's

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Lion", "Muon", "OneBitAdam", "ZeroOneAdam")
_LAMB = ("LAMB's trust ratio needs each parameter's whole norm, which a shard does not have; use AdamW (its "
         "large-batch recipes train with AdamW and warmup too) or OneBitAdam for compressed communication")
NOT_ON_SHARDS = {"Lamb": _LAMB, "OneBitLamb": _LAMB}


@with_placeholders("optimizer.params")
class AdamParams(_Section):
    """`optimizer.params` for Adam/AdamW (DeepSpeed FusedAdam / DeepSpeedCPUAdam defaults)."""

    lr: float = Field(1e-3, ge=0, allow_inf_nan=False, description="Learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="(beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, ge=0, allow_inf_nan=False, description="Added to the denominator.")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False,
                                description="Weight decay; decoupled (AdamW) unless adam_w_mode is false.")
    bias_correction: bool = Field(True, description="Apply Adam's bias correction to m and v.")
    adam_w_mode: bool = Field(True, description="Decoupled weight decay (AdamW). DeepSpeed's default is "
                              "true, so type Adam means AdamW unless this is set to false.")
    amsgrad: bool = Field(False, description="Not supported (DeepSpeed's fused Adam rejects it too).")
    state_dtype: Optional[str] = Field(
        None, description="zero's key: how Adam's moments are stored: 'fp32' (default), 'bf16' (what "
        "bf16.bf16_optimizer_states sets) or 'int8' (8-bit codes with one fp32 scale per 256 elements, 2.03 "
        "bytes per parameter for both moments); see docs/config.md, 'State formats'.")
    freeze_step: Optional[int] = Field(None, ge=1, description="OneBitAdam: steps of exact Adam before the variance "
                                       "freezes and gradients are exchanged 1-bit compressed (default 100000; at "
                                       "least 1: the variance must have a value to freeze).")
    compress_param_gather: Optional[bool] = Field(
        None, description="OneBitAdam at ZeRO stages 1 and 2 (zero's own key): after freeze_step, all-gather "
        "each owner's parameter change 1-bit compressed instead of the updated 16-bit parameters (see "
        "[Note: compressed parameter gather]; default false).")
    var_freeze_step: Optional[int] = Field(None, ge=1, description="ZeroOneAdam: the last step at which the "
                                           "variance may be updated (default 100000).")
    var_update_scaler: Optional[int] = Field(None, ge=1, description="ZeroOneAdam: variance updates between "
                                             "doublings of their interval (default 16).")
    local_step_scaler: Optional[int] = Field(None, ge=1, description="ZeroOneAdam: steps after var_freeze_step "
                                             "between doublings of the interval between syncs (default 32678).")
    local_step_clipper: Optional[int] = Field(None, ge=1, description="ZeroOneAdam: the longest interval between "
                                              "syncs, in steps (default 16).")

    @model_validator(mode="before")
    @classmethod
    def _max_grad_norm(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_grad_norm" in data:
            raise ValueError("'max_grad_norm' is not an optimizer parameter; use the top-level "
                             "'gradient_clipping' key (as DeepSpeed requires)")
        return data

    _check_lr = field_validator("lr")(_lr)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v: Any) -> Any:
        ok = (isinstance(v, (list, tuple)) and len(v) == 2
              and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v))
        if not ok:
            raise ValueError(f"expected a pair [beta1, beta2] with 0 <= beta < 1, got {_fmt(v)}")
        return tuple(float(b) for b in v)

    @field_validator("state_dtype", mode="before")
    @classmethod
    def _state_dtype(cls, v: Any) -> Any:
        if v is None:
            return v
        names = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "int8": "int8", "8bit": "int8"}
        if not isinstance(v, str) or v.lower() not in names:
            raise ValueError(f"expected 'fp32', 'bf16' or 'int8' (how Adam's moments are stored), got {_fmt(v)}")
        return names[v.lower()]

    @field_validator("amsgrad")
    @classmethod
    def _amsgrad(cls, v: bool) -> bool:
        if v:
            raise ValueError("amsgrad is not supported; remove it or set it to false")
        return v


def _client_params(kind: str, params: Any) -> dict:
    """Check `params` against the optimizer's constructor: names, and finite non-negative lr."""
    import inspect

    if not isinstance(params, dict):
        raise ValueError(f"optimizer.params must be an object for {kind}, got {type(params).__name__}")
    if "state_dtype" in params:
        raise ValueError(f"optimizer.params.state_dtype: {kind} has no Adam moments to store in low precision; "
                         f"state formats apply to Adam and AdamW")
    cls = optimizer_class(kind)
    accepted = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"unknown {kind} parameter(s) {unknown}; {kind} takes {accepted}")
    lr = params.get("lr", 1e-3)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"optimizer.params.lr must be a finite number >= 0, got {lr!r}")
    return dict(params)


ONEBIT_KEYS = ("freeze_step", "comm_backend_name", "cuda_aware", "compress_param_gather")
ZEROONE_KEYS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")


@dataclasses.dataclass(frozen=True)
class ZeroOne:
    """ZeroOneAdam's settings, from `optimizer.params`."""

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int


@dataclasses.dataclass(frozen=True)
class OneBit:
    """OneBitAdam's settings, from `optimizer.params`."""

    freeze_step: int
    compress_param_gather: bool = False


@with_placeholders("optimizer")
class OptimizerConfig(_Section):
    """`optimizer`: which optimizer the engine builds when the caller passes none."""

    type: str = Field(..., description="Adam, AdamW, SGD, Adagrad, Lion, Muon, OneBitAdam or ZeroOneAdam "
                      "(case-insensitive).")
    params: AdamParams = Field(default_factory=AdamParams, description="Constructor arguments.")
    other_params: dict[str, Any] = Field(default_factory=dict, description="For SGD, Adagrad and Lion: their "
                                         "constructor arguments; for Muon: its keys (written as `params`).")

    @model_validator(mode="before")
    @classmethod
    def _misplaced(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str):
            known = {n.lower() for n in (*SUPPORTED_OPTIMIZERS, *CLIENT_OPTIMIZERS, "muon")}
            if data["type"].lower() not in known:  # refused by type: its params would only add noise
                data = {k: v for k, v in data.items() if k != "params"}
            kind = next((n for n in CLIENT_OPTIMIZERS if n.lower() == data["type"].lower()), None)
            if kind is not None:  # its own constructor's arguments, checked against it
                data = {**data, "type": kind, "other_params": _client_params(kind, data.get("params") or {})}
                data.pop("params", None)
            elif data["type"].lower() == "muon":  # DeepSpeed's keys, routed to its two halves (zero/optim/muon.py)
                from zero.optim.muon import route

                params = data.get("params") or {}
                if not isinstance(params, dict):
                    raise ValueError(f"optimizer.params must be an object for Muon, got {type(params).__name__}")
                route(params)
                data = {**data, "type": "Muon", "other_params": dict(params)}
                data.pop("params", None)
        if isinstance(data, dict):
            for key in ("adam_w_mode", "torch_adam", "lr", "betas", "eps", "weight_decay"):
                if key in data:
                    raise ValueError(f"'{key}' belongs inside optimizer.params, not optimizer")
        return data

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        for name, why in NOT_ON_SHARDS.items():
            if v.lower() == name.lower():
                raise ValueError(f"optimizer type {v!r} cannot run on ZeRO's partitioned shards: {why}")
        for name in SUPPORTED_OPTIMIZERS:
            if v.lower() == name.lower():
                return name
        raise ValueError(f"optimizer type {v!r} is not supported; supported types: "
                         f"{', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive), or pass your own "
                         f"torch optimizer to initialize()")

    @property
    def adamw(self) -> bool:
        """True when weight decay is decoupled: type AdamW, or Adam with adam_w_mode (DeepSpeed rule)."""
        return self.type == "AdamW" or self.params.adam_w_mode

    @model_validator(mode="after")
    def _onebit_only(self) -> OptimizerConfig:
        own = {"OneBitAdam": ONEBIT_KEYS,
               "ZeroOneAdam": ZEROONE_KEYS + ("comm_backend_name", "cuda_aware")}.get(self.type, ())
        for key in ONEBIT_KEYS + ZEROONE_KEYS:
            if key not in own and getattr(self.params, key) is not None:
                whose = "a ZeroOneAdam" if key in ZEROONE_KEYS else "a OneBitAdam"
                raise ValueError(f"params.{key} is {whose} parameter, not one of {self.type}'s")
        return self

    @property
    def zeroone(self) -> ZeroOne | None:
        """ZeroOneAdam's settings (None for any other type)."""
        if self.type != "ZeroOneAdam":
            return None
        p = self.params
        pick = lambda v, default: default if v is None else v
        return ZeroOne(var_freeze_step=pick(p.var_freeze_step, 100_000), var_update_scaler=pick(p.var_update_scaler, 16),
                       local_step_scaler=pick(p.local_step_scaler, 32678),
                       local_step_clipper=pick(p.local_step_clipper, 16))

    @property
    def onebit(self) -> OneBit | None:
        """OneBitAdam's settings (None for any other type)."""
        if self.type != "OneBitAdam":
            return None
        freeze = self.params.freeze_step
        return OneBit(freeze_step=100_000 if freeze is None else freeze,
                      compress_param_gather=bool(self.params.compress_param_gather))

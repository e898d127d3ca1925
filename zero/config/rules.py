"""Rules that combine settings: keys of several sections, or the config and what the caller passes
to `zero.initialize` (the model, an optimizer object). `ZeroConfig`'s validator applies them, so
`load_config` raises them, and `zero.initialize` does before it builds a mesh or an engine or
slices a model.

[Note: rules that combine settings]
A rule one key breaks alone lives in that field's validator; a rule between keys of one section in
that section's validator (`PipelineConfig._fits`); a rule across sections, or between the config and
the caller's objects, here. What the caller knows besides the config (`Caller`) reaches validation
through pydantic's validation context, which `load_config` fills from its arguments. Where a fact is
not known (None: `zero.tp.mesh` and `zero.estimate` load a config without a model or an optimizer)
the rules that need it are skipped. Every rule reports (key path, message) pairs, so one
`ConfigError` lists every problem, each naming the key to change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from zero.config.errors import ConfigError, _raise

if TYPE_CHECKING:
    from zero.config.model import ZeroConfig

Issues = list[tuple[tuple, str]]


@dataclass(frozen=True)
class Caller:
    """What the caller of `load_config` knows besides the config; None where it does not know.

    Args:
        pipeline_stages: the model's own stage count (a `PipelineModule`'s num_stages).
        model_is_pipeline: whether the model is a `zero.pipe.PipelineModule`.
        client_optimizer: the class of the optimizer object passed to `zero.initialize`
            (None: none was passed, or it is not known yet).
    """

    pipeline_stages: Optional[int] = None
    model_is_pipeline: Optional[bool] = None
    client_optimizer: Optional[type] = None


def combination_issues(cfg: ZeroConfig, caller: Caller) -> Issues:
    """Every broken rule of [Note: rules that combine settings], as (key path, message) pairs."""
    return (_onebit_and_stage(cfg) + _pipeline_and_model(cfg, caller) + _optimizer_object(cfg, caller)
            + _state_formats(cfg, caller) + _muon(cfg, caller))


def check_optimizer_object(cfg: ZeroConfig, client_optimizer: type) -> None:
    """The rules about an optimizer object, for one built after `load_config` (a callable passed
    as `zero.initialize(optimizer=...)` is called once the model is sliced): the same
    `ConfigError`, naming the key, that `load_config(..., client_optimizer=)` raises.

    Args:
        cfg: the loaded config.
        client_optimizer: the optimizer object's class, `type(optimizer)`.
    """
    issues = _optimizer_object(cfg, Caller(client_optimizer=client_optimizer))
    if issues:
        _raise(issues)


def _offloaded(cfg: ZeroConfig) -> bool:
    off = cfg.zero_optimization.offload_optimizer
    return off is not None and off.device != "none"


def _onebit_and_stage(cfg: ZeroConfig) -> Issues:
    """OneBitAdam and ZeroOneAdam against the ZeRO stage and optimizer offload (see docs/onebit.md)."""
    kind = cfg.optimizer.type if cfg.optimizer is not None else None
    stage = cfg.zero_optimization.stage
    issues: Issues = []
    if kind == "ZeroOneAdam":
        if stage != 0:
            issues.append((("zero_optimization", "stage"), f"optimizer type ZeroOneAdam needs ZeRO stage 0, not "
                           f"{stage}: its local steps update every parameter on every rank, while stages 1-3 give "
                           f"each rank its shard of the optimizer state alone; set zero_optimization.stage to 0 (or "
                           f"use OneBitAdam at stages 1 and 2; see docs/onebit.md)"))
        if _offloaded(cfg):
            issues.append((("zero_optimization", "offload_optimizer"), "optimizer type ZeroOneAdam with "
                           "offload_optimizer is not supported: its local steps run on the device; remove "
                           "zero_optimization.offload_optimizer"))
    if kind in ("OneBitAdam", "ZeroOneAdam") and cfg.zero_optimization.mics_shard_size != -1:
        issues.append((("zero_optimization", "mics_shard_size"), f"with optimizer type {kind} is not supported: its "
                       f"compressed exchange runs over every data-parallel rank, not shard groups and their replicas; "
                       f"remove zero_optimization.mics_shard_size"))
    if kind == "OneBitAdam":
        opt = cfg.zero_optimization.offload_optimizer
        if opt is not None and opt.device == "nvme":
            issues.append((("zero_optimization", "offload_optimizer", "device"), "'nvme' with optimizer type "
                           "OneBitAdam is not supported (1-bit Adam's optimizer does not stream its state from "
                           "swap files); use device 'cpu'"))
        if stage == 3:
            issues.append((("zero_optimization", "stage"), "optimizer type OneBitAdam needs ZeRO stage 0, 1 or 2, "
                           "not 3: under stage 3 the gradient reduction is per unit of gathered parameters, and its "
                           "compressed exchange is not implemented; set zero_optimization.stage to 0, 1 or 2 (see "
                           "docs/onebit.md)"))
        if cfg.optimizer.params.compress_param_gather and stage == 0:
            issues.append((("optimizer", "params", "compress_param_gather"), "is true at ZeRO stage 0, but "
                           "compress_param_gather applies to ZeRO stages 1 and 2: stage 0 has no parameter all-gather "
                           "(every rank updates every parameter, and its gradient exchange is already compressed both "
                           "ways); remove the key or set zero_optimization.stage to 1 or 2"))
    return issues


def _pipeline_and_model(cfg: ZeroConfig, caller: Caller) -> Issues:
    """A pipeline needs a PipelineModule, and does not go with ZeRO stage 3."""
    stages = cfg.pipeline.stages or caller.pipeline_stages or 1
    pipelined = caller.model_is_pipeline if caller.model_is_pipeline is not None else stages > 1
    issues: Issues = []
    if caller.model_is_pipeline is False and stages > 1:
        issues.append((("pipeline", "stages"), f"is {stages}: the model must be a zero.pipe.PipelineModule (a list "
                       f"of layers each stage builds its own part of); build the model as one, or leave "
                       f"pipeline.stages out"))
    if pipelined and cfg.zero_optimization.stage == 3:
        issues.append((("zero_optimization", "stage"), "is 3: ZeRO stage 3 with a pipeline is not supported: each "
                       "stage would gather its parameters again for every micro-batch's forward and backward (M times "
                       "a step). Use stage 1 or 2, which partition optimizer states and gradients over the "
                       "data-parallel ranks of each stage"))
    return issues


def _optimizer_object(cfg: ZeroConfig, caller: Caller) -> Issues:
    """The optimizer that runs: an object passed to initialize wins over the config's `optimizer`,
    except zero's own 1-bit optimizers, which cannot take one. (Optimizer offload steps any of the
    others on the host: zero's CPU Adam, Muon, or the client optimizer's own update.)"""
    given = caller.client_optimizer
    kind = cfg.optimizer.type if cfg.optimizer is not None else None
    issues: Issues = []
    if given is not None and kind in ("OneBitAdam", "ZeroOneAdam"):
        issues.append((("optimizer", "type"), f"the config's optimizer is {kind} but initialize() was given a "
                       f"{given.__name__} too: it is zero's own optimizer; drop one of them"))
    return issues


def _muon(cfg: ZeroConfig, caller: Caller) -> Issues:
    """Muon (config type, or a client torch.optim.Muon) where zero runs it: see docs/muon.md."""
    import torch

    given = caller.client_optimizer
    if not (given is not None and issubclass(given, torch.optim.Muon)
            or given is None and cfg.optimizer is not None and cfg.optimizer.type == "Muon"):
        return []
    what, issues = "Muon" if given is None else "a client torch.optim.Muon", []
    if cfg.tensor_parallel.size > 1:
        issues.append((("tensor_parallel", "size"), f"{what} orthogonalises whole matrices, and tensor slicing "
                       f"gives each rank a slice of each: use tensor_parallel.size 1 (pipeline stages are fine)"))
    return issues


def _state_formats(cfg: ZeroConfig, caller: Caller) -> Issues:
    """bf16 master weights and low-precision Adam moments (see docs/config.md, 'State formats'):
    the bf16 keys need bf16 training, and the formats need an optimizer with Adam's moments."""
    import torch

    b, issues = cfg.bf16, []
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if getattr(b, key) and not b.enabled:
            why = ("fp16 training keeps its master weights and moments in fp32 (a bf16 master cannot hold fp16's "
                   "loss-scaled range of updates)" if cfg.fp16.enabled else "it applies to bf16 training only")
            issues.append((("bf16", key), f"is true but bf16.enabled is not: {why}. Enable bf16, or set "
                           f"optimizer.params.state_dtype for the moments alone"))
    kind = cfg.optimizer.type if cfg.optimizer is not None else None
    state = cfg.optimizer.params.state_dtype if kind in ("Adam", "AdamW", "OneBitAdam", "ZeroOneAdam") else None
    if b.bf16_optimizer_states and state not in (None, "bf16"):
        issues.append((("optimizer", "params", "state_dtype"), f"is {state!r} but bf16.bf16_optimizer_states asks "
                       f"for bf16 moments: keep one of the two"))
    bf16_stored = b.enabled and (b.bf16_master_weights_and_grads or b.bf16_optimizer_states) or state == "bf16"
    if b.stochastic_rounding is not None and not bf16_stored:
        issues.append((("bf16", "stochastic_rounding"), "is set, but nothing is stored in bf16 (no bf16 master, no "
                       "bf16 moments; 8-bit moments always round to nearest), so it would have no effect: remove it"))
    given = caller.client_optimizer
    if given is not None and not issubclass(given, (torch.optim.Adam, torch.optim.AdamW)):
        other = given.__name__
    else:
        other = kind if given is None and kind not in ("Adam", "AdamW", None) else None
    if other is None:
        return issues
    why = (f"{other} keeps its own fp32 states (its compressed exchange needs them)" if other in
           ("OneBitAdam", "ZeroOneAdam") else f"{other} has no Adam moments and keeps an fp32 master")
    if state not in (None, "fp32"):
        issues.append((("optimizer", "params", "state_dtype"), f"is {state!r}, but {why}: low-precision state "
                       f"formats are for zero's Adam/AdamW"))
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if getattr(b, key):
            issues.append((("bf16", key), f"is true, but {why}: low-precision state formats are for zero's "
                           f"Adam/AdamW"))
    return issues


def client_state_dtype(optimizer, cfg: ZeroConfig) -> str | None:
    """The moments' format a client optimizer object asks for, or None: DeepSpeedCPUAdam's
    `fp32_optimizer_states=False` means the training dtype, as in DeepSpeed."""

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

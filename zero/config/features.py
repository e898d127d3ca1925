"""The DeepSpeed keys `zero` accepts but does not read: each refused or warned about, with its
reason, and each given its pydantic field here, from its row."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, TypeVar

from pydantic import BaseModel, Field, create_model

from zero.config.errors import _raise, _warn

if TYPE_CHECKING:
    from zero.config.model import ZeroConfig

# ---------------------------------------------------------------------------------------------
# [Note: what zero does with a DeepSpeed key]
# Every key `zero` accepts is one of three kinds; none is accepted and silently ignored.
#
# - READ: it changes what zero does. These are the typed fields of the section models, and code
#   outside zero/config/ reads them (tests/test_config.py::test_every_key_is_read_refused_or_warned
#   checks this in the source, not against a list). A value zero cannot honour is refused by that
#   field's validator, with the key's path (offload `device: "nvme"`, an unknown optimizer type);
#   a key whose only accepted value is its default (`offload_optimizer.ratio`, `amsgrad`) is not
#   read, just refused when set otherwise. A READ key that cannot matter in some combination of
#   settings warns from `ZeroOptimizationConfig`'s validator (`offload_param` below stage 3,
#   `sub_group_size` without optimizer offload, `pin_memory` with `device: "none"`); settings that
#   cannot go together are refused by `ZeroConfig`'s (see [Note: rules that combine settings] in
#   zero/config/rules.py).
# - REFUSED: zero does not implement it and setting it would change what training computes:
#   a `ConfigError`.
# - WARNED: zero does not implement it and results are unaffected (logging, monitoring,
#   profiling, DeepSpeed's own memory and speed knobs, training checkpoints): a `ConfigWarning`.
#
# REFUSED and WARNED keys are the rows of `UNIMPLEMENTED_FEATURES`, one row per key, and nowhere
# else: a row holds the key's reason and its field (type, default, description), and the section
# models get their placeholder fields from the rows (`with_placeholders`). A row fires only when the
# key is set to a value that would matter: by default, a value other than DeepSpeed's default, so
# a config that spells out the defaults loads quietly. `load_config` checks the table after
# validation, before any model or process group is touched. docs/config.md reproduces the table
# (a test compares them row by row).
# ---------------------------------------------------------------------------------------------

Predicate = Callable[[Any], bool]
RawSection = Optional[dict[str, Any]]  # a DeepSpeed section we do not model: its sub-keys are DeepSpeed's


@dataclass(frozen=True)
class Placeholder:
    """The pydantic field an unimplemented key gets: DeepSpeed's type and default, and a description.

    `raw`: the key lies inside a DeepSpeed section zero does not model (`amp.enabled`); the field
    is that whole section, at the root, typed `RawSection`.
    """

    annotation: Any
    default: Any
    description: str
    constraints: dict[str, Any] = field(default_factory=dict)
    raw: bool = False


def _flag(default: bool, description: str) -> Placeholder:
    return Placeholder(bool, default, description)


def _key(annotation: Any, default: Any, description: str, **constraints: Any) -> Placeholder:
    return Placeholder(annotation, default, description, constraints)


def _raw(description: str) -> Placeholder:
    return Placeholder(RawSection, None, description, raw=True)


@dataclass(frozen=True)
class UnimplementedFeature:
    """One DeepSpeed key that `zero` does not read. See [Note: what zero does with a DeepSpeed key].

    Args:
        path: the key's dotted path, in DeepSpeed's spelling.
        kind: "error" if setting it would change results (refused), "warning" if not (warned).
        reason: what zero does instead, or what to use; ends the message.
        is_set: whether a value counts as set. None: it differs from the field's default. Given
            for keys inside raw DeepSpeed sections (no model, so no default) and where only some
            non-default values matter (`zero_hpz_partition_size` > 1).
        placeholder: the field that accepts the key (see `with_placeholders`).
    """

    path: str
    kind: Literal["error", "warning"]
    reason: str
    is_set: Optional[Predicate] = None
    placeholder: Optional[Placeholder] = None

    @property
    def field_at(self) -> tuple[str, str]:
        """(dotted path of the section, key) where the placeholder field goes; "" is the root."""
        if self.placeholder is not None and self.placeholder.raw:
            return "", self.path.split(".")[0]
        section, _, key = self.path.rpartition(".")
        return section, key


def _refused(path: str, placeholder: Placeholder, reason: str, is_set: Optional[Predicate] = None
             ) -> UnimplementedFeature:
    return UnimplementedFeature(path, "error", reason, is_set, placeholder)


def _warned(path: str, placeholder: Placeholder, reason: str, is_set: Optional[Predicate] = None
            ) -> UnimplementedFeature:
    return UnimplementedFeature(path, "warning", reason, is_set, placeholder)


def _present(section: Any) -> bool:
    return bool(section)


def _any_enabled(section: Any) -> bool:
    """Sections such as compression_training nest `enabled` flags several levels deep."""
    if isinstance(section, dict):
        return any(v is True if k == "enabled" else _any_enabled(v) for k, v in section.items())
    return False


def _any_true(section: Any) -> bool:
    """Any option switched on or given a number: all-false/null sections (DeepSpeed's defaults) are quiet."""
    if isinstance(section, dict):
        return any(_any_true(v) for v in section.values())
    return bool(section)


def _above(limit: int) -> Predicate:
    return lambda v: int(v) > limit


def _other_than(value: Any) -> Predicate:
    return lambda v: v != value


_NO_CHECKPOINTS = "zero's training checkpoints do not use it (see docs/checkpoint.md)"
_NOT_MONITORED = ("zero writes DeepSpeed's events to csv_monitor and tensorboard, not to this service; "
                  "log from your training loop")
_MONITORING = _raw("Monitoring (ignored with a warning).")

UNIMPLEMENTED_FEATURES: tuple[UnimplementedFeature, ...] = (
    # --- changes the math or the training procedure: ConfigError ---------------------------------
    _refused("amp.enabled", _raw("NVIDIA Apex AMP (not implemented)."), "Apex AMP; use fp16 or bf16", bool),
    _refused("torch_autocast.enabled", _raw("torch.autocast mixed precision (not implemented)."),
             "torch.autocast mixed precision; use fp16 or bf16", bool),
    _refused("sparse_gradients", _flag(False, "CSR gradients for embeddings (not implemented)."),
             "gradients are always dense"),
    _refused("sparse_attention", _raw("Sparse attention (not implemented)."),
             "sparse attention is a model layer in zero (zero.sparse_attention.SparseSelfAttention with a "
             "SparsityConfig; docs/sparse_attention.md), not a config section", _present),
    _refused("progressive_layer_drop.enabled", _raw("Not implemented."), "layers would be skipped during training",
             bool),
    _refused("curriculum_learning.enabled", _raw("Not implemented."),
             "the data order and sequence lengths would change", bool),
    _refused("data_efficiency.enabled", _raw("Not implemented."), "data sampling and routing would change", bool),
    _refused("compression_training", _raw("Not implemented."), "compression changes the weights or activations",
             _any_enabled),
    _refused("quantize_training.enabled", _raw("MoQ (not implemented)."), "MoQ quantizes the weights during training",
             bool),
    _refused("eigenvalue.enabled", _raw("Not implemented."), "the eigenvalue schedule of MoQ", bool),
    _refused("hybrid_engine.enabled", _raw("Not implemented."), "the RLHF hybrid engine", bool),
    _refused("weight_quantization", _raw("Not implemented."), "quantized weights", _present),
    _refused("compile.deepcompile", _raw("DeepCompile (not implemented); zero's compile.enabled, backend and kwargs "
                                         "compile each block with zero's hooks outside the graphs."),
             "DeepCompile; set compile.enabled (or call engine.compile()), which compiles each block with zero's "
             "hooks outside the graphs", bool),
    _refused("nebula.enabled", _raw("Nebula checkpoint service (not implemented)."),
             "checkpoints would not go where you expect", bool),
    _refused("datastates.enabled", _raw("DataStates checkpointing (not implemented)."),
             "checkpoints would not go where you expect", bool),
    _refused("use_data_before_expert_parallelism", _flag(False, "MoE topology (not implemented)."),
             "zero has no expert parallelism"),
    _refused("managed_gradient_accumulation",
             _flag(True, "Engine tracks accumulation boundaries (false is not implemented)."),
             "zero always tracks the accumulation boundary itself"),
    _refused("gradient_allreduce_op",
             _key(Literal["mean", "sum"], "mean", "Average or sum grads across ranks ('sum' not implemented)."),
             "gradients are always averaged across ranks"),
    _refused("data_types.grad_accum_dtype",
             _key(Optional[str], None, "Gradient accumulation dtype: zero accumulates micro-batches in fp32, so "
                  "\"fp32\" (OpenRLHF's and Megatron-DeepSpeed's choice under bf16) is accepted; another dtype "
                  "is refused."),
             "zero accumulates gradients over micro-batches in fp32 (set \"fp32\" or leave it out)",
             lambda v: v is not None and str(v).lower() not in ("fp32", "float32", "float", "torch.float32")),
    _refused("seq_parallel_communication_data_type",
             _key(Optional[str], "fp32", "DeepSpeed: the dtype of sequence-parallel gradient reductions; zero reduces "
                  "every gradient in communication_data_type (other than \"fp32\": refused)."),
             "zero reduces every gradient, sequence-parallel ranks' included, in communication_data_type: set that "
             "instead", lambda v: v is not None and str(v).lower() not in ("fp32", "float32", "float", "torch.float32")),
    _refused("checkpoint.load_universal", _flag(False, "Load a DeepSpeed universal checkpoint (not implemented)."),
             "zero cannot read DeepSpeed's universal checkpoints"),
    _refused("fp16.fp16_master_weights_and_grads", _flag(False, "Keep master weights in fp16 (not implemented)."),
             "master weights and their gradients are fp32"),
    _refused("zero_optimization.legacy_stage1", _flag(False, "DeepSpeed's old stage 1 (not implemented)."),
             "DeepSpeed's old stage-1 code; use stage 1"),
    _refused("zero_optimization.zeropp_loco_param",
             _key(Optional[dict[str, Any]], None, "LoCo-ZeRO++ (not implemented)."), "LoCo-ZeRO++ error feedback"),
    _refused("zero_optimization.zenflow", _key(Optional[dict[str, Any]], None, "ZenFlow (not implemented)."),
             "ZenFlow's asynchronous updates"),
    _refused("zero_optimization.offload_optimizer.super_offload",
             _flag(False, "DeepSpeed SuperOffload (not implemented)."), "SuperOffload"),
    # --- logging, monitoring, profiling: ConfigWarning --------------------------------------------
    _warned("wandb.enabled", _MONITORING, _NOT_MONITORED, bool),
    _warned("comet.enabled", _MONITORING, _NOT_MONITORED, bool),
    _warned("flops_profiler.enabled", _raw("Profiling (ignored with a warning)."), "use torch.profiler", bool),
    _warned("comms_logger.enabled", _raw("Communication logging (ignored with a warning)."),
            "the engine counts communicated bytes itself", bool),
    _warned("autotuning.enabled", _raw("Autotuner (ignored with a warning)."), "zero has no autotuner", bool),
    _warned("timers", _raw("Throughput timers (ignored with a warning)."),
            "wall_clock_breakdown times forward, backward and step", _any_enabled),
    _warned("activation_checkpointing.contiguous_memory_optimization",
            _flag(False, "DeepSpeed copies checkpoints into one buffer (ignored with a warning)."),
            "zero keeps each checkpoint as its own tensor"),
    _warned("activation_checkpointing.number_checkpoints",
            _key(Optional[int], None, "Sizes DeepSpeed's contiguous buffer (ignored with a warning)."),
            "zero keeps each checkpoint as its own tensor", lambda v: v is not None),
    _warned("activation_checkpointing.synchronize_checkpoint_boundary",
            _flag(False, "A device sync around each checkpoint (ignored with a warning)."),
            "zero does not synchronize around checkpoints"),
    _warned("activation_checkpointing.profile", _flag(False, "Checkpoint timing (ignored with a warning)."),
            "use torch.profiler"),
    _warned("aio.single_submit", _flag(False, "DeepSpeed's libaio submission mode (true warns)."),
            "zero's I/O threads take requests one by one either way"),
    _warned("aio.overlap_events", _flag(True, "DeepSpeed's libaio event overlap (false warns)."),
            "zero's I/O threads always overlap their requests"),
    _warned("aio.use_gds", _flag(False, "GPUDirect Storage (true warns)."),
            "zero has no GPUDirect Storage path: swap files are read into host buffers, as a GPU without GDS does"),
    _warned("graph_harvesting", _flag(False, "CUDA graph harvesting (ignored with a warning)."),
            "zero does not capture CUDA graphs"),
    _warned("vocabulary_size",
            _key(Optional[int], None, "DeepSpeed checks it for tensor-core alignment; no effect in zero "
                 "(set: warns).", gt=0),
            "DeepSpeed only checks it for tensor-core alignment; zero does not"),
    # --- DeepSpeed's own memory and speed knobs: ConfigWarning ------------------------------------
    _warned("disable_allgather", _flag(False, "Legacy DeepSpeed knob; no effect in zero (true warns)."),
            "updated shards are always all-gathered"),
    _warned("zero_allow_untested_optimizer",
            _flag(False, "DeepSpeed: allow a client optimizer it has not tested. zero decides by the optimizer "
                  "itself (true warns)."),
            "zero runs Adam and AdamW with its own kernels, SGD, Adagrad, Lion and any element-wise client "
            "optimizer on the shards (one it does not know with a warning), and refuses one that needs whole "
            "tensors (Lamb, LBFGS, Adafactor, ...), whatever this says"),
    _warned("zero_force_ds_cpu_optimizer",
            _flag(True, "DeepSpeed: with offload, require its CPU Adam. zero always uses its own (false warns)."),
            "with optimizer offload, zero always steps with its own CPU Adam"),
    _warned("optimizer.legacy_fusion",
            _flag(False, "DeepSpeed legacy fp16 optimizer switch; no effect in zero (true warns)."),
            "a switch of DeepSpeed's fp16 optimizer; zero has one fp16 path"),
    _warned("optimizer.params.torch_adam",
            _flag(False, "DeepSpeed: use torch.optim.Adam/AdamW instead of its fused kernel. zero always uses its "
                  "own Adam kernels (true warns)."),
            "the engine always steps with its own Adam kernels"),
    _warned("optimizer.params.comm_backend_name",
            _key(Optional[Literal["nccl", "mpi", "gloo", "compressed", "hccl"]], None,
                 "OneBitAdam and ZeroOneAdam: DeepSpeed's transport for the 1-bit exchange. zero uses the "
                 "torch.distributed process group's backend whatever this says (other than \"nccl\": warns)."),
            "zero's 1-bit exchange always goes through the torch.distributed process group, with that group's "
            "backend (NCCL or gloo)", _other_than("nccl")),
    _warned("optimizer.params.cuda_aware",
            _key(Optional[bool], None, "OneBitAdam: DeepSpeed's MPI switch; no effect in zero (true warns)."),
            "zero's 1-bit exchange goes through torch.distributed (NCCL or gloo), not MPI", _any_true),
    _warned("bf16.check_grad_overflow", _flag(False, "No effect in zero, which always checks (true warns)."),
            "zero always skips a step whose gradients hold inf or NaN, in every precision (see docs/engine.md)"),
    _warned("bf16.immediate_grad_update",
            _flag(False, "DeepSpeed bf16 optimizer knob; no effect in zero (true warns)."),
            "a scheduling knob of DeepSpeed's bf16 optimizer; zero's updates do not depend on it"),
    _warned("zero_optimization.contiguous_gradients",
            _flag(True, "Copy grads into one contiguous buffer. zero always reduces from contiguous buckets "
                  "(false warns)."),
            "gradients are always reduced from contiguous buckets"),
    _warned("zero_optimization.allgather_partitions",
            _flag(True, "All-gather updated params (vs broadcasts). zero always all-gathers (false warns)."),
            "updated shards are always all-gathered"),
    _warned("zero_optimization.use_multi_rank_bucket_allreduce",
            _flag(True, "DeepSpeed perf knob; no effect in zero (false warns)."),
            "how DeepSpeed schedules its bucket all-reduce; zero's reduction does not depend on it"),
    _warned("zero_optimization.round_robin_gradients",
            _flag(False, "Offload perf knob for stage 1/2; no effect in zero (true warns)."),
            "gradient shards are already contiguous per bucket"),
    _warned("zero_optimization.stage3_use_all_reduce_for_fetch_params",
            _flag(False, "Stage 3: fetch params with all-reduce. zero fetches a unit with one all-gather "
                  "(true warns)."),
            "stage 3 always fetches a unit with one all-gather"),
    _warned("zero_optimization.stage3_allgather_sequential",
            _flag(False, "Stage 3: gather params one by one, unbucketed. zero fetches a unit with one all-gather "
                  "(true warns)."),
            "stage 3 always fetches a unit with one all-gather"),
    _warned("zero_optimization.memory_efficient_linear",
            _flag(True, "Stage 3: do not keep gathered linear weights for backward. zero never does (false warns)."),
            "stage 3 frees what autograd saves of a gathered weight anyway"),
    _warned("zero_optimization.cpu_offload_use_pin_memory",
            _key(Optional[bool], None, "Deprecated; no effect, as in DeepSpeed (set: warns)."),
            "deprecated, without effect in DeepSpeed too; set pin_memory in offload_optimizer / offload_param"),
    _warned("zero_optimization.offload_optimizer.fast_init",
            _flag(False, "NVMe: DeepSpeed's fast swap-file setup (true warns)."),
            "zero's swap files are reserved with one fallocate per state, already the fast way"),
    # --- training checkpoints: ConfigWarning --------------------------------------------------------
    _warned("zero_optimization.load_from_fp32_weights",
            _flag(True, "Restore fp32 master weights from training checkpoints; zero's checkpoints always do "
                  "(false warns)."),
            _NO_CHECKPOINTS),
    _warned("zero_optimization.elastic_checkpoint",
            _flag(False, "Legacy elastic training checkpoints; zero's load at any world size anyway (true warns)."),
            _NO_CHECKPOINTS),
    _warned("zero_optimization.pipeline_loading_checkpoint",
            _flag(False, "Stage 3 pipelined checkpoint loading; zero loads with DCP instead (true warns)."),
            _NO_CHECKPOINTS),
    _warned("elasticity.min_time",
            _key(int, 0, "DeepSpeed: for a resource scheduler, the minutes between rescalings."),
            "it is for the scheduler that restarts the job; training does not read it"),
    _warned("checkpoint.parallel_write.pipeline_stage",
            _flag(False, "DeepSpeed: each pipeline stage writes its own part. No effect in zero, whose checkpoints "
                  "DCP writes from every rank anyway (true warns)."),
            _NO_CHECKPOINTS),
)


# ---------------------------------------------------------------------------------------------
# Placeholder fields, from the rows
# ---------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def with_placeholders(section: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: the section model plus one field for each row whose key lies in `section`.

    Args:
        section: the section's dotted path ("zero_optimization.offload_param"; "" for the root).

    The decorated class's own fields are the keys zero reads; the returned class (a subclass of
    the same name, built by pydantic's `create_model`) adds the rows' placeholders, so a config may
    set them and `load_config` can refuse or warn about them. As in DeepSpeed's models, a
    `stage3_x` key is stored under its short name `x`, with the long one as its alias.
    """

    def build(cls: type[M]) -> type[M]:
        fields: dict[str, Any] = {}
        for row in UNIMPLEMENTED_FEATURES:
            where, key = row.field_at
            if where != section or row.placeholder is None:
                continue
            name = key.removeprefix("stage3_")
            if name in cls.model_fields or (name in fields and not row.placeholder.raw):
                raise TypeError(f"UNIMPLEMENTED_FEATURES row {row.path!r}: {cls.__name__} already has a field "
                                f"{name!r} (a key is either read or in the table, not both)")
            p = row.placeholder
            fields[name] = (p.annotation, Field(p.default, alias=key if name != key else None,
                                                description=p.description, **p.constraints))
        built = create_model(cls.__name__, __base__=cls, __module__=cls.__module__, **fields)
        built.__doc__, built.__qualname__ = cls.__doc__, cls.__qualname__
        return built

    return build


# ---------------------------------------------------------------------------------------------
# Checking a config against the table
# ---------------------------------------------------------------------------------------------

_ABSENT = object()  # the key is not there: a section above it is not given, or a raw section lacks it


def _field_name(cls: type, key: str) -> Optional[str]:
    for name, info in cls.model_fields.items():
        if key in (name, info.alias):
            return name
    return None


def _value_and_default(cfg: ZeroConfig, path: str) -> tuple[Any, Any]:
    """The value at `path` and its default (`_ABSENT` inside a raw DeepSpeed section)."""
    obj: Any = cfg
    default: Any = _ABSENT
    for part in path.split("."):
        if isinstance(obj, BaseModel):
            name = _field_name(type(obj), part)
            if name is None:
                raise KeyError(f"UNIMPLEMENTED_FEATURES row {path!r}: {type(obj).__name__} has no key {part!r}")
            default = type(obj).model_fields[name].default
            obj = getattr(obj, name)
        elif isinstance(obj, dict):
            obj, default = obj.get(part, _ABSENT), _ABSENT
        else:
            return _ABSENT, _ABSENT
    return obj, default


def _shown(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, {...}), shortened."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_set(feat: UnimplementedFeature, cfg: ZeroConfig) -> tuple[bool, Any]:
    value, default = _value_and_default(cfg, feat.path)
    if value is _ABSENT or value is None:
        return False, value
    if feat.is_set is None:
        return value != default, value
    return bool(feat.is_set(value)), value


def _check_unimplemented(cfg: ZeroConfig) -> None:
    """Raise one ConfigError for every refused key that is set; warn once for each warned key."""
    errors: list[tuple[tuple, str]] = []
    for feat in UNIMPLEMENTED_FEATURES:
        loc = tuple(feat.path.split("."))
        try:
            is_set, value = _is_set(feat, cfg)
        except (TypeError, ValueError):
            errors.append((loc, f"unexpected value {_shown(_value_and_default(cfg, feat.path)[0])}"))
            continue
        if not is_set:
            continue
        if feat.kind == "error":
            errors.append((loc, f"set to {_shown(value)}, which zero does not implement and which would "
                                f"change results: {feat.reason}. Remove it."))
        else:
            _warn(f"{feat.path} = {_shown(value)} has no effect in zero and is ignored: {feat.reason}. "
                  f"Training results are unaffected.")
    if errors:
        _raise(errors)

"""Reading a config: `load_config` (file or dict -> validated `ZeroConfig`), "auto" values, batch sizes.

[Note: "auto" values]
HuggingFace writes "auto" where its Trainer fills a value in. DeepSpeed's own config models drop
"auto" (the key counts as not given, so its default applies); we do the same for every key, after
first filling the values the caller supplies (`auto_values=`, as the HF integration does, including
bucket sizes derived from "hidden_size"). Batch keys left "auto" are simply not given, so the
batch rule below derives them. A key that is "auto" and has no default is reported as missing.
"""
from __future__ import annotations

import copy
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any, Optional, Union

from pydantic import ValidationError

from zero.config.errors import ConfigError, _issues_from, _raise
from zero.config.features import _check_unimplemented
from zero.config.model import MAX_BATCH, ZeroConfig
from zero.config.rules import Caller
from zero.config.sections import AUTO

# ---------------------------------------------------------------------------------------------
# "auto" values (see [Note: "auto" values])
# ---------------------------------------------------------------------------------------------


def resolve_auto(config: Mapping[str, Any], values: Optional[Mapping[str, Any]] = None) -> dict:
    """Return a copy of `config` with "auto" values filled from `values`, as HF's Trainer does.

    Args:
        config: a DeepSpeed-style config dict (not modified).
        values: dotted key path -> value, e.g. {"optimizer.params.lr": 3e-4,
            "train_micro_batch_size_per_gpu": 8}. The special key "hidden_size" fills
            zero_optimization.reduce_bucket_size = h*h below stage 3 (it has no effect at stage 3)
            and, at stage 3, stage3_prefetch_bucket_size = int(0.9*h*h) and
            stage3_param_persistence_threshold = 10*h.

    Only keys whose value is "auto" are filled; "auto" keys without a supplied value are left as
    they are (load_config then treats them as not given).
    """
    out = copy.deepcopy(dict(config))
    values = dict(values or {})
    hidden = values.pop("hidden_size", None)

    def fill(path: str, value: Any) -> None:
        parts = path.split(".")
        node = out
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return
        if node.get(parts[-1]) == AUTO:
            node[parts[-1]] = value

    for path, value in values.items():
        fill(path, value)
    zero = out.get("zero_optimization")
    if hidden is not None and isinstance(zero, dict):
        h = int(hidden)
        if zero.get("stage") != 3:  # stage 3 reduces one unit at a time: the key has no effect there
            fill("zero_optimization.reduce_bucket_size", h * h)
        else:
            for prefix in ("stage3_", ""):
                fill(f"zero_optimization.{prefix}prefetch_bucket_size", int(0.9 * h * h))
                fill(f"zero_optimization.{prefix}param_persistence_threshold", 10 * h)
    return out


# ---------------------------------------------------------------------------------------------
# Top-level keys zero does not know (see [Note: unknown top-level keys])
# ---------------------------------------------------------------------------------------------

# [Note: unknown top-level keys]
# DeepSpeed reads the keys it knows from the top of a config and ignores the rest, and public
# configs carry such keys: comments (`_comment`), launcher settings (`cuda_visible_devices`),
# sections of other tools (`comms_config`, `monitor_config`). zero therefore drops an unknown
# top-level key with a ConfigWarning naming it (a key starting with "_" or holding "comment" is a
# comment: dropped without a word), except when it looks like a mistake, which stays an error with
# a suggestion: a near-miss of a key zero knows (`gradient_clip`), or a key of a section given at
# the top (`stage`). Inside a section every key is checked strictly, as DeepSpeed's section models do.
_TYPO_CUTOFF = 0.7  # fp17 -> fp16 is 0.75; comms_config -> comms_logger (a real key elsewhere) 0.58


def _drop_unknown_top_level(data: dict) -> dict:
    import difflib

    from zero.config.errors import _all_paths, _keys_of, _warn

    known = _keys_of(ZeroConfig) | {"bfloat16"}  # bf16's old name, renamed by ZeroConfig._legacy_spellings
    nested = {leaf for leaf, path in _all_paths(ZeroConfig).items() if "." in path}
    out = {}
    for key, value in data.items():
        if key in known or not isinstance(key, str):
            out[key] = value
        elif key.startswith("_") or "comment" in key.lower():
            continue
        elif key in nested or difflib.get_close_matches(key, sorted(known), n=1, cutoff=_TYPO_CUTOFF):
            out[key] = value  # validation reports it, with the suggestion
        else:
            _warn(f"'{key}' is not a DeepSpeed key zero knows; it is ignored, as DeepSpeed ignores unknown "
                  f"top-level keys (remove it to silence this)")
    return out


# ---------------------------------------------------------------------------------------------
# Batch sizes
# ---------------------------------------------------------------------------------------------

def _resolve_batch(cfg: ZeroConfig, world_size: int) -> dict[str, int]:
    """DeepSpeed's rule: train = micro * accum * world; any two give the third; one alone gives what
    it can (train -> micro = train/world, accum = 1; micro -> accum = 1)."""
    train, micro, accum = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                           cfg.gradient_accumulation_steps)
    names = "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps"

    def exact(what: str, given: str, factor: int) -> int:
        if train % (factor * world_size) != 0 or train // (factor * world_size) == 0:
            _raise([((what,), f"cannot be derived: train_batch_size ({train}) must be a positive multiple "
                     f"of {given} * world_size = {factor} * {world_size} = {factor * world_size}")])
        return train // (factor * world_size)

    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world_size:
            _raise([(("train_batch_size",), f"train_batch_size must equal train_micro_batch_size_per_gpu"
                     f" * gradient_accumulation_steps * world_size, but {train} != {micro} * {accum} * "
                     f"{world_size} = {micro * accum * world_size}")])
    elif train is not None and micro is not None:
        accum = exact("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", micro)
    elif train is not None and accum is not None:
        micro = exact("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", accum)
    elif micro is not None and accum is not None:
        train = micro * accum * world_size
    elif train is not None:
        accum = 1
        micro = exact("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", 1)
    elif micro is not None:
        accum, train = 1, micro * world_size
    else:
        _raise([(("train_batch_size",), f"batch size not given: set train_batch_size or "
                 f"train_micro_batch_size_per_gpu (of {names}, any two determine the third)")])
    if train >= MAX_BATCH:
        _raise([(("train_batch_size",), f"train_batch_size = train_micro_batch_size_per_gpu * "
                 f"gradient_accumulation_steps * world_size = {micro} * {accum} * {world_size} = {train}, "
                 f"expected a value < 2**31 = {MAX_BATCH}")])
    return {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum}


def _elastic(cfg: ZeroConfig, world_size: int, model_parallel: int, source) -> ZeroConfig:
    """The config with the three batch keys of the elasticity section's plan for this world size."""
    from zero.config.elasticity import ElasticityError, batch_keys

    try:
        keys = batch_keys(cfg, world_size, model_parallel)
    except ElasticityError as exc:
        _raise([(tuple(k.split(".")), str(exc)) for k in exc.keys], source)
    return cfg.model_copy(update={**keys, "pipeline": cfg.pipeline.model_copy(update={"micro_batches": None})})


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _hjson(text: str, path: pathlib.Path, json_error: ValueError) -> Any:
    """DeepSpeed reads config files as hjson (comments, trailing commas); so do we, with the hjson
    library, when strict JSON fails."""
    if "duplicate key" in str(json_error):
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {json_error}") from None
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {json_error} (comments and trailing commas "
                          f"need the hjson package: pip install hjson)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except Exception as err:  # noqa: BLE001 - hjson's errors are plain ValueErrors with positions
        raise ConfigError(f"config file {str(path)!r} is neither valid JSON ({json_error}) nor hjson ({err})") from None


def _read(config: Union[Mapping[str, Any], str, pathlib.Path]) -> tuple[dict, str]:
    if isinstance(config, Mapping):
        return dict(config), ""
    if isinstance(config, (str, pathlib.Path)):
        path = pathlib.Path(config)
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror or err}") from None
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except ValueError as err:
            data = _hjson(text, path, err)
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
        return data, str(path)
    raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def load_config(config: Union[Mapping[str, Any], str, pathlib.Path], world_size: int = 1, *,
                auto_values: Optional[Mapping[str, Any]] = None, pipeline_stages: Optional[int] = None,
                model_is_pipeline: Optional[bool] = None, client_optimizer: Optional[type] = None) -> ZeroConfig:
    """Parse, validate and resolve a DeepSpeed-style config.

    Args:
        config: a dict, or a path (str or pathlib.Path) to a JSON file.
        world_size: number of ranks. Without pipeline or tensor parallelism all of them are
            data-parallel; with them, world_size / (pipeline.stages x tensor_parallel.size) are
            (see [Note: the parallel mesh] in zero/config/parallel.py), and the batch-size rule
            counts those.
        auto_values: values for "auto" keys, by dotted path (see `resolve_auto`).
        pipeline_stages: the model's own stage count (a PipelineModule's num_stages): taken when
            pipeline.stages is not given; an explicit different value is an error. Given, the model
            is a PipelineModule.
        model_is_pipeline: whether the model is a zero.pipe.PipelineModule; None (not known, as for
            `zero.tp.mesh`): the rules about the model are skipped (pipeline.stages > 1 needs one).
        client_optimizer: the class of the optimizer object passed to `zero.initialize`
            (`type(optimizer)`), or None when none is passed (or it is not built yet). Checked
            against the config's optimizer and offload (see [Note: rules that combine settings] in
            zero/config/rules.py).

    Returns:
        A frozen `ZeroConfig` whose three batch keys, pipeline.stages and pipeline.micro_batches
        are all set.

    Raises:
        ConfigError: unknown key, bad value, inconsistent batch sizes, settings that cannot go together
            (with each other, the model or the optimizer object), or a DeepSpeed key that zero
            does not implement and that is set to a value that would change results. A
            `ConfigWarning` is issued for each key set to a value that has no effect in zero, and for
            deprecated spellings (see [Note: what zero does with a DeepSpeed key]).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if client_optimizer is not None and not isinstance(client_optimizer, type):
        raise TypeError(f"client_optimizer is the optimizer's class, type(optimizer), got a "
                        f"{type(client_optimizer).__name__}")
    if pipeline_stages is not None:
        if model_is_pipeline is False:
            raise ValueError("pipeline_stages is the stage count of a PipelineModule, but model_is_pipeline is False")
        model_is_pipeline = True
    caller = Caller(pipeline_stages=pipeline_stages, model_is_pipeline=model_is_pipeline,
                    client_optimizer=client_optimizer)
    data, source = _read(config)
    data = resolve_auto(data, auto_values)
    data = _drop_unknown_top_level(data)
    try:
        cfg = ZeroConfig.model_validate(data, context={"caller": caller})
    except ValidationError as err:
        _raise(_issues_from(err, ZeroConfig), source)
    _check_unimplemented(cfg)
    pipe = cfg.pipeline
    if pipeline_stages is not None and pipe.stages is not None and pipe.stages != pipeline_stages:
        _raise([(("pipeline", "stages"), f"is {pipe.stages}, but the model is a PipelineModule of "
                 f"num_stages={pipeline_stages}; give the same number (or leave pipeline.stages out)")], source)
    stages = pipe.stages or pipeline_stages or 1
    if pipe.schedule == "interleaved_1f1b" and stages < 2:
        _raise([(("pipeline", "schedule"), "'interleaved_1f1b' needs at least 2 pipeline stages")], source)
    if world_size % (stages * cfg.tensor_parallel.size):
        key = ("pipeline", "stages") if stages > 1 or cfg.tensor_parallel.size == 1 else ("tensor_parallel", "size")
        _raise([(key, f"the world of {world_size} ranks does not split into pipeline.stages "
                 f"({stages}) x tensor_parallel.size ({cfg.tensor_parallel.size}) x a data-parallel size: "
                 f"{world_size} is not a multiple of {stages * cfg.tensor_parallel.size}")], source)
    from zero.compilation import check_compile_section

    compile_problems = check_compile_section(cfg.compile)
    if compile_problems:
        _raise(compile_problems, source)
    ck = cfg.checkpoint
    needs_dir = [k for k in ("save_interval", "keep_last") if getattr(ck, k) is not None]
    needs_dir += ["auto_resume"] if ck.auto_resume else []
    if needs_dir and not ck.dir:
        _raise([(("checkpoint", k), "needs checkpoint.dir (the directory to save to and resume from)")
                for k in needs_dir], source)
    sp = cfg.sequence_parallel_size
    if sp > 1 and (stages > 1 or cfg.tensor_parallel.size > 1):
        _raise([(("sequence_parallel_size",), f"is {sp} with pipeline or tensor parallelism, which zero's "
                 f"sequence parallelism does not combine with yet; use one of them")], source)
    if world_size % sp:
        _raise([(("sequence_parallel_size",), f"is {sp}, which does not divide the world of {world_size} ranks "
                 f"into sequence-parallel groups")], source)
    vp, vdims = cfg.spatial_parallel_size, cfg.spatial_parallel_dims
    if not 1 <= len(vdims) <= 3 or len(set(vdims)) != len(vdims) or min(vdims) < 2:
        _raise([(("spatial_parallel_dims",), f"is {vdims}: give one to three distinct dimensions >= 2 of an (N, C, "
                 f"*spatial) activation (one: slabs; two or three: blocks of a grid)")], source)
    if vp > 1 and (stages > 1 or cfg.tensor_parallel.size > 1 or sp > 1):
        _raise([(("spatial_parallel_size",), f"is {vp} with pipeline, tensor or sequence parallelism, which zero's "
                 f"spatial parallelism does not combine with yet; use one of them")], source)
    if world_size % vp:
        _raise([(("spatial_parallel_size",), f"is {vp}, which does not divide the world of {world_size} ranks "
                 f"into spatial-parallel groups")], source)
    shard = cfg.zero_optimization.mics_shard_size
    if shard == "node":  # the data-parallel ranks of one node: torchrun's ranks per node, less the other dimensions
        local, others = os.environ.get("LOCAL_WORLD_SIZE"), stages * cfg.tensor_parallel.size * sp * vp
        if not (local or "").isdigit() or int(local) % others:
            _raise([(("zero_optimization", "mics_shard_size"), f"is 'node', but the ranks per node are unknown: "
                     f"torchrun's LOCAL_WORLD_SIZE is {local!r}" + (f", not a multiple of the {others} ranks of the other "
                                                                   f"dimensions" if (local or '').isdigit() else "") +
                     "; give the number of data-parallel ranks per node")], source)
        shard = int(local) // others
        cfg = cfg.model_copy(update={"zero_optimization": cfg.zero_optimization.model_copy(
            update={"mics_shard_size": shard})})
    if shard != -1:
        ranks = world_size // (stages * cfg.tensor_parallel.size * sp * vp)  # the data-parallel ranks
        if shard < 1 or ranks % shard:
            _raise([(("zero_optimization", "mics_shard_size"), f"is {shard}: give -1 (shard over every data-parallel "
                     f"rank) or a number of ranks that divides the {ranks} data-parallel ranks (usually the ranks of "
                     f"one node)")], source)
    hpz = cfg.zero_optimization.zero_hpz_partition_size
    if hpz > 1:
        ranks = world_size // (stages * cfg.tensor_parallel.size * sp * vp)
        problem = ("applies to ZeRO stage 3" if cfg.zero_optimization.stage != 3 else
                   "does not combine with mics_shard_size (hybrid sharding keeps every gather inside the shard group "
                   "already)" if shard != -1 else
                   "does not combine with pipeline stages or tensor slices yet" if stages * cfg.tensor_parallel.size > 1
                   else f"does not divide the {ranks} data-parallel ranks" if ranks % hpz else None)
        if problem:
            _raise([(("zero_optimization", "zero_hpz_partition_size"), f"is {hpz}: it {problem}")], source)
    zc = cfg.zero_optimization
    for key, what in (("zero_quantized_weights", "quantized weights are stage 3's all-gather"),
                      ("zero_quantized_nontrainable_weights", "quantized weights are stage 3's all-gather"),
                      ("zero_quantized_gradients", "quantized gradients are stage 3's reduce-scatter"),
                      ("mics_hierarchical_params_gather", "the two-hop gather is stage 3's all-gather")):
        if getattr(zc, key) and zc.stage != 3:
            _raise([(("zero_optimization", key), f"is true at stage {zc.stage}: {what} (set stage 3, or leave it "
                     f"false)")], source)
    data_parallel = _parallel_dims(cfg, world_size, source).size("batch")  # the ranks loading different samples
    if cfg.elasticity.enabled:  # the section decides the batch (zero/config/elasticity.py)
        cfg = _elastic(cfg, world_size, world_size // data_parallel, source)
    m, accum = pipe.micro_batches, cfg.gradient_accumulation_steps
    if m is not None and accum is not None and m != accum:
        _raise([(("pipeline", "micro_batches"), f"is {m} but gradient_accumulation_steps is {accum}: both count "
                 f"the micro-batches of one optimizer step; give one, or the same number")], source)
    if m is not None:
        cfg = cfg.model_copy(update={"gradient_accumulation_steps": m})
    batch = _resolve_batch(cfg, data_parallel)
    m = batch["gradient_accumulation_steps"]
    if pipe.schedule == "interleaved_1f1b" and m % stages:
        _raise([(("pipeline", "micro_batches"), f"schedule 'interleaved_1f1b' runs micro-batches in rounds of the "
                 f"{stages} stages: the micro-batches per step ({m}) must be a multiple of {stages}")], source)
    return cfg.model_copy(update={**batch, "pipeline": pipe.model_copy(update={"stages": stages, "micro_batches": m})})


def _parallel_dims(cfg: ZeroConfig, world_size: int, source: str):
    """The run's parallel dimensions (see [Note: parallel dimensions] in zero/parallel/dims.py),
    validated here with the rest of the config."""
    from zero.parallel.dims import ParallelDims, ParallelDimsError

    try:
        return ParallelDims.from_config(cfg, world_size)
    except ParallelDimsError as err:
        _raise([((), f"the parallel sizes do not split the world: {err}")], source)

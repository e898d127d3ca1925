"""Specification of zero/config/: DeepSpeed key names, aliases, defaults, and readable errors."""
import ast
import inspect
import itertools
import json
import pathlib
import re
import sys
import typing
import warnings

import pydantic
import pytest
import torch

import zero
from zero.config import (
    DEEPSPEED_SCHEDULERS,
    UNIMPLEMENTED_FEATURES,
    ConfigError,
    ConfigWarning,
    ZeroConfig,
    load_config,
    resolve_auto,
)
from zero.config.optimizer import CLIENT_OPTIMIZERS
from zero.config.sections import _Section

BASE = {"train_batch_size": 8}


def load(extra=None, **kw):
    return load_config({**BASE, **(extra or {})}, **kw)


def error(extra, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra, **kw)
    return str(info.value)


# ----------------------------------------------------------------------------------- defaults

def test_defaults_match_deepspeed():
    cfg = load()
    assert cfg.gradient_clipping == 0.0
    assert cfg.steps_per_print is None
    assert cfg.wall_clock_breakdown is False and cfg.dump_state is False
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.communication_data_type is None
    assert cfg.optimizer is None and cfg.scheduler is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (
                False, False, 0.0, 16, 1000, 2, False, 1.0)
    assert cfg.bf16.enabled is False
    z = cfg.zero_optimization
    assert z.stage == 0
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert z.contiguous_gradients and z.reduce_scatter and z.allgather_partitions
    assert z.overlap_comm is False
    assert z.load_from_fp32_weights and z.ignore_unused_parameters
    assert not z.elastic_checkpoint and not z.round_robin_gradients
    assert z.sub_group_size == 1_000_000_000
    assert z.prefetch_bucket_size == 50_000_000
    assert z.param_persistence_threshold == 100_000
    assert z.model_persistence_threshold == sys.maxsize
    assert z.max_live_parameters == z.max_reuse_distance == 1_000_000_000
    assert z.gather_16bit_weights_on_model_save is False
    assert z.offload_optimizer is None and z.offload_param is None
    assert z.zero_hpz_partition_size == 1 and z.mics_shard_size == -1
    assert z.memory_efficient_linear is True


def test_overlap_comm_defaults_to_true_only_for_stage3():
    assert load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert load({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False


def test_offload_defaults_match_deepspeed():
    z = load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}}}).zero_optimization
    o, p = z.offload_optimizer, z.offload_param
    assert (o.device, o.pin_memory, o.buffer_count, o.fast_init, o.ratio, o.nvme_path) == ("cpu", False, 4, False, 1.0, None)
    assert (p.device, p.pin_memory, p.buffer_count, p.buffer_size, p.max_in_cpu) == (
        "cpu", False, 5, 100_000_000, 1_000_000_000)


def test_optimizer_defaults_and_adam_w_mode():
    opt = load({"optimizer": {"type": "adam"}}).optimizer
    assert opt.type == "Adam"
    p = opt.params
    assert (p.lr, p.betas, p.eps, p.weight_decay, p.bias_correction, p.adam_w_mode, p.torch_adam) == (
        1e-3, (0.9, 0.999), 1e-8, 0.0, True, True, False)
    assert opt.adamw  # DeepSpeed: Adam means AdamW unless adam_w_mode is false
    assert not load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer.adamw
    assert load({"optimizer": {"type": "ADAMW", "params": {"adam_w_mode": False}}}).optimizer.adamw


def test_precision_property():
    assert load().precision == "fp32" and load().dtype == torch.float32
    assert load({"fp16": {"enabled": True}}).precision == "fp16"
    cfg = load({"bf16": {"enabled": True}})
    assert cfg.precision == "bf16" and cfg.dtype == torch.bfloat16 and cfg.communication_dtype == torch.bfloat16


def test_config_is_frozen():
    cfg = load()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.gradient_clipping = 1.0
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.zero_optimization.stage = 2


# ----------------------------------------------------------------------------------- batch rule

@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("given", [c for r in (1, 2, 3) for c in itertools.combinations("tma", r)])
def test_batch_rule_every_combination(world, given):
    micro, accum = 4, 2
    full = {"t": micro * accum * world, "m": micro, "a": accum}
    keys = {"t": "train_batch_size", "m": "train_micro_batch_size_per_gpu", "a": "gradient_accumulation_steps"}
    cfg_dict = {keys[k]: full[k] for k in given}
    if given == ("a",):
        with pytest.raises(ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
            load_config(cfg_dict, world_size=world)
        return
    cfg = load_config(cfg_dict, world_size=world)
    if given in (("t",), ("m",)):  # one alone: accumulation is 1 (DeepSpeed)
        expect = (micro * accum * world, micro * accum, 1) if given == ("t",) else (micro * world, micro, 1)
    else:
        expect = (full["t"], full["m"], full["a"])
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expect
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world


def test_batch_inconsistent_error_shows_numbers():
    msg = error({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                world_size=2)
    assert "train_batch_size" in msg and "32 != 4 * 2 * 2 = 16" in msg


def test_batch_not_divisible_error_shows_numbers():
    msg = error({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert "gradient_accumulation_steps" in msg and "(30)" in msg and "4 * 2 = 8" in msg


def test_batch_none_given_is_error():
    with pytest.raises(ConfigError, match="batch size not given"):
        load_config({})


def test_batch_auto_counts_as_not_given():
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": "auto"}, world_size=4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "eight"])
def test_batch_values_must_be_positive_integers(bad):
    assert "train_batch_size" in error({"train_batch_size": bad})


# ----------------------------------------------------------------------------------- unknown keys

def test_misspelt_top_level_key_names_it_and_suggests():
    msg = error({"gradient_clip": 1.0})
    assert "gradient_clip" in msg and "did you mean 'gradient_clipping'?" in msg


def test_misspelt_nested_key_names_full_path_and_suggests():
    msg = error({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}})
    assert "zero_optimization.reduce_bucket_sise" in msg and "did you mean 'reduce_bucket_size'?" in msg
    msg = error({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}})
    assert "zero_optimization.offload_optimizer.pin_memroy" in msg and "'pin_memory'" in msg
    msg = error({"fp16": {"enabled": True, "loss_scale_windw": 10}})
    assert "fp16.loss_scale_windw" in msg and "'loss_scale_window'" in msg


def test_key_in_wrong_section_suggests_its_path():
    assert "did you mean 'zero_optimization.stage'?" in error({"stage": 2})


def test_all_problems_are_reported_together():
    err = pytest.raises(ConfigError, load, {"zero_optimization": {"stage": 5, "overlap_com": True}}).value
    assert {p for p, _ in err.issues} == {"zero_optimization.stage", "zero_optimization.overlap_com"}
    assert "2 problems" in str(err)


# ----------------------------------------------------------------------------------- bad values

def test_stage_out_of_range():
    msg = error({"zero_optimization": {"stage": 5}})
    assert "zero_optimization.stage" in msg and "0, 1, 2 or 3" in msg and "5" in msg


def test_negative_bucket_size():
    msg = error({"zero_optimization": {"reduce_bucket_size": -1}})
    assert "zero_optimization.reduce_bucket_size" in msg and ">= 0" in msg and "-1" in msg


def test_fp16_and_bf16_both_enabled():
    msg = error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled" in msg


@pytest.mark.parametrize("betas", [[0.9], [0.9, 1.0], [-0.1, 0.9], "0.9", [0.9, 0.99, 0.999]])
def test_bad_betas(betas):
    msg = error({"optimizer": {"type": "Adam", "params": {"betas": betas}}})
    assert "optimizer.params.betas" in msg and "0 <= beta < 1" in msg


def test_negative_lr():
    msg = error({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}})
    assert "optimizer.params.lr" in msg and ">= 0" in msg


def test_negative_gradient_clipping_and_bad_offload_device():
    assert "gradient_clipping" in error({"gradient_clipping": -1})
    msg = error({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    assert "zero_optimization.offload_optimizer.device" in msg and "'cpu'" in msg


def test_unsupported_optimizer_lists_supported_ones():
    msg = error({"optimizer": {"type": "MuAdam", "params": {}}})
    assert "optimizer.type" in msg and "Adam, AdamW, SGD, Adagrad, Lion, Muon, OneBitAdam" in msg


def test_max_grad_norm_in_optimizer_params_points_to_gradient_clipping():
    assert "gradient_clipping" in error({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})


@pytest.mark.parametrize("spelling,canon", [("fp32", "fp32"), ("FP16", "fp16"), ("bfloat16", "bf16"),
                                            ("torch.float32", "fp32"), ("half", "fp16"), (None, None)])
def test_communication_data_type_spellings(spelling, canon):
    assert load({"communication_data_type": spelling}).communication_data_type == canon


def test_communication_data_type_rejects_others():
    assert "communication_data_type" in error({"communication_data_type": "int8"})


def test_scientific_notation_integers_accepted():
    assert load({"zero_optimization": {"reduce_bucket_size": 2e8}}).zero_optimization.reduce_bucket_size == 200_000_000


# ----------------------------------------------------------------------------------- scheduler

def test_deepspeed_scheduler_params_validated_with_defaults():
    s = load({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}).scheduler
    assert (s.params.warmup_min_lr, s.params.warmup_max_lr, s.params.warmup_num_steps, s.params.warmup_type) == (
        0.0, 0.001, 1000, "log")
    c = load({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}}).scheduler.params
    assert (c.cos_min_ratio, c.warmup_min_ratio) == (0.0001, 0.0)
    msg = error({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}})
    assert "scheduler.params.warmup_num_step" in msg and "'warmup_num_steps'" in msg
    assert "scheduler.params.total_num_steps" in error({"scheduler": {"type": "WarmupDecayLR"}})
    assert "scheduler.params.cycle_min_lr" in error({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}})


def test_torch_scheduler_params_checked_against_signature():
    s = load({"scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}}}).scheduler
    assert s.params == {"step_size": 10, "gamma": 0.5}
    msg = error({"scheduler": {"type": "StepLR", "params": {"step_sise": 10}}})
    assert "scheduler.params.step_sise" in msg and "'step_size'" in msg
    assert "scheduler.params.step_size" in msg  # required, missing


def test_unknown_scheduler_type_suggests():
    assert "did you mean 'WarmupLR'?" in error({"scheduler": {"type": "WarmupLr"}})


# ----------------------------------------------------------------------------------- auto

def test_auto_without_values_falls_back_to_deepspeed_defaults():
    cfg = load({"gradient_clipping": "auto", "fp16": {"enabled": "auto"},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}})
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)
    assert cfg.gradient_clipping == 0.0 and cfg.fp16.enabled is False
    assert cfg.optimizer.params.lr == 1e-3 and cfg.optimizer.params.betas == (0.9, 0.999)


def test_auto_values_fill_like_huggingface():
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto", "sub_group_size": 1000,
                                 "offload_optimizer": {"device": "cpu"}}}
    cfg = load_config(raw, world_size=2, auto_values={
        "optimizer.params.lr": 3e-4, "optimizer.params.weight_decay": 0.01, "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
        "scheduler.params.total_num_steps": 500, "hidden_size": 768,
        "zero_optimization.sub_group_size": 1})  # not "auto": left alone
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 8, 4)
    assert cfg.optimizer.params.lr == 3e-4 and cfg.optimizer.params.weight_decay == 0.01
    assert cfg.gradient_clipping == 1.0 and cfg.scheduler.params.total_num_steps == 500
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 500_000_000  # no effect at stage 3: "auto" keeps the default, no warning
    assert z.prefetch_bucket_size == int(0.9 * 768 * 768)
    assert z.param_persistence_threshold == 7680
    assert z.sub_group_size == 1000
    assert raw["optimizer"]["params"]["lr"] == "auto"  # input not modified


def test_hidden_size_fills_stage3_keys_only_at_stage3():
    out = resolve_auto({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                              "stage3_prefetch_bucket_size": "auto"}}, {"hidden_size": 10})
    assert out["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 100, "stage3_prefetch_bucket_size": "auto"}


def test_auto_on_a_misspelt_key_is_still_an_error():
    assert "did you mean 'reduce_bucket_size'?" in error({"zero_optimization": {"reduce_bucket_sise": "auto"}})


# ----------------------------------------------------------------------------------- input forms

def test_json_path_input(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    for form in (path, str(path)):
        cfg = load_config(form, world_size=2)
        assert cfg.train_batch_size == 4 and cfg.zero_optimization.stage == 2


def test_missing_file_and_bad_json_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(missing)
    hjson = tmp_path / "ds_hjson.json"  # DeepSpeed reads hjson: comments and trailing commas
    hjson.write_text("{\n  // micro batch\n  \"train_micro_batch_size_per_gpu\": 2,\n  \"zero_optimization\": {\"stage\": 2,},\n}")
    assert load_config(hjson).zero_optimization.stage == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{\"train_batch_size\": [8,}")
    with pytest.raises(ConfigError, match="bad.json.*neither valid JSON .* nor hjson"):
        load_config(bad)
    dup = tmp_path / "dup.json"
    dup.write_text("{\"train_batch_size\": 8, \"train_batch_size\": 16}")
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(dup)


def test_errors_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp17": {}}))
    with pytest.raises(ConfigError, match=r"ds.json.*fp17.*did you mean 'fp16'"):
        load_config(path)


def test_bad_world_size():
    with pytest.raises(ConfigError, match="world_size"):
        load_config(BASE, world_size=0)


# ----------------------------------------------------------------------------------- aliases

def test_bfloat16_alias():
    assert load({"bfloat16": {"enabled": True}}).precision == "bf16"
    assert "bfloat16" in error({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


def test_stage3_aliases_both_spellings():
    a = load({"zero_optimization": {"stage3_prefetch_bucket_size": 7, "stage3_max_live_parameters": 8}})
    b = load({"zero_optimization": {"prefetch_bucket_size": 7, "max_live_parameters": 8}})
    assert a.zero_optimization == b.zero_optimization
    assert a.zero_optimization.prefetch_bucket_size == 7
    assert "keep one" in error({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})


def test_cpu_offload_deprecated_alias():
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        z = load({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert z.offload_optimizer.device == "cpu"
    with pytest.warns(ConfigWarning):
        assert "not both" in error({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


def test_gather_fp16_weights_deprecated_alias():
    with pytest.warns(ConfigWarning, match="deprecated"):
        z = load({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}).zero_optimization
    assert z.gather_16bit_weights_on_model_save is True
    z = load({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}}).zero_optimization
    assert z.gather_16bit_weights_on_model_save is True


def test_zero_optimization_bool_legacy_form():
    with pytest.warns(ConfigWarning):
        assert load({"zero_optimization": True}).zero_optimization.stage == 1


# ----------------------------------------------------------------------------------- read, refused or warned
# See [Note: what zero does with a DeepSpeed key] in zero/config/features.py.

# What is READ is not listed here: it is derived from zero's source. A key is read when a module
# of zero outside zero/config/ reads its attribute name, in a module that also reads its section's
# name (`z = cfg.zero_optimization` ... `z.stage`), or when a config property that such a module uses
# reads it (`cfg.precision` reads `bf16.enabled`). A key with its own name cannot pass this unread;
# a generic one (`enabled`, `size`) needs its section's name beside it. The parameters of
# DeepSpeed's schedules are read as a whole (`build_scheduler(type, dict(params), ...)`), so they
# must be the constructor arguments of zero.lr_schedules' classes of the same names.
DEPRECATED_SPELLINGS = {  # read as their new names, with a ConfigWarning
    "zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save",
}
REFUSED_BY_VALIDATOR = {  # key -> a value its validator refuses; the default is the only accepted value
    "optimizer.params.amsgrad": True, "zero_optimization.offload_optimizer.ratio": 0.5,
}
PACKAGE = pathlib.Path(zero.__file__).parent


def _submodel(annotation):
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return annotation
    return next((m for m in map(_submodel, typing.get_args(annotation)) if m is not None), None)


def _keys(cls=ZeroConfig, prefix="", seen=None, names=()):
    """DeepSpeed path -> (pydantic field, its attribute names from the root), for every key of
    `cls` and of the sections under it."""
    out = {}
    if seen is not None:
        seen.add(cls)
    for name, field in cls.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        sub = _submodel(field.annotation)
        if sub is not None:
            out.update(_keys(sub, path + ".", seen, names + (name,)))
        else:
            out[path] = (field, names + (name,))
    if cls is ZeroConfig:  # `scheduler.params` is typed per schedule
        for schedule in DEEPSPEED_SCHEDULERS.values():
            out.update(_keys(schedule, "scheduler.params.", seen, ("scheduler", "params")))
    return out


def _fields():
    return {path: field for path, (field, _) in _keys().items()}


def _attributes_read(tree: ast.AST) -> set[str]:
    """The attribute names `tree` reads: `x.name` and `getattr(x, "name")`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def _read_sites() -> list[tuple[str, set[str]]]:
    """(where, attribute names read) for each module of zero outside zero/config/, and for each config
    property that one of those modules uses."""
    # DeepSpeed's config objects and engine accessors (zero/deepspeed/, zero/deepspeed/engine_accessors.py)
    # show every key's value, as DeepSpeed's do: reading it there is not implementing it
    # (zero/config/elasticity.py computes with its keys' values: it is a reader that lives beside the config)
    mirrors = ("config", "deepspeed", "engine_accessors.py")
    sites = [(str(f.relative_to(PACKAGE)), _attributes_read(ast.parse(f.read_text())))
             for f in sorted(PACKAGE.rglob("*.py"))
             if f.relative_to(PACKAGE).parts[0] not in mirrors or str(f.relative_to(PACKAGE)) == "config/elasticity.py"]
    used = set().union(*(names for _, names in sites))
    for f in sorted((PACKAGE / "config").glob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if (isinstance(fn, ast.FunctionDef) and fn.name in used
                        and any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)):
                    sites.append((f"config/{f.name}: {cls.name}.{fn.name}", _attributes_read(fn)))
    return sites


def _readers(names: tuple, sites) -> list[str]:
    """Where the key with attribute names `names` (from the root) is read: its own name and its
    section's, in one module."""
    *_, section, name = ("",) + names
    return [where for where, read in sites if name in read and (not section or section in read)]


TABLE = {row.path: row for row in UNIMPLEMENTED_FEATURES}


RAW_SECTIONS = {row.field_at[1] for row in UNIMPLEMENTED_FEATURES if row.placeholder.raw}


def _in_table(path: str) -> bool:
    """A typed key has its own row; a raw DeepSpeed section is covered by rows inside it."""
    return path in TABLE or any(p.startswith(path + ".") for p in TABLE)


def test_every_key_is_read_refused_or_warned():
    seen = set()
    keys = _keys(seen=seen)
    sections = set()
    todo = [_Section]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not cls.__module__.startswith("zero.deepspeed"):  # DeepSpeed's config objects subclass zero's sections
            sections.add(cls)
    # with_placeholders builds each section as a subclass of the class written in sections.py
    unreachable = {cls for cls in sections - {_Section} - seen if not set(cls.__subclasses__()) & seen}
    assert not unreachable, f"section models not reachable from ZeroConfig: {unreachable}"
    sites = _read_sites()
    for path, (_, names) in keys.items():
        kinds = [name for name, hit in (("DEPRECATED_SPELLINGS", path in DEPRECATED_SPELLINGS),
                                        ("REFUSED_BY_VALIDATOR", path in REFUSED_BY_VALIDATOR),
                                        ("UNIMPLEMENTED_FEATURES", _in_table(path))) if hit]
        assert len(kinds) <= 1, f"{path}: classified as {kinds}; keep it in one"
        if path.startswith("scheduler.params."):
            continue  # a schedule's parameters: test_schedule_parameters_are_the_schedules_arguments
        if path in RAW_SECTIONS:
            continue  # DeepSpeed's section, its name often an attribute of something else (`torch.compile`)
        readers = _readers(names, sites)
        if kinds:
            assert not readers, (f"{path} is in {kinds[0]} but {readers} read it: if zero implements it now, "
                                 f"take it out of {kinds[0]}")
        else:
            assert readers, (f"{path} is accepted but nothing in zero outside zero/config/ reads it: read it, or "
                             f"refuse or warn about it with a row in UNIMPLEMENTED_FEATURES")
    for path in DEPRECATED_SPELLINGS | set(REFUSED_BY_VALIDATOR):
        assert path in keys, f"{path} is listed here but is not a key"
    for path in TABLE:
        head = path.split(".")[0]
        assert path in keys or (head in keys and keys[head][0].annotation == typing.Optional[dict[str, typing.Any]]), path
    for path, value in REFUSED_BY_VALIDATOR.items():
        config = _nested(path, value)
        if path.startswith("optimizer."):
            config["optimizer"]["type"] = "AdamW"
        with pytest.raises(ConfigError) as info:
            load(config)
        assert [p for p, _ in info.value.issues] == [path]


def test_config_tables_are_used_and_not_empty():
    """No dead scaffolding in zero/config/: every module-level table (a literal dict, tuple, list or
    set) holds something and is used somewhere in zero outside its own assignment."""
    sources = {f: f.read_text() for f in PACKAGE.rglob("*.py")}
    for f in sorted((PACKAGE / "config").glob("*.py")):
        for node in ast.parse(sources[f]).body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
                node.target if isinstance(node, ast.AnnAssign) else None)
            if not isinstance(target, ast.Name) or not isinstance(node.value, (ast.Dict, ast.Tuple, ast.List, ast.Set)):
                continue
            name = target.id
            value = node.value
            assert (value.keys if isinstance(value, ast.Dict) else value.elts), f"{f.name}: {name} is empty"
            uses = sum(len(re.findall(rf"\b{name}\b", text)) for text in sources.values())
            assert uses > 1, f"{f.name}: {name} is never used"


def test_schedule_parameters_are_the_schedules_arguments():
    """`scheduler.params` reaches the schedule whole, as keyword arguments: each key of a DeepSpeed
    schedule is an argument of zero's schedule of that name, and the engine passes them all."""
    from zero.lr_schedules.build import DEEPSPEED_SCHEDULERS as SCHEDULES

    assert set(SCHEDULES) == set(DEEPSPEED_SCHEDULERS)
    for name, params in DEEPSPEED_SCHEDULERS.items():
        arguments = set(inspect.signature(SCHEDULES[name]).parameters) - {"optimizer"}
        assert set(params.model_fields) <= arguments, (name, set(params.model_fields) - arguments)
    assert _readers(("scheduler", "params"), _read_sites()), "nothing passes scheduler.params to the schedule"


def test_the_completeness_check_finds_a_key_nothing_reads():
    """The check above derives what is read from the source: an attribute nobody reads is caught."""
    sites = _read_sites()
    assert not _readers(("optimizer", "params", "no_such_key"), sites)
    assert not _readers(("pipeline", "loss_scale"), sites)  # a name that is read, but not beside its section's
    assert _readers(("zero_optimization", "reduce_bucket_size"), sites)


@pytest.mark.parametrize("path", sorted(DEPRECATED_SPELLINGS))
def test_deprecated_spellings_are_read_with_a_warning(path):
    with pytest.warns(ConfigWarning, match="deprecated"):
        cfg = load(_merge({"zero_optimization": {"stage": 3}}, _nested(path, True)))
    z = cfg.zero_optimization
    assert z.offload_optimizer or z.offload_param or z.gather_16bit_weights_on_model_save


def _nested(path: str, value) -> dict:
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_SETTINGS = {  # a value that sets each row whose key is not a typed bool
    "sparse_attention": {"mode": "fixed"},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}},
    "weight_quantization": {"post_init_quant": {"fc": {"num_bits": 8}}},
    "timers": {"throughput": {"enabled": True}}, "activation_checkpointing": {"partition_activations": True},
    "aio": {"block_size": 1048576}, "sequence_parallel_size": 2, "gradient_allreduce_op": "sum",
    "data_types.grad_accum_dtype": "bf16", "seq_parallel_communication_data_type": "bf16",
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8}, "zero_optimization.mics_shard_size": 2,
    "zero_optimization.zenflow": {"topk_ratio": 0.1}, "vocabulary_size": 50257,
    "checkpoint.tag_validation": "Fail", "zero_optimization.cpu_offload_use_pin_memory": True,
    "optimizer.params.comm_backend_name": "mpi",
    "activation_checkpointing.number_checkpoints": 4, "elasticity.min_time": 20,
}
ONEBIT_ONLY = {"optimizer.params.cuda_aware", "optimizer.params.comm_backend_name"}


def _setting(row) -> dict:
    if row.path in _SETTINGS:
        value = _SETTINGS[row.path]
    elif row.path.endswith((".enabled", ".deepcompile")) and row.path not in _fields():
        value = True  # a flag inside a raw DeepSpeed section
    else:
        value = not _fields()[row.path].default
    config = _nested(row.path, value)
    if row.path.startswith("optimizer."):
        config["optimizer"]["type"] = "OneBitAdam" if row.path in ONEBIT_ONLY else "AdamW"
    return config


@pytest.mark.parametrize("row", UNIMPLEMENTED_FEATURES, ids=lambda row: row.path)
def test_a_refused_or_warned_key_names_itself_when_set(row):
    if row.kind == "error":
        with pytest.raises(ConfigError) as info:
            load(_setting(row))
        assert [path for path, _ in info.value.issues] == [row.path]
        assert "which zero does not implement and which would change results" in str(info.value)
        assert row.reason in str(info.value)
    else:
        with pytest.warns(ConfigWarning, match=re.escape(row.path) + ".*has no effect in zero") as record:
            load(_setting(row))
        assert any(row.reason in str(w.message) for w in record)


def test_refused_and_warned_keys_are_quiet_at_their_defaults():
    keys = _fields()
    config = {"optimizer": {"type": "AdamW"}}
    for path in TABLE:
        if path in keys:
            config = _merge(config, _nested(path, keys[path].default))
    for section in ("amp", "torch_autocast", "progressive_layer_drop", "tensorboard", "wandb", "flops_profiler"):
        config[section] = {"enabled": False}
    config.update(timers={"throughput": {"enabled": False}}, tensor_parallel={"autotp_size": 1},
                  compile={"deepcompile": False}, activation_checkpointing={
                      "partition_activations": False, "cpu_checkpointing": False, "number_checkpoints": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(config)


@pytest.mark.parametrize("key,value", [
    ("contiguous_gradients", False), ("allgather_partitions", False), ("round_robin_gradients", True),
    ("stage3_use_all_reduce_for_fetch_params", True), ("stage3_allgather_sequential", True),
    ("use_all_reduce_for_fetch_params", True),  # DeepSpeed's alias, reported under the stage3_ name
])
def test_deepspeed_memory_knobs_warn_from_load_config_only_when_changed(key, value):
    with pytest.warns(ConfigWarning, match=f"zero_optimization.(stage3_)?{key} = {str(value).lower()} has no effect"):
        load({"zero_optimization": {"stage": 3, key: value}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load({"zero_optimization": {"stage": 3, key: not value}})


@pytest.mark.parametrize("extra,path", [
    ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
    ({"zero_force_ds_cpu_optimizer": False}, "zero_force_ds_cpu_optimizer"),
    ({"vocabulary_size": 50257}, "vocabulary_size"),
    ({"zero_optimization": {"memory_efficient_linear": False}}, "zero_optimization.memory_efficient_linear"),
    ({"zero_optimization": {"elastic_checkpoint": True}}, "zero_optimization.elastic_checkpoint"),
    ({"elasticity": {"min_time": 20}}, "elasticity.min_time"),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, "optimizer.params.torch_adam"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 8}}},
     "zero_optimization.offload_param.buffer_count"),
])
def test_keys_zero_accepts_but_does_not_read_warn_when_set(extra, path):
    with pytest.warns(ConfigWarning, match=re.escape(path) + " = .* has no effect in zero"):
        load(extra)


def test_zero_allow_untested_optimizer_warns_with_what_zero_really_runs():
    """zero runs the config's client optimizer types (and element-wise optimizer objects) without
    the key; the warning must not say it refuses them."""
    with pytest.warns(ConfigWarning, match="zero_allow_untested_optimizer = true has no effect") as record:
        load({"zero_allow_untested_optimizer": True})
    text = " ".join(str(w.message) for w in record)
    assert "refuses any other optimizer" not in text and "Adam and AdamW only" not in text
    for kind in CLIENT_OPTIMIZERS:
        assert kind in text
        load({"optimizer": {"type": kind}})  # and each one loads


def test_comm_backend_name_warns_unless_it_is_what_zero_does():
    """zero's 1-bit exchange goes through the torch.distributed group's backend, whatever the key says."""
    with pytest.warns(ConfigWarning, match="optimizer.params.comm_backend_name = \"mpi\" has no effect in zero"):
        load({"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load({"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "nccl"}}})
        load({"optimizer": {"type": "ZeroOneAdam", "params": {"comm_backend_name": "nccl"}}})
    assert "a OneBitAdam parameter" in error({"optimizer": {"type": "AdamW", "params": {"comm_backend_name": "nccl"}}})


# ----------------------------------------------------------------------------------- settings that go together
# See [Note: rules that combine settings] in zero/config/rules.py: load_config refuses them, so
# zero.initialize does before any process group, mesh or engine exists and before it slices a model.

OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("extra,kw,path,says", [
    ({"optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 1}}, {}, "zero_optimization.stage",
     "ZeroOneAdam needs ZeRO stage 0, not 1"),
    ({"optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": OFFLOAD}, {}, "zero_optimization.offload_optimizer",
     "ZeroOneAdam with offload_optimizer is not supported"),
    ({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 3}}, {}, "zero_optimization.stage",
     "OneBitAdam needs ZeRO stage 0, 1 or 2"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"compress_param_gather": True}}}, {},
     "optimizer.params.compress_param_gather", "compress_param_gather applies to ZeRO stages 1 and 2"),
    ({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 3}}, {}, "zero_optimization.stage",
     "stage 3 with a pipeline is not supported"),
    ({"zero_optimization": {"stage": 3}}, {"pipeline_stages": 2}, "zero_optimization.stage",
     "stage 3 with a pipeline is not supported"),
    ({"zero_optimization": {"stage": 3}}, {"pipeline_stages": 1}, "zero_optimization.stage",
     "stage 3 with a pipeline is not supported"),
    ({"pipeline": {"stages": 2}}, {"model_is_pipeline": False}, "pipeline.stages",
     "the model must be a zero.pipe.PipelineModule"),
    ({"optimizer": {"type": "OneBitAdam"}}, {"client_optimizer": torch.optim.SGD}, "optimizer.type",
     "OneBitAdam but initialize\\(\\) was given a SGD too"),
])
def test_settings_that_cannot_go_together_are_refused_by_load_config(extra, kw, path, says):
    with pytest.raises(ConfigError, match=says) as info:
        load(extra, world_size=2, **kw)
    assert [p for p, _ in info.value.issues] == [path]


def test_rules_about_the_model_or_optimizer_object_wait_until_the_caller_knows_it():
    """zero.tp.mesh and zero.estimate load a config without a model or optimizer: nothing is assumed."""
    load({"pipeline": {"stages": 2}}, world_size=2)  # the model may well be a PipelineModule
    load({"pipeline": {"stages": 2}}, world_size=2, model_is_pipeline=True)
    load({"pipeline": {"stages": 1}}, model_is_pipeline=False)
    load({"zero_optimization": {"stage": 3}}, model_is_pipeline=False)
    # optimizer offload steps any optimizer on the host: zero's Adam, Muon, or the object's own update
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Muon):
        load({"zero_optimization": {"stage": 2, **OFFLOAD}}, client_optimizer=cls)
        load({"optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 2, **OFFLOAD}}, client_optimizer=cls)
    load({"optimizer": {"type": "Muon"}, "zero_optimization": {"stage": 3, **OFFLOAD}})
    with pytest.raises(TypeError, match="type\\(optimizer\\)"):
        load(client_optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_an_optimizer_object_built_after_load_config_is_checked_by_the_same_rule():
    """initialize(optimizer=callable) builds the object after the model is sliced."""
    from zero.config.rules import check_optimizer_object

    check_optimizer_object(load({"zero_optimization": {"stage": 2, **OFFLOAD}}), torch.optim.SGD)
    with pytest.raises(ConfigError, match=r"OneBitAdam but initialize\(\) was given a SGD too") as info:
        check_optimizer_object(load({"optimizer": {"type": "OneBitAdam"}}), torch.optim.SGD)
    assert [p for p, _ in info.value.issues] == ["optimizer.type"]


def test_every_broken_rule_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load({"optimizer": {"type": "ZeroOneAdam"}, "fp16": {"enabled": True}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, **OFFLOAD}})
    assert [p for p, _ in info.value.issues] == ["bf16.enabled", "zero_optimization.stage",
                                                 "zero_optimization.offload_optimizer"]


@pytest.mark.parametrize("extra,path,message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio", r"ratio=0.5 \(partial offload\) is not yet supported"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio", r"partial offload"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/no/such/nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path", r"'/no/such/nvme' is not an existing directory"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path", r"is missing: offload_optimizer.device 'nvme' needs"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path", r"is missing: offload_param.device 'nvme' needs"),
    ({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 2, "mics_shard_size": 1}},
     "zero_optimization.mics_shard_size", r"with optimizer type OneBitAdam is not supported"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}},
     "zero_optimization.zero_hpz_partition_size", r"is 2: it applies to ZeRO stage 3"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}},  # one rank: no group of 2
     "zero_optimization.mics_shard_size", r"is 2: give -1 .* or a number of ranks that divides the 1 data-parallel"),
])
def test_nvme_and_partial_offload_are_refused_at_load_with_the_key_path(extra, path, message):
    with pytest.raises(ConfigError, match=message) as info:
        load(extra)
    assert [p for p, _ in info.value.issues] == [path]


def test_sub_group_size_warns_only_without_optimizer_offload():
    with pytest.warns(ConfigWarning, match="sub_group_size = 1000 has no effect without offload_optimizer"):
        load({"zero_optimization": {"stage": 3, "sub_group_size": 1000}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load({"zero_optimization": {"stage": 3, "sub_group_size": 1000, "offload_optimizer": {"device": "cpu"}}})
        load({"zero_optimization": {"stage": 3, "sub_group_size": 1e9}})
    with pytest.warns(ConfigWarning, match="sub_group_size = 0 has no effect"):  # as in some published ZeRO-3 configs
        load({"zero_optimization": {"stage": 3, "sub_group_size": 0}})
    with pytest.warns(ConfigWarning, match="sub_group_size = 0: DeepSpeed then updates each parameter as a "
                                           "sub-group of its own.*largest tile"):  # axolotl's offload configs
        load({"zero_optimization": {"stage": 3, "sub_group_size": 0, "offload_optimizer": {"device": "cpu"}}})


def test_pin_memory_without_offload_warns():
    with pytest.warns(ConfigWarning, match="offload_optimizer.pin_memory has no effect with device 'none'"):
        load({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True}}})


@pytest.mark.parametrize("extra,path", [
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"curriculum_learning": {"enabled": True}}, "curriculum_learning.enabled"),
    ({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}}, "zero_optimization.zeropp_loco_param"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training"),
])
def test_unimplemented_math_changing_feature_is_error(extra, path):
    msg = error(extra)
    assert path in msg and "zero does not implement" in msg


@pytest.mark.parametrize("section", ["wandb", "comet", "flops_profiler", "comms_logger"])  # csv_monitor, tensorboard: zero/events.py
def test_logging_feature_is_only_a_warning(section):
    with pytest.warns(ConfigWarning, match=f"{section}.enabled.*ignored"):
        load({section: {"enabled": True, "output_path": "x"}})


def test_disabled_unimplemented_features_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load({"amp": {"enabled": False}, "tensorboard": {"enabled": False}, "sparse_gradients": False,
              "zero_optimization": {"zero_hpz_partition_size": 1}})


def test_docs_reproduce_the_table_row_by_row():
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "config.md").read_text()
    for row in UNIMPLEMENTED_FEATURES:
        kind = "**error**" if row.kind == "error" else "warning"
        found = re.search(rf"^\| `{re.escape(row.path)}` \| {re.escape(kind)} \| [^|]+ \| (.*) \|$", docs, re.M)
        assert found and found.group(1) == row.reason, f"docs/config.md: the row of {row.path} is missing or differs"


def test_huggingface_zero3_example_config_loads():
    """The ZeRO-3 config from HF's DeepSpeed docs, "auto" everywhere."""
    hf = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                              "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(hf, world_size=2, auto_values={"train_micro_batch_size_per_gpu": 4, "bf16.enabled": True,
                                                         "scheduler.params.warmup_num_steps": 50})
    assert cfg.precision == "bf16" and cfg.train_batch_size == 8
    assert cfg.zero_optimization.offload_param.pin_memory and cfg.steps_per_print == 2000
    assert cfg.scheduler.params.warmup_num_steps == 50


def test_bucket_keys_that_stage_3_does_not_use_warn():
    with pytest.warns(ConfigWarning, match="reduce_bucket_size has no effect at stage 3"):
        load({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}})
    with pytest.warns(ConfigWarning, match="reduce_scatter = false has no effect at stage 3"):
        load({"zero_optimization": {"stage": 3, "reduce_scatter": False}})
    with pytest.warns(ConfigWarning, match="allgather_bucket_size has no effect at stage 3"):
        load({"zero_optimization": {"stage": 3, "allgather_bucket_size": 1000}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load({"zero_optimization": {"stage": 2, "reduce_scatter": False, "allgather_bucket_size": 1000}})

"""Every public name of DeepSpeed 0.19.8's modules imports from zero.deepspeed (see [Note: the name list]
in zero/deepspeed/_missing.py): zero's own object, DeepSpeed's constant, or a stand-in that says why
when used; except in the packages of a feature zero lacks altogether (see [Note: the feature table] in
zero/features.py), whose modules raise ImportError with the reason, so that `try: import` probes take
the right branch. DeepSpeed itself is not needed: the names come from zero/deepspeed/public_names.txt."""
import ast
import importlib
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zero.deepspeed as deepspeed
from zero.deepspeed._missing import (
    ABSENT_NAMES,
    ABSENT_PACKAGES,
    GENERAL_REASON,
    NotAvailableError,
    _absent_feature,
    _own_paths,
    _StandIn,
    deepspeed_modules,
    engine_members,
    missing,
)

# zero's files for these DeepSpeed modules do not end with the `__getattr__` fallback yet (their owners
# are adding it): the names they do not define are not checked until then
LACKING_FALLBACK: set[str] = set()


def resolve_every_name() -> tuple[Counter, list[str]]:
    """Import every listed module from zero.deepspeed and get every listed name; count what each name
    is (zero's own, a constant, a stand-in, ...) and describe every one that is wrong."""
    counts, wrong = Counter(), []
    for path, names in deepspeed_modules().items():
        if path not in _own_paths() and _absent_feature(path) is not None:  # a feature zero lacks altogether
            try:
                importlib.import_module(f"zero.{path}")
                wrong.append(f"{path}: imports, though zero has nothing of it")
            except ImportError as e:
                counts["absent module"] += 1
                if f"is not available in zero: {_absent_feature(path)}" not in str(e):
                    wrong.append(f"{path}: says {e}")
            continue
        module = importlib.import_module(f"zero.{path}")
        if path in _own_paths() and "__getattr__" not in vars(module):
            wrong += [] if path in LACKING_FALLBACK else [f"zero/{path.replace('.', '/')}: no __getattr__ fallback"]
            names = {n: listed for n, listed in names.items() if n in vars(module)}
        for name, listed in names.items():
            try:
                value = getattr(module, name)
            except AttributeError as e:  # a module alias of a feature zero lacks is not there (hasattr is False)
                if listed.kind == "module" and _absent_feature(listed.value) is not None and \
                        f"is not available in zero: {_absent_feature(listed.value)}" in str(e):
                    counts["absent module"] += 1
                else:
                    wrong.append(f"{path}.{name}: {type(e).__name__}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                wrong.append(f"{path}.{name}: {type(e).__name__}: {e}")
                continue
            if isinstance(value, _StandIn):
                counts["stand-in"] += 1
                try:
                    value()
                    wrong.append(f"{path}.{name}: a stand-in that does not raise when called")
                except NotAvailableError as e:
                    if f"{name} is not available in zero: " not in str(e):
                        wrong.append(f"{path}.{name}: says {e}")
                ok = listed.kind in ("class", "function", "value")
            elif name in vars(module) or value is not missing(path, name):  # zero's file answers for it
                counts["zero's own"] += 1
                ok = listed.kind not in ("class", "function") or callable(value)
            elif listed.kind == "constant":
                counts["constant"] += 1
                ok = value == listed.value and type(value) is type(listed.value)
            elif listed.kind == "module":
                counts["module"] += 1
                ok = value is importlib.import_module(f"zero.{listed.value}")
            elif listed.kind == "logger":
                counts["logger"] += 1
                ok = isinstance(value, logging.Logger)
            else:  # a re-export of zero's own object
                counts["zero's own"] += 1
                ok = listed.kind in ("class", "function") and callable(value)
            if not ok:
                wrong.append(f"{path}.{name}: listed as {listed}, got {value!r}")
    return counts, wrong


def test_every_public_name_of_deepspeed_imports_from_zero_deepspeed():
    modules = deepspeed_modules()
    assert len(modules) > 700 and sum(map(len, modules.values())) > 9000  # DeepSpeed 0.19.8: 750 and 10,218
    counts, wrong = resolve_every_name()
    assert not wrong, "\n".join(wrong)
    assert counts["zero's own"] > 500 and counts["constant"] > 1500 and counts["stand-in"] > 1000, counts
    assert counts["absent module"] > 300, counts  # DeepSpeed 0.19.8: 406 modules of 20 features zero lacks
    # a second pass finds the same objects: importing every module rebound none of the names
    assert not resolve_every_name()[1]

    assert deepspeed.utils.z3_leaf_module(nn.Linear(1, 1)) is False and isinstance(deepspeed.utils.tensor_fragment, _StandIn)
    with pytest.raises(ImportError, match="deepspeed.compile is not available in zero: DeepCompile"):
        from zero.deepspeed.compile import custom_ops  # noqa: F401

    # a module DeepSpeed has and zero lacks is a module of stand-ins, whatever zero's file above it does
    # (zero.deepspeed.comm forwards unknown names, __path__ too, to torch.distributed)
    from zero.deepspeed.comm import utils as comm_utils

    assert not hasattr(comm_utils, "__file__") and "get_caller_func" in dir(comm_utils)
    with pytest.raises(NotAvailableError, match=f"deepspeed.comm.utils.get_caller_func is not available in zero: "
                                                f"{GENERAL_REASON}"):
        comm_utils.get_caller_func()
    with pytest.raises(ImportError, match="deepspeed.moe is not available in zero: expert parallel"):
        from zero.deepspeed.moe.layer import MoE  # noqa: F401 - a probe takes the ImportError branch
    assert not hasattr(deepspeed, "moe")

    # a re-exported name is zero's own object where zero has it, and says why where it has not
    assert deepspeed.runtime.zero.partition_parameters.init_distributed is deepspeed.comm.init_distributed
    assert deepspeed.checkpoint.get_model_ckpt_name_for_rank is deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank
    with pytest.raises(NotAvailableError, match="deepspeed.ops.DeepSpeedTransformerLayer is not available in zero: "
                                                "DeepSpeed's fused transformer layers"):
        deepspeed.ops.DeepSpeedTransformerLayer()
    assert deepspeed.checkpointing.model_parallel_cuda_manual_seed is not None  # deepspeed.checkpointing is an alias

    # anything else fails at once
    for owner, name in ((deepspeed, "no_such_thing"), (deepspeed.utils, "loger"), (deepspeed.runtime.utils, "no_util"),
                        (deepspeed.utils, "_private"), (deepspeed.comm.utils, "no_such_function")):
        with pytest.raises(AttributeError, match="not part of zero's DeepSpeed compatibility layer|_private"):
            getattr(owner, name)
    with pytest.raises(ImportError):
        importlib.import_module("zero.deepspeed.moe.no_such_module")
    with pytest.raises(ImportError):
        importlib.import_module("zero.deepspeed.comm.distributed_c10d")  # torch.distributed's, not DeepSpeed's

    # every specific reason is about a name or package DeepSpeed 0.19.8 has (or one of the 1-bit optimizers,
    # which it no longer has and which zero runs from the config)
    for package in ABSENT_PACKAGES:
        assert package in modules, package
    for full in ABSENT_NAMES:
        module, _, name = full.rpartition(".")
        assert name in modules.get(module, {}) or "onebit" in module, full


def test_no_file_of_zero_deepspeed_uses_a_name_that_a_deepspeed_submodule_takes():
    """Importing `deepspeed.utils.torch` binds `torch` on zero.deepspeed.utils, as on DeepSpeed's package:
    a file of zero's for a DeepSpeed package must not use such a name for something else (`import torch`)."""
    children: dict[str, set[str]] = {}
    for path in deepspeed_modules():
        parent, _, child = path.rpartition(".")
        children.setdefault(parent, set()).add(child)
    clashes = []
    for path in sorted(_own_paths() & children.keys()):
        file = Path(importlib.import_module(f"zero.{path}").__file__)
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zero.deepspeed"):
                    continue  # a module of the compatibility layer, under its DeepSpeed name
                bound = {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bound = {node.name}
            elif isinstance(node, ast.Assign):
                bound = {t.id for t in node.targets if isinstance(t, ast.Name)}
            else:
                continue
            clashes += [f"{file}:{node.lineno}: {name}" for name in bound & children[path]
                        if deepspeed_modules()[path].get(name) is None]  # DeepSpeed's own binding is fine
    assert not clashes, clashes


def test_the_names_that_failed_at_import():
    from zero.deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank
    from zero.deepspeed.ops import __compatible_ops__, op_builder
    from zero.deepspeed.runtime.zero import parameter_offload
    from zero.deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles
    from zero.deepspeed.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix
    from zero.ops import builder

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    found, absent = set_z3_leaf_modules_by_name(model, ["1", "no.such", "0"], raise_if_not_found=False)
    assert found == [model[1], model[0]] and absent == ["no.such"]
    assert deepspeed.utils.get_z3_leaf_modules(model) == [model[0], model[1]]
    with pytest.raises(ValueError, match=r"no module named \['no.such'\]"):
        set_z3_leaf_modules_by_name(model, ["no.such"])
    assert set_z3_leaf_modules_by_name(model, ["1"], flag=False) == ([model[1]], [])
    assert set_z3_leaf_modules_by_suffix(model, ["1.0", "0"]) == ([model[1][0], model[0]], [])
    assert deepspeed.utils.get_z3_leaf_modules(model) == [model[0], model[1][0]]

    with pytest.raises(NotAvailableError, match="MultipleAllGatherHandles is not available in zero: zero's stage-3 "
                                                "gathers have finished when they return"):
        MultipleAllGatherHandles([])
    assert not isinstance(object(), parameter_offload.DeepSpeedZeRoOffload)
    assert parameter_offload.Init is deepspeed.zero.Init  # DeepSpeed's re-export there, zero's object

    assert get_model_ckpt_name_for_rank("ckpt/step1", "00") == "ckpt/step1/mp_rank_00_model_states.pt"
    assert get_zero_ckpt_name_for_rank("ckpt", 3, 1) == "ckpt/zero_pp_rank_3_mp_rank_01_optim_states.pt"

    # DeepSpeed's op names (async_io, ..., transformer_inference): what zero can run here
    assert __compatible_ops__ is deepspeed.ops.__compatible_ops__ and len(__compatible_ops__) == 27
    assert {op.NAME for op in map(vars(op_builder).get, op_builder.BUILDERS)} == __compatible_ops__.keys()
    assert __compatible_ops__["cpu_adam"] == (builder.missing("cpu_adam") is None) == op_builder.CPUAdamBuilder().is_compatible()
    # without a CUDA GPU, FusedAdam steps host tensors with the CPU Adam (DeepSpeed's CPU accelerator builds one too)
    host = "fused_adam" if torch.cuda.is_available() else "cpu_adam"
    assert __compatible_ops__["fused_adam"] == (builder.missing(host) is None)
    assert __compatible_ops__["cpu_lion"] and __compatible_ops__["fused_lion"]  # zero's Lion is torch code
    assert not any(v for k, v in __compatible_ops__.items() if k not in ("cpu_adam", "fused_adam", "cpu_lion", "fused_lion"))


def test_deepspeed_engine_members_are_listed_for_coverage():
    members = engine_members()
    assert len(members) == 175 and set(members.values()) <= {"method", "property", "staticmethod", "classmethod", "value"}
    assert members["backward"] == "method" and members["train_batch_size"] == "method" and "forward" not in members

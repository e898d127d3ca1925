"""Real DeepSpeed configs: every public config of tests/configs/ds_corpus/ (where each comes from:
SOURCES.md there) trains 2 optimizer steps of a tiny model on 1 and on 2 ranks, or is refused at
load by one ConfigError that names the key. None loads and then fails in a step, and every warning
is given once.

A config is used the way its users use it: one with "auto" values, or from a project whose users
train through HuggingFace's Trainer (transformers, accelerate, LLaMA-Factory, axolotl, LLaVA,
FastChat, Alpaca), has its "auto" values filled as the Trainer fills them
(zero.integrations.hf.resolve_auto, from TrainingArguments that agree with the config); OpenRLHF's
gets the two batch keys its trainer adds; the others go to `initialize` as they are. A config
without an optimizer section gets a client torch.optim.AdamW, as the scripts that use them pass.
An `nvme_path` (a drive of its author's machine) becomes a directory of this machine's, as its
user would set it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import torch

CORPUS = Path(__file__).parent / "configs" / "ds_corpus"
NAMES = sorted(p.stem for p in CORPUS.glob("*.json"))
HF_TRAINER = ("hf_transformers", "accelerate", "llamafactory", "axolotl", "llava", "fastchat", "stanford_alpaca")

# Refused on every world size: the file -> (the key the error names, a fragment of its reason).
REFUSED = {
    "deepspeed_autotuning__template_zero3": ("train_batch_size", "batch size not given"),  # the autotuner fills it
    "deepspeed_docs__monitor_tutorial": ("train_batch_size", "batch size not given"),  # a tutorial's fragment
    "deepspeed_tests__deepspeed_bsz24_fp16_eigenvalue_quantize_config": ("eigenvalue.enabled", "MoQ"),
    "dsexamples_bing_bert__deepspeed_bsz4k_progressive_layer_drop_config_seq128":
        ("progressive_layer_drop.enabled", "layers would be skipped"),
    "dsexamples_bing_bert__deepspeed_bsz64k_lamb_config_seq128": ("optimizer.type", "use AdamW"),
    "dsexamples_bing_bert__deepspeed_bsz64k_onebitlamb_config_seq128_nccl": ("optimizer.type", "use AdamW"),
    "dsexamples_cifar__ds_config": ("fp16.fp16_master_weights_and_grads", "master weights and their gradients"),
    # DeepSpeed refuses these two as well: misspelt and removed keys in a Megatron example
    "dsexamples_megatron_zero3__ds_zero_stage_3_config_release":
        ("zero_optimization.stage3_param_persitance_threshold", "did you mean 'stage3_param_persistence_threshold'"),
    "dsexamples_megatron_zero3__ds_zero_stage_infinity_config":
        ("zero_optimization.stage3_param_persitence_threshold", "did you mean 'stage3_param_persistence_threshold'"),
    "dsexamples_moq__test": ("quantize_training.enabled", "MoQ"),
    # HF's NVMe example puts `aio` inside zero_optimization; DeepSpeed refuses it there too
    "hf_transformers_docs__zero3_nvme_offload":
        ("zero_optimization.aio", "'aio' is a section at the top level of the config"),
    # a batch for 16 data-parallel ranks; DeepSpeed refuses it on fewer too
    "megatron_deepspeed__ds_config": ("train_batch_size", "must equal train_micro_batch_size_per_gpu"),
    # DeepSpeed 0.19.8 refuses both keys too ("bfp16" is not one of its names; bf16 has no loss scale)
    "megatron_deepspeed__ds_zero2_config_bf16": ("communication_data_type", "got 'bfp16'"),
}
# Refused on one world size only: (file, world size) -> as above.
REFUSED_AT = {
    # a whole batch per rank on one rank: two ranks cannot split it
    ("dsexamples_compression_cifar__ds_config", 2): ("gradient_accumulation_steps", "32 * 2 = 64"),
    ("megatron_deepspeed_universal_checkpointing__ds_config", 2): ("gradient_accumulation_steps", "16 * 2 = 32"),
    ("llamafactory__ds_z2_autotp_config", 1): ("tensor_parallel.size", "not a multiple of 2"),
    # AutoTP slices HuggingFace GPT-2 and Llama models; the tiny model here is neither
    ("llamafactory__ds_z2_autotp_config", 2): ("tensor_parallel.size", "no parameter of the Sequential is sliced"),
}


def _enabled(cfg: dict, *names: str, auto: bool = False) -> bool:
    """Whether a precision section is on (`auto`: what an "auto" there becomes)."""
    return any(isinstance(cfg.get(n), dict) and cfg[n].get("enabled") in ((True, "auto") if auto else (True,))
               for n in names)


def _as_used(name: str, world_size: int, auto_bf16: bool = False, raw: dict | None = None) -> dict:
    """The config as its users' launcher hands it to `initialize` (see the module's docstring);
    `auto_bf16`: TrainingArguments(bf16=True), which an "auto" bf16.enabled follows; `raw`: the
    file's config changed by hand."""
    from zero.integrations.hf import resolve_auto
    from zero.parallel.dims import ParallelDims

    raw = _local_nvme(raw or _read(name))
    if name.startswith("openrlhf__"):  # its trainer adds the batch keys to what get_train_ds_config returns
        return {**raw, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world_size}
    if not (name.startswith(HF_TRAINER) or '"auto"' in json.dumps(raw)):
        return raw
    number = lambda v, default: v if isinstance(v, (int, float)) and not isinstance(v, bool) else default  # noqa: E731
    opt = (raw.get("optimizer") or {}).get("params") or {}
    betas = opt.get("betas") if isinstance(opt.get("betas"), list) else [0.9, 0.999]
    args = types.SimpleNamespace(
        per_device_train_batch_size=number(raw.get("train_micro_batch_size_per_gpu"), 2),
        gradient_accumulation_steps=number(raw.get("gradient_accumulation_steps"), 1),
        max_grad_norm=number(raw.get("gradient_clipping"), 1.0), fp16=_enabled(raw, "fp16"),
        bf16=_enabled(raw, "bf16", "bfloat16", auto=auto_bf16), optim="adamw_torch", learning_rate=number(opt.get("lr"), 1e-3),
        adam_beta1=betas[0], adam_beta2=betas[1], adam_epsilon=number(opt.get("eps"), 1e-8),
        weight_decay=number(opt.get("weight_decay"), 0.0), get_warmup_steps=lambda steps: 1)
    tp = (raw.get("tensor_parallel") or {}).get("autotp_size", 1)
    batch = ParallelDims(world_size, tp=tp).size("batch") if world_size % tp == 0 else world_size
    return resolve_auto(raw, args, None, 10, batch)


def _read(name: str) -> dict:
    return json.loads((CORPUS / f"{name}.json").read_text())


def _local_nvme(cfg):
    """The config with each `nvme_path` set to the working directory (a scratch directory)."""
    if isinstance(cfg, dict):
        return {k: os.getcwd() if k == "nvme_path" else _local_nvme(v) for k, v in cfg.items()}
    return cfg


def _train(names: list[str], auto_bf16: bool = False) -> dict[str, tuple]:
    """On every rank: each config's outcome, ("trained", steps, finite, warnings) or ("refused",
    paths, message); `auto_bf16`: train the configs whose bf16 is "auto" in bf16 (see `_as_used`)."""
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out = {}
    home = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)  # monitors write relative to the working directory
        try:
            for name in names:
                out[name] = _train_one(name, world_size, auto_bf16)
        finally:
            os.chdir(home)
    return out


def _train_one(name: str, world_size: int, auto_bf16: bool, raw: dict | None = None) -> tuple:
    import zero
    from zero.config import ConfigWarning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = _as_used(name, world_size, auto_bf16, raw)
            client = None if config.get("optimizer") else torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine, *_ = zero.initialize(model=model, optimizer=client, config=config)
        except zero.ConfigError as err:
            return ("refused", [p for p, _ in err.issues], str(err))
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(engine.config.precision, torch.float32)
        for _ in range(2 * engine.config.gradient_accumulation_steps):
            x = torch.randn(engine.config.train_micro_batch_size_per_gpu, 8, dtype=dtype)
            engine.backward(engine(x).float().square().mean())
            engine.step()
        finite = all(torch.isfinite(p.detach().float()).all() for p in engine.module.parameters())
        steps = engine.global_steps
        engine.destroy()
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    return ("trained", steps, finite, messages)


def _tensorboard(name: str) -> bool:
    raw = json.loads((CORPUS / f"{name}.json").read_text())
    return isinstance(raw.get("tensorboard"), dict) and raw["tensorboard"].get("enabled") is True


# Without the tensorboard package a config that enables it is refused at load naming the key (DeepSpeed
# raises ImportError then); with it, it trains and writes its events (into a temporary directory).
NO_TENSORBOARD = importlib.util.find_spec("tensorboard") is None


def _check(outcomes: dict, world_size: int) -> None:
    problems = []
    for name, outcome in outcomes.items():
        refused = REFUSED.get(name) or REFUSED_AT.get((name, world_size))
        if NO_TENSORBOARD and _tensorboard(name):
            refused = ("tensorboard", "pip install tensorboard")
        if refused is not None:
            key, fragment = refused
            if outcome[0] != "refused" or key not in outcome[1] or fragment not in outcome[2]:
                problems.append(f"{name}: expected a refusal naming {key} ({fragment!r}), got {outcome}")
        elif outcome[0] != "trained":
            problems.append(f"{name}: refused on {world_size} rank(s): {outcome[2]}")
        else:
            _, steps, finite, messages = outcome
            if steps != 2 or not finite:
                problems.append(f"{name}: {steps} optimizer steps (expected 2), finite parameters: {finite}")
            if len(messages) != len(set(messages)):
                problems.append(f"{name}: a warning given twice: {messages}")
    assert not problems, "\n".join(problems)


def test_the_corpus_is_large_and_its_sources_are_listed():
    sources = (CORPUS / "SOURCES.md").read_text()
    assert len(NAMES) >= 30
    missing = [n for n in NAMES if f"`{n}.json`" not in sources]
    assert not missing, f"not in SOURCES.md: {missing}"
    for name in [*REFUSED, *(n for n, _ in REFUSED_AT)]:
        assert name in NAMES, name


def test_every_config_trains_or_is_refused_by_key_on_one_rank():
    """On one rank as a Trainer user with bf16=True runs them; on two (below) as one in fp32."""
    _check(_train(NAMES, auto_bf16=True), 1)


def test_every_config_trains_or_is_refused_by_key_on_two_ranks(dist_run):
    outcomes = dist_run(2, _train, NAMES, timeout=900)
    assert outcomes[0] == outcomes[1]
    _check(outcomes[0], 2)


def test_the_nvme_configs_train_once_the_keys_deepspeed_refuses_are_fixed(tmp_path, monkeypatch):
    """The two NVMe configs are refused for keys DeepSpeed refuses too; fixed, they train with the
    optimizer state on NVMe, and the Megatron one (max_in_cpu 1) with the parameter shards there."""
    monkeypatch.chdir(tmp_path)
    hf = _read("hf_transformers_docs__zero3_nvme_offload")
    hf["aio"] = hf["zero_optimization"].pop("aio")
    megatron = _read("dsexamples_megatron_zero3__ds_zero_stage_infinity_config")
    zc = megatron["zero_optimization"]
    zc["stage3_param_persistence_threshold"] = zc.pop("stage3_param_persitence_threshold")
    zc["stage3_param_persistence_threshold"] = 0  # the tiny model's weights are units, not persistent
    for name, raw in (("hf_transformers_docs__zero3_nvme_offload", hf),
                      ("dsexamples_megatron_zero3__ds_zero_stage_infinity_config", megatron)):
        outcome = _train_one(name, 1, False, raw)
        assert outcome[:3] == ("trained", 2, True), outcome
    assert not list(tmp_path.iterdir())  # the swap files went with the engines


@pytest.mark.parametrize("key, value", [("_comment", "a note"), ("comment", "x")])
def test_a_comment_key_is_ignored_quietly(key, value):
    from zero.config import load_config

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"train_batch_size": 2, key: value})


def test_an_unknown_top_level_key_is_ignored_with_a_warning_naming_it_and_a_near_miss_is_an_error():
    from zero.config import ConfigError, ConfigWarning, load_config

    with pytest.warns(ConfigWarning, match="'cuda_visible_devices' is not a DeepSpeed key zero knows; it is "
                                           "ignored, as DeepSpeed ignores unknown top-level keys"):
        load_config({"train_batch_size": 2, "cuda_visible_devices": "0"})
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        load_config({"train_batch_size": 2, "gradient_clippin": 1.0})
    with pytest.raises(ConfigError, match="did you mean 'zero_optimization.stage'"):
        load_config({"train_batch_size": 2, "stage": 2})

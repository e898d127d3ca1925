"""HuggingFace Trainer on zero: `ZeroTrainer(model, args, ..., zero_config=...)`.

    from zero.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          zero_config="ds_config_zero3.json")
    trainer.train()

[Note: Trainer on zero]
Trainer's loop runs as it is; four of its methods hand the work to a zero engine:
- `_prepare_for_training` builds the engine (once the number of steps is known, so "auto"
  scheduler values resolve) instead of letting accelerate wrap the model in DDP: the engine's
  hooks reduce gradients.
- `training_step` runs the forward, `engine.backward` (the fp16 loss scale; the step divides
  by the accumulation steps) and `engine.step()` for every micro-batch; the engine updates at the accumulation boundary, which
  Trainer's own counting reaches at the same micro-batch.
- Trainer's `optimizer.step()` and `lr_scheduler.step()` become views that do nothing: the engine
  stepped already, and it steps the scheduler only on real (not skipped) updates. The norm
  Trainer logs is the engine's global norm over all shards, measured before clipping.
- Checkpoints: `checkpoint-N/zero/` is a zero training checkpoint (docs/checkpoint.md), so
  `resume_from_checkpoint` also works on another world size; `save_model` gathers the model on
  every rank and writes safetensors from rank 0.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

try:
    import transformers
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - the message is what matters
    raise ImportError("zero.integrations.hf needs transformers and accelerate: pip install 'zero[hf]' "
                      "(or pip install transformers accelerate)") from exc

import zero

CHECKPOINT_TAG = "zero"


class ConfigMismatch(ValueError):
    """The zero config sets values that contradict TrainingArguments."""


def _hidden_size(model) -> int | None:
    config = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def resolve_auto(config: dict | str | os.PathLike, args, model, num_training_steps: int, world_size: int) -> dict:
    """A zero config with HF's "auto" values filled from TrainingArguments and the model, as
    HuggingFace resolves them for DeepSpeed. Raises ConfigMismatch listing every non-auto value that
    contradicts the arguments."""
    cfg = json.loads(Path(config).read_text()) if isinstance(config, (str, os.PathLike)) else json.loads(json.dumps(config))
    mismatches: list[str] = []

    def fill(section: dict, key: str, value: Any, path: str) -> None:
        if section.get(key) == "auto" or key not in section:
            section[key] = value
        elif section[key] != value and value is not None:
            mismatches.append(f"{path}={section[key]!r} but TrainingArguments give {value!r}")

    def fill_only(section: dict, key: str, value: Any) -> None:
        if section.get(key, "auto") == "auto":
            section[key] = value

    optim = getattr(args.optim, "value", args.optim)
    if "optimizer" not in cfg and "adam" not in str(optim).lower():
        mismatches.append(f"TrainingArguments.optim={optim!r} but zero trains with Adam/AdamW only")
    micro, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill(cfg, "train_micro_batch_size_per_gpu", micro, "train_micro_batch_size_per_gpu")
    fill(cfg, "gradient_accumulation_steps", ga, "gradient_accumulation_steps")
    fill(cfg, "train_batch_size", micro * ga * world_size, "train_batch_size")
    fill(cfg, "gradient_clipping", float(args.max_grad_norm), "gradient_clipping")
    for name, flag in (("fp16", args.fp16), ("bf16", args.bf16)):
        section = cfg.setdefault(name, {})
        fill(section, "enabled", bool(flag), f"{name}.enabled")
    opt = cfg.setdefault("optimizer", {"type": "AdamW"})
    params = opt.setdefault("params", {})
    fill(params, "lr", args.learning_rate, "optimizer.params.lr")
    fill(params, "betas", [args.adam_beta1, args.adam_beta2], "optimizer.params.betas")
    fill(params, "eps", args.adam_epsilon, "optimizer.params.eps")
    fill(params, "weight_decay", args.weight_decay, "optimizer.params.weight_decay")
    sched = cfg.get("scheduler")
    if sched is not None:
        sp = sched.setdefault("params", {})
        if sched.get("type") in ("WarmupLR", "WarmupDecayLR"):  # as HF: these three are only filled
            fill_only(sp, "warmup_min_lr", 0)
            fill(sp, "warmup_max_lr", args.learning_rate, "scheduler.params.warmup_max_lr")
            fill_only(sp, "warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)))
        if sched.get("type") == "WarmupDecayLR":
            fill_only(sp, "total_num_steps", max(1, num_training_steps))
    zc = cfg.setdefault("zero_optimization", {})
    hidden = _hidden_size(model)
    for key, value in (("reduce_bucket_size", None if hidden is None else hidden * hidden),
                       ("stage3_prefetch_bucket_size", None if hidden is None else int(0.9 * hidden * hidden)),
                       ("stage3_param_persistence_threshold", None if hidden is None else 10 * hidden)):
        if zc.get(key) == "auto":
            if value is None or (key == "reduce_bucket_size" and zc.get("stage") == 3):  # no effect at stage 3
                del zc[key]  # zero's default
            else:
                zc[key] = value
    if mismatches:
        raise ConfigMismatch("the zero config contradicts TrainingArguments: " + "; ".join(mismatches)
                             + ". Set these keys to \"auto\" or to the same values.")
    return cfg


class _OptimizerView:
    """What Trainer calls `self.optimizer`: its step and zero_grad do nothing (the engine steps
    in `training_step`); hyperparameters and state are the engine's optimizer's."""

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def state(self):
        return self.optimizer.state

    @property
    def step_was_skipped(self) -> bool:  # read by accelerate's optimizer_step_was_skipped
        return self.engine.progress.last_step_skipped

    def step(self, closure=None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _SchedulerView:
    """What Trainer calls `self.lr_scheduler`: the engine steps the real one on real updates."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _refuse_model_parallel(raw: dict) -> None:
    from zero.config.parallel import PipelineConfig, TensorParallelConfig

    tensor = TensorParallelConfig.model_validate(raw.get("tensor_parallel") or {}).size
    stages = PipelineConfig.model_validate(raw.get("pipeline") or {}).stages or 1
    if tensor > 1 or stages > 1:
        raise ValueError(f"ZeroTrainer trains with ZeRO data parallelism only, but the config asks for tensor_parallel."
                         f"size {tensor} and pipeline.stages {stages}: Trainer's sampler gives every rank its own "
                         f"batches, while the ranks of one tensor or pipeline group must share theirs. Train those "
                         f"with zero.initialize (docs/parallelism.md)")


class ZeroTrainer(Trainer):
    """`transformers.Trainer` whose model trains with a zero engine; see [Note: Trainer on zero].

    Args:
        zero_config: a DeepSpeed-style config dict or JSON path; HF's "auto" values are resolved
            from the TrainingArguments and the model.
        *args, **kwargs: as for `transformers.Trainer`.
    """

    def __init__(self, *args, zero_config: dict | str | os.PathLike, **kwargs):
        _refuse_model_parallel(_raw(zero_config))
        super().__init__(*args, **kwargs)
        self.zero_config = zero_config
        self.engine = None

    # -- building the engine ---------------------------------------------------------------------

    def _ensure_engine(self, max_steps: int) -> None:
        """Build the engine (once), and a schedule for `max_steps` (for every `train()`, as Trainer does)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        cfg = resolve_auto(self.zero_config, self.args, self.model, max(1, max_steps), world)
        if self.engine is None:
            # no optimizer section: Trainer's AdamW, with Trainer's no-decay group
            groups = self._trainer_param_groups() if "optimizer" not in _raw(self.zero_config) else None
            self.engine, *_ = zero.initialize(model=self.model, model_parameters=groups, config=cfg)
            _sync_generate(self.model, self.engine)
        if cfg.get("scheduler") is not None:
            from zero.lr_schedules import build_scheduler

            self.engine.lr_scheduler = build_scheduler(cfg["scheduler"]["type"], dict(cfg["scheduler"].get("params", {})),
                                                       self.engine.optimizer)
        else:  # Trainer's own schedule (lr_scheduler_type, warmup), over the engine's optimizer
            self.lr_scheduler = None
            self.engine.lr_scheduler = self.create_scheduler(max(1, max_steps), optimizer=self.engine.optimizer)
        self._lr_of_step = None

    def _trainer_param_groups(self) -> list[dict]:
        """Trainer's two groups: weight decay except for biases and norm weights."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return [g for g in ({"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}) if g["params"]]

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self._ensure_engine(max_steps)
        self.optimizer = _OptimizerView(self.engine)
        self.lr_scheduler = _SchedulerView(self.engine.lr_scheduler)
        self._created_lr_scheduler = False
        self.accelerator._optimizers = [self.optimizer]  # optimizer_step_was_skipped reads it
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self.engine.load_checkpoint(resume_from_checkpoint, tag=CHECKPOINT_TAG)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        pass  # the engine loads the model with everything else, from checkpoint-N/zero

    def evaluate(self, *args, **kwargs):
        self._ensure_model_usable()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._ensure_model_usable()
        return super().predict(*args, **kwargs)

    def _ensure_model_usable(self) -> None:
        """A model built sharded (zero.Init, our from_pretrained) needs the engine before any forward."""
        if self.engine is None and any(getattr(p, "_zero", None) is not None for p in self.model.parameters()):
            self._ensure_engine(self.args.max_steps if self.args.max_steps > 0 else 1)

    def _wrap_model(self, model, training=True, dataloader=None):
        return model  # no DDP: the engine reduces gradients

    # -- the step ----------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.engine
        ga = engine.gradient_accumulation_steps()
        if self.accelerator.sync_gradients and not engine.is_gradient_accumulation_boundary():
            # Trainer ends a window early (the last, shorter one of an epoch): so does the engine
            engine.set_gradient_accumulation_boundary(True)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled_for_ga = self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else \
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        # the engine divides by `ga`; Trainer by the micro-batches of this window (fewer in a short one),
        # or not at all when the loss is normalised by the items of the whole window
        self.engine.backward(loss * (ga if scaled_for_ga else ga / self.current_gradient_accumulation_steps))
        if self.engine.is_gradient_accumulation_boundary():
            self._lr_of_step = self.engine.get_lr()[0]  # Trainer logs the lr the update used
        self.engine.step()
        return (loss if scaled_for_ga else loss / self.current_gradient_accumulation_steps).detach()

    def _clip_grad_norm(self, model):
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else norm

    def _get_learning_rate(self) -> float:
        lr = getattr(self, "_lr_of_step", None)
        return lr if lr is not None else self.engine.get_lr()[0]

    # -- saving and resuming -------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Gather the model (every rank takes part) and write it with `save_pretrained` (safetensors)
        from rank 0."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._ensure_model_usable()
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state = self.engine.consolidated_16bit_state_dict()
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG, save_latest=False)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        pass  # loaded with the engine in _prepare_for_training

    def _save_scaler(self, output_dir) -> None:
        pass  # fp16 loss scaling is the engine's, in its checkpoint

    def _load_scaler(self, checkpoint) -> None:
        pass


def from_pretrained(cls, path: str | os.PathLike, zero_config: dict | str | os.PathLike | None = None, **kwargs):
    """`cls.from_pretrained(path)` for ZeRO-3 without the whole model on any rank: the model is built
    under `zero.Init` (each parameter sharded as its module is made) and each rank fills its shards
    from the safetensors files one tensor at a time.

    Args:
        cls: a transformers model class (`AutoModelForCausalLM` works too).
        path: a local directory with `config.json` and `model.safetensors` (or shards + index).
        zero_config: the config the engine will use (given to `zero.Init`).
        **kwargs: passed to the config (`AutoConfig.from_pretrained`).
    """
    from safetensors import safe_open

    from zero.partition.shards import take_shard

    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(path, **kwargs)
    try:  # the weights come from the files: skip HF's initialisation (which would index empty shards)
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with zero.Init(config=zero_config), no_init_weights():
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
        model.tie_weights()  # no_init_weights skips the tying too
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    missing = set(params)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with torch.no_grad():
        for name in files:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    if key in params:
                        p = params[key]
                        z = getattr(p, "_zero", None)
                        value = f.get_tensor(key)  # one tensor at a time
                        if z is None:
                            p.copy_(value)
                        else:
                            z.shard().copy_(take_shard(value.to(z.shard().dtype), rank, world))
                        missing.discard(key)
                    elif key in buffers:
                        buffers[key].copy_(f.get_tensor(key))
    tied = {n for n in missing if any(params[n] is q for m, q in params.items() if m not in missing)}
    if missing - tied:
        raise ValueError(f"{path}: no weights for {sorted(missing - tied)[:8]}")
    model.eval()
    return model


def _raw(config) -> dict:
    return json.loads(Path(config).read_text()) if isinstance(config, (str, os.PathLike)) else config


def _sync_generate(model, engine) -> None:
    """Under stage 3 on several ranks every rank must run the same forward passes, also when its
    sequences end early: `generate` gets `synced_gpus=True` unless the caller says otherwise."""
    if engine.zero_optimization_stage() != 3 or engine.world_size == 1 or not hasattr(model, "generate"):
        return
    generate = model.generate

    def synced(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    model.generate = synced


__all__ = ["ZeroTrainer", "resolve_auto", "from_pretrained", "ConfigMismatch", "CHECKPOINT_TAG"]

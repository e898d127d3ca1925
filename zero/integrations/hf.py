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

[Note: sequence parallelism in Trainer]
With `sequence_parallel_size: P` in the zero config, P consecutive ranks hold slices of the same
samples' sequences (docs/sequence.md):
- the model's attention is wrapped in the Ulysses exchange (`UlyssesSPAttentionHF`, around the
  model's own implementation) inside `train()` only; evaluate, predict and generate run whole
  sequences, each rank its own, with the model's own attention, as without sequence parallelism.
- Trainer's loader is accelerate's, which gives every process its own batches: its shard becomes
  the data-parallel rank's (rank // P of world // P), so a group shares its batches, and its collate
  function slices each batch (`shard_batch`, what UlyssesSPDataLoaderAdapter does to a loader:
  labels shifted over the whole sequence first, global position_ids). Slicing in the collate
  function keeps Trainer's loader as it is: its length, set_epoch and the skipping on resume.
- the loss is each rank's share of the mean over the whole sequences' valid tokens (see [Note: the
  loss over a group] in zero/sequence/data.py). Where Trainer counts the tokens of the accumulation
  window (`num_items_in_batch`), they are counted on the slices and summed over all ranks
  (average_tokens_across_devices) or over the group; for a model that takes no loss arguments, per
  micro-batch over the group (`sequence_loss`). Averaged over the ranks, losses and gradients are
  those of the whole sequences in one process.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    import transformers
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - the message is what matters
    raise ImportError("zero.integrations.hf needs transformers and accelerate: pip install 'zero[hf]' "
                      "(or pip install transformers accelerate)") from exc

import zero
from zero.parallel.dims import ParallelDims
from zero.parallel.groups import data_parallel_rank_and_size
from zero.sequence.data import IGNORE, sequence_loss, shard_batch

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
        mismatches.append(f"TrainingArguments.optim={optim!r}, which zero does not map to a config optimizer (it "
                          f"maps the Adam/AdamW ones): name the optimizer in the config's `optimizer` section "
                          f"(AdamW, SGD, Lion, Adagrad, ...) instead")
    micro, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill(cfg, "train_micro_batch_size_per_gpu", micro, "train_micro_batch_size_per_gpu")
    fill(cfg, "gradient_accumulation_steps", ga, "gradient_accumulation_steps")
    fill(cfg, "train_batch_size", micro * ga * world_size, "train_batch_size")
    fill(cfg, "gradient_clipping", float(args.max_grad_norm), "gradient_clipping")
    for names, flag in ((("fp16",), args.fp16), (("bf16", "bfloat16"), args.bf16)):  # bfloat16: bf16's old name
        name = next((n for n in names if n in cfg), names[0])
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


def _sequence_parallel_size(raw: dict) -> int:
    size = raw.get("sequence_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"zero_config sequence_parallel_size must be an int >= 1, got {size!r}")
    return size


class _SequenceSlices:
    """A collate function that gives this rank its slice of every batch's sequences (`shard_batch`);
    see [Note: sequence parallelism in Trainer]."""

    def __init__(self, collate, rank: int, size: int):
        self.collate, self.rank, self.size = collate, rank, size

    def __call__(self, features):
        batch = self.collate(features)
        if not isinstance(batch, Mapping):
            raise TypeError(f"sequence_parallel_size {self.size}: ZeroTrainer slices dict batches (input_ids, labels, "
                            f"...), but the data collator returned {type(batch).__name__}")
        return shard_batch(dict(batch), self.rank, self.size)


def _shard_by_data_parallel_rank(loader, size: int) -> None:
    """Make accelerate's loader shard by data-parallel rank (rank // size of world // size), so the
    `size` ranks of a sequence-parallel group get the same batches."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError(f"sequence_parallel_size {size}: accelerate dispatches this loader's batches from rank 0 by "
                         f"process (an IterableDataset, or accelerator_config.dispatch_batches), which cannot give "
                         f"a sequence-parallel group the same batches; use a map-style dataset and dispatch_batches "
                         f"False")
    rank, world = data_parallel_rank_and_size(size)
    for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                  getattr(loader, "dataset", None)):
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = world, rank


class ZeroTrainer(Trainer):
    """`transformers.Trainer` whose model trains with a zero engine; see [Note: Trainer on zero].

    Args:
        zero_config: a DeepSpeed-style config dict or JSON path; HF's "auto" values are resolved
            from the TrainingArguments and the model. Its `sequence_parallel_size` trains with Ulysses
            sequence parallelism (see [Note: sequence parallelism in Trainer]).
        *args, **kwargs: as for `transformers.Trainer`.
    """

    def __init__(self, *args, zero_config: dict | str | os.PathLike, **kwargs):
        _refuse_model_parallel(_raw(zero_config))
        self.sequence_parallel_size = _sequence_parallel_size(_raw(zero_config))
        self._sequence_mpu = None  # what register_with_transformers returns, with sequence parallelism
        self._core_attention = None  # the model's own attention implementation, which Ulysses wraps
        super().__init__(*args, **kwargs)
        plugin = getattr(self.accelerator.state, "dynamo_plugin", None)
        if self.args.torch_compile and plugin is not None:  # accelerate would compile the whole model (hooks
            from accelerate.utils import DynamoBackend  # included) around evaluation: zero compiles the blocks

            plugin.backend = DynamoBackend.NO
        self.zero_config = zero_config
        self.engine = None
        if self.sequence_parallel_size > 1:
            self._wrap_attention_for_sequence_parallelism()

    # -- sequence parallelism (see [Note: sequence parallelism in Trainer]) -------------------------

    def _wrap_attention_for_sequence_parallelism(self) -> None:
        """Check everything first, then build the sequence-parallel groups and register the Ulysses
        attention around the model's own (the model keeps its own outside `train()`)."""
        from transformers import AttentionInterface

        from zero.sequence.hf import UlyssesSPAttentionHF

        size = self.sequence_parallel_size
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        config = getattr(self.model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        core = getattr(config, "_attn_implementation", None)
        problems = []
        if world % size:
            problems.append(f"it does not divide the world of {world} ranks into sequence-parallel groups (launch a "
                            f"multiple of {size} ranks)")
        if isinstance(heads, int) and heads % size:
            problems.append(f"the model's {heads} attention heads (config.num_attention_heads) do not split over "
                            f"{size} ranks")
        if isinstance(kv_heads, int) and kv_heads % size and size % kv_heads:
            problems.append(f"the model's {kv_heads} key/value heads (config.num_key_value_heads) neither split over "
                            f"nor divide {size} ranks")
        if core not in AttentionInterface._global_mapping:
            problems.append(f"the model's attention implementation {core!r} cannot be wrapped in the Ulysses "
                            f"exchange (load the model with attn_implementation='sdpa')")
        if self.model_init is not None:
            problems.append("model_init builds a new model in train() (pass model= instead)")
        if self.compute_loss_func is not None or self.args.label_smoothing_factor:
            problems.append("compute_loss_func and label_smoothing_factor do not apply: each rank's loss is its "
                            "slice's share of the whole sequences' (shift_labels), which ZeroTrainer computes itself "
                            "(override compute_loss instead)")
        if self.args.train_sampling_strategy == "batch_rebalance":
            problems.append("train_sampling_strategy 'batch_rebalance' shards by process, not by data-parallel rank")
        if problems:
            raise ValueError(f"ZeroTrainer: zero_config sequence_parallel_size is {size}, but " + "; ".join(problems))
        self._core_attention = core
        self._sequence_mpu = UlyssesSPAttentionHF.register_with_transformers(
            self.model, core_attn_implementation=core, sequence_parallel_size=size,
            micro_batch_size=self.args.per_device_train_batch_size)
        self.model.set_attn_implementation(core)

    @contextlib.contextmanager
    def _attention(self, implementation: str | None):
        """The model's attention set to `implementation` for the block (nothing when None)."""
        before = self.model.config._attn_implementation if implementation is not None else None
        if implementation is None or implementation == before:
            yield
            return
        self.model.set_attn_implementation(implementation)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def train(self, *args, **kwargs):
        from zero.sequence.hf import NAME

        with self._attention(NAME if self._sequence_mpu is not None else None):
            return super().train(*args, **kwargs)

    def get_train_dataloader(self):
        """Trainer's loader; with sequence parallelism sharded by data-parallel rank, each batch
        sliced for this rank."""
        if self._sequence_mpu is None:
            return super().get_train_dataloader()
        collator = self.data_collator
        self.data_collator = _SequenceSlices(collator, self._sequence_mpu.get_sequence_parallel_rank(),
                                             self.sequence_parallel_size)
        try:
            loader = super().get_train_dataloader()
        finally:
            self.data_collator = collator
        _shard_by_data_parallel_rank(loader, self.sequence_parallel_size)
        return loader

    def get_total_train_batch_size(self, args) -> int:
        return super().get_total_train_batch_size(args) // self.sequence_parallel_size

    def _token_count_group(self):
        """The ranks whose valid tokens one loss is averaged over, and their number: all of them
        (average_tokens_across_devices, as Trainer) or this rank's sequence-parallel group."""
        if self.args.average_tokens_across_devices:
            return None, torch.distributed.get_world_size()
        return self._sequence_mpu.get_sequence_parallel_group(), self.sequence_parallel_size

    def _get_num_items_in_batch(self, batch_samples, device):
        """The valid tokens of the accumulation window, counted over this rank's slices and summed
        over the ranks that share the loss (each token counted once)."""
        sliced = self._sequence_mpu is not None and bool(batch_samples) and "shift_labels" in batch_samples[0]
        if not sliced or not self.model_accepts_loss_kwargs:  # Trainer's count (evaluation batches too)
            return super()._get_num_items_in_batch(batch_samples, device)
        count = sum((batch["shift_labels"] != IGNORE).sum() for batch in batch_samples).to(device)
        torch.distributed.all_reduce(count, group=self._token_count_group()[0])
        return count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._sequence_mpu is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if "shift_labels" not in inputs:
            raise ValueError(f"sequence_parallel_size {self.sequence_parallel_size}: a training batch without "
                             f"shift_labels (keys {sorted(inputs)}); ZeroTrainer's train loader slices batches "
                             f"with labels: give the dataset labels")
        inputs = dict(inputs)
        shift_labels = inputs.pop("shift_labels")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if num_items_in_batch is None:  # per micro-batch, over the group
            loss = sequence_loss(logits, shift_labels, self._sequence_mpu.get_sequence_parallel_group())
        else:  # over the window and the ranks that counted num_items_in_batch
            summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), shift_labels.reshape(-1),
                                     ignore_index=IGNORE, reduction="sum")
            loss = summed * self._token_count_group()[1] / num_items_in_batch
        return (loss, outputs) if return_outputs else loss

    # -- building the engine ---------------------------------------------------------------------

    def _ensure_engine(self, max_steps: int) -> None:
        """Build the engine (once), and a schedule for `max_steps` (for every `train()`, as Trainer does)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        batch = ParallelDims(world, sp=self.sequence_parallel_size).size("batch")  # ranks loading different samples
        cfg = resolve_auto(self.zero_config, self.args, self.model, max(1, max_steps), batch)
        if self.args.torch_compile and "compile" not in cfg:  # zero compiles the blocks (docs/compile.md)
            mode = self.args.torch_compile_mode
            cfg = {**cfg, "compile": {"enabled": True, "backend": self.args.torch_compile_backend or "inductor",
                                      **({"kwargs": {"mode": mode}} if mode else {})}}
        if self.engine is None:
            # no optimizer section: Trainer's AdamW, with Trainer's no-decay group
            groups = self._trainer_param_groups() if "optimizer" not in _raw(self.zero_config) else None
            self.engine, *_ = zero.initialize(model=self.model, model_parameters=groups, config=cfg,
                                              mpu=self._sequence_mpu)
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
        with self._attention(self._core_attention):  # whole sequences: see [Note: sequence parallelism in Trainer]
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._ensure_model_usable()
        with self._attention(self._core_attention):
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
        ga = engine.config.gradient_accumulation_steps
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
    if engine.config.zero_optimization.stage != 3 or engine.world_size == 1 or not hasattr(model, "generate"):
        return
    generate = model.generate

    def synced(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    model.generate = synced


__all__ = ["ZeroTrainer", "resolve_auto", "from_pretrained", "ConfigMismatch", "CHECKPOINT_TAG"]

"""The user-facing engine: forward, backward, step, accumulation, loss scaling, reports.

    engine, optimizer, loader, scheduler = zero.initialize(model=model, config=cfg)
    for x, y in loader:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

The engine delegates: gradients and partitioning live in zero/stages, collectives in zero/comm.py,
config keys in zero/config/. It owns the training-loop bookkeeping DeepSpeed users rely on:
micro-steps and the accumulation boundary, the loss scale, the global step count.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.comm import Comm
from zero.config import ConfigWarning, ZeroConfig, check_supported, load_config
from zero.offload import OffloadOptions, cpu_adam_threads
from zero.precision import LossScaler
from zero.stages.optimizer import ZeroOptimizer
from zero.stages.stage3 import Stage3Optimizer

IMPLEMENTED = {"stage1", "stage2", "stage3", "offload_optimizer", "offload_param"}
DEFAULT_UNIT_ELEMENTS = 1_000_000  # a module with this many (unclaimed) parameter elements becomes a stage-3 unit

# [Note: knobs without effect]
# DeepSpeed keys that change how DeepSpeed moves memory but cannot change anything here. We say
# so once, rather than accept them silently.
_NO_EFFECT = {
    ("zero_optimization", "contiguous_gradients", False): "gradients are always reduced from contiguous buckets",
    ("zero_optimization", "allgather_partitions", False): "updated shards are always all-gathered",
    ("zero_optimization", "round_robin_gradients", True): "gradient shards are already contiguous per bucket",
    ("zero_optimization", "use_all_reduce_for_fetch_params", True): "stage 3 always fetches with one all-gather per unit",
    ("zero_optimization", "allgather_sequential", True): "stage 3 always fetches a unit with one all-gather",
}


def init_distributed(dist_backend: str | None = None, timeout_s: float = 1800.0) -> None:
    """Join the torch.distributed group that torchrun (or a similar launcher) describes.

    Does nothing if a group is already initialised or no launcher environment is present (a
    world of one). The backend is NCCL when CUDA is available, gloo otherwise.

    Args:
        dist_backend: override the backend ("nccl", "gloo").
        timeout_s: collective timeout in seconds.
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from datetime import timedelta

    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """[Note: gloo at exit]
    A gloo group still alive when the interpreter shuts down can abort the process from its worker
    threads ("terminate called without an active exception", pytorch/pytorch#190489): measured on
    torch 2.13, 2 ranks exiting after a few collectives abort in about half the runs once a torch
    optimizer exists. `destroy_process_group()` alone is not enough there, because a reference
    cycle keeps the group alive; destroying it and then collecting garbage, while the interpreter
    is still whole, brings it to 0 in 12 runs. So the group zero created, zero also takes down."""
    if dist.is_initialized():
        dist.destroy_process_group()
        import gc

        gc.collect()


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


def _optimizer_defaults(cfg: ZeroConfig, optimizer: torch.optim.Optimizer | None) -> dict:
    """Adam hyperparameters from a client optimizer or from the config's `optimizer` section."""
    if optimizer is not None:
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(
                f"initialize(optimizer=...) got a {type(optimizer).__name__}; zero's partitioned optimizer "
                f"implements Adam and AdamW (pass torch.optim.Adam/AdamW, or use the config's 'optimizer')"
            )
        d = optimizer.defaults
        if d.get("amsgrad"):
            raise ValueError("amsgrad is not supported by zero's partitioned Adam")
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
        return dict(lr=d["lr"], betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"],
                    bias_correction=True, adamw_mode=adamw)
    if cfg.optimizer is None:
        raise ValueError("no optimizer: add an 'optimizer' section to the config or pass initialize(optimizer=...)")
    p = cfg.optimizer.params
    return dict(lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay,
                bias_correction=p.bias_correction, adamw_mode=cfg.optimizer.adamw)


class Engine(nn.Module):
    """A model wrapped for ZeRO data-parallel training. Build it with `zero.initialize`."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        model_parameters=None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler=None,
    ):
        super().__init__()
        self.config = config
        self.comm = Comm()
        zc = config.zero_optimization
        for (section, key, value), why in _NO_EFFECT.items():
            if getattr(getattr(config, section), key) == value:
                warnings.warn(f"{section}.{key}={value} has no effect in zero: {why}", ConfigWarning, stacklevel=3)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        defaults = _optimizer_defaults(config, optimizer)
        groups = _param_groups(module, model_parameters if optimizer is None else optimizer.param_groups, defaults)

        module.to(self.device)
        with torch.no_grad():  # every rank starts from rank 0's weights and buffers
            for t in [*module.parameters(), *module.buffers()]:
                self.comm.broadcast(t.data, src=0)
        self.module = module

        if config.fp16.enabled:
            f = config.fp16
            scaler = LossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
                                f.consecutive_hysteresis, f.min_loss_scale)
        else:
            scaler = LossScaler.disabled()
        predivide = float(self.comm.world_size) if config.prescale_gradients else config.gradient_predivide_factor
        offload = None
        if zc.offload_optimizer is not None and zc.offload_optimizer.device == "cpu":
            offload = OffloadOptions(pin_memory=zc.offload_optimizer.pin_memory,
                                     tile_elements=max(1, min(zc.sub_group_size, 1 << 22)), num_threads=cpu_adam_threads())
        common = dict(comm=self.comm, dtype=config.dtype, gradient_clipping=config.gradient_clipping, loss_scaler=scaler,
                      check_overflow=config.fp16.enabled or config.bf16.check_grad_overflow, predivide=predivide,
                      offload=offload)
        if zc.stage == 3:  # shards are cut from the fp32 values first, then the module is cast
            self.optimizer = Stage3Optimizer(
                module, groups, comm_dtype=config.communication_dtype,
                accumulation_steps=config.gradient_accumulation_steps,
                persistence_threshold=zc.param_persistence_threshold,
                persistence_budget=zc.model_persistence_threshold if zc.model_persistence_threshold < sys.maxsize else None,
                unit_threshold=zc.module_granularity_threshold or DEFAULT_UNIT_ELEMENTS,
                prefetch_elements=zc.prefetch_bucket_size, max_live_elements=zc.max_live_parameters,
                max_reuse_distance=zc.max_reuse_distance, overlap_comm=zc.overlap_comm, device=self.device,
                offload_param=zc.offload_param is not None and zc.offload_param.device == "cpu",
                pin_memory=zc.offload_param is not None and zc.offload_param.pin_memory, **common)
            if config.precision != "fp32":
                module.to(config.dtype)
        else:
            master = {p: p.detach().float().clone() for g in groups for p in g["params"]} if config.precision != "fp32" else None
            if config.precision != "fp32":
                module.to(config.dtype)
            self.optimizer = ZeroOptimizer(
                groups, stage=zc.stage, master_values=master,
                bucket_size=max(1, min(zc.reduce_bucket_size, zc.allgather_bucket_size)),
                comm_dtype=config.communication_dtype, accumulation_steps=config.gradient_accumulation_steps,
                overlap_comm=zc.overlap_comm, reduce_scatter=zc.reduce_scatter, **common)
        self.optimizer.at_boundary = config.gradient_accumulation_steps == 1
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        self._last_comm: dict = {}
        self._in_no_sync = False
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        if config.dump_state and self.comm.rank == 0:
            print(f"zero: engine state\n  config: {config.model_dump_json(exclude_defaults=True)}\n"
                  f"  device: {self.device}  world size: {self.comm.world_size}\n"
                  f"  trainable params: {sum(p.numel() for p in self.optimizer.params):,}\n"
                  f"  memory: {self.memory_report()}", flush=True)

    @contextlib.contextmanager
    def _timed(self, what: str):
        """Accumulate wall-clock time of `what` when wall_clock_breakdown is on."""
        if not self.config.wall_clock_breakdown:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self._times[what] += time.perf_counter() - start

    def _build_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
        if self.config.scheduler is None:
            return None
        from zero.lr_schedules import build_scheduler

        return build_scheduler(self.config.scheduler.type, dict(self.config.scheduler.params), self.optimizer)

    # -- training loop ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            cast = lambda t: t.to(torch.float16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        with self._timed("forward"):
            return self.module(*args, **kwargs)

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """Keep BatchNorm-style running statistics identical on every rank: average running_mean
        and running_var over ranks (the update is linear, so the average is the running statistic
        of the global batch) and take rank 0's batch count. Other buffers (masks, rotary tables)
        are constants and are left alone."""
        for m in self.module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
                for b in (m.running_mean, m.running_var):
                    self.comm.all_reduce(b, "sum")
                    b.div_(self.comm.world_size)
                self.comm.broadcast(m.num_batches_tracked, src=0)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `loss / gradient_accumulation_steps * loss_scale`; gradients flow into the
        partitioned buffers through hooks. Returns the loss it was given."""
        if self._in_no_sync and self.config.zero_optimization.stage >= 2:
            raise RuntimeError("no_sync() cannot be used with ZeRO stage 2: gradients are partitioned as they arrive")
        scaled = loss.float() * (self.optimizer.loss_scaler.scale / self.config.gradient_accumulation_steps)
        with self._timed("backward"):
            scaled.backward(retain_graph=retain_graph)
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` call will update the weights."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Call after every micro-batch's backward; updates weights only at the boundary."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.optimizer.at_boundary = self.is_gradient_accumulation_boundary()  # for the next backward
        self.global_samples += self.config.train_micro_batch_size_per_gpu * self.comm.world_size
        if not boundary:
            return
        if hasattr(self.optimizer, "reducer"):
            self.optimizer.reducer.sync_enabled = not self._in_no_sync
        with self._timed("step"):
            updated = self.optimizer.step()
        if self.comm.world_size > 1 and self.module.training:
            self._sync_buffers()
        if updated:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self._last_comm = self.comm.report()
        self.comm.reset_counts()
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0 and self.comm.rank == 0:
            self._print_progress(every)

    def _print_progress(self, every: int) -> None:
        print(f"zero: step {self.global_steps} lr {self.get_lr()} grad_norm {self.get_global_grad_norm()}"
              f" loss_scale {self.optimizer.loss_scaler.scale:g} skipped {self.skipped_steps}", flush=True)
        if self.config.wall_clock_breakdown:
            ms = {k: f"{v / every * 1e3:.1f}" for k, v in self._times.items()}
            print(f"zero: ms per step: forward {ms['forward']} backward {ms['backward']} step {ms['step']}", flush=True)
            self._times = dict.fromkeys(self._times, 0.0)
        if self.config.memory_breakdown:
            print(f"zero: model-state bytes per rank: {self.memory_report()}", flush=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Stages 0/1: skip the gradient reduction of steps inside the context (as DDP.no_sync).
        Not allowed with stage 2, whose gradients are partitioned as they arrive."""
        if self.config.zero_optimization.stage >= 2:
            raise RuntimeError("no_sync() cannot be used with ZeRO stage 2: gradients are partitioned as they arrive")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- DeepSpeed-compatible accessors -----------------------------------------------------

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged, unscaled gradient of the last step (before clipping)."""
        return self.optimizer.global_grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    # -- reports ----------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank of model states by kind, beside what the ZeRO paper's formula predicts.

        `expected` uses Psi = trainable parameters, N = ranks sharing the optimizer state, and the
        real element sizes (2 bytes for 16-bit params/grads, 4 for fp32): stage 0 keeps all of
        params, grads and optimizer states; stage 1 partitions the fp32 master and Adam states;
        stage 2 also the gradients; stage 3 also the 16-bit parameters (16 Psi/N in mixed precision),
        plus the full copies of persistent (small) parameters. Padding accounts for any small
        difference. Stage 3 also reports `gathered_peak`, the most bytes of gathered parameters
        held at once.
        """
        report = self.optimizer.memory_report()
        n = self.comm.world_size
        p16 = torch.finfo(self.config.dtype).bits // 8
        zc = self.config.zero_optimization
        offloaded = self.optimizer.offload is not None or getattr(self.optimizer, "offload_param", False)
        master_el = 0 if self.config.dtype == torch.float32 and not offloaded else 4  # fp32: params are the master
        stage = self.config.zero_optimization.stage
        if stage == 3:
            psi = sum(p._zero.numel for g in self.optimizer.param_groups for p in g["params"])
            grad_el = next((r.grad.element_size() for u in self.optimizer.units for r in u.ranges), p16)
            expected = (p16 + grad_el + master_el + 8) * psi / n + p16 * report["persistent_params"]
        else:
            psi = self.optimizer.layout.param_numel
            reducer = self.optimizer.reducer
            grad_el = reducer.flat_grad.element_size() if reducer.flat_grad is not None else reducer.shards[0].element_size()
            opt = (master_el + 8) * psi
            expected = {
                0: p16 * psi + grad_el * psi + opt,
                1: p16 * psi + grad_el * psi + opt / n,
                2: p16 * psi + (grad_el * psi + opt) / n,
            }[stage]
        report["model_states_total"] = sum(report[k] for k in ("params", "grads", "fp32_master", "optimizer_states"))
        report["expected_by_formula"] = int(expected)
        report["params_count"] = psi
        return report

    # -- saving -----------------------------------------------------------------------------

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full state dict in the training dtype on rank 0 (None elsewhere); all ranks call it.
        Under stage 3 parameters are gathered one at a time."""
        from zero.checkpoint import consolidated_state_dict

        return consolidated_state_dict(self.module, self.comm, exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the consolidated 16-bit state dict from rank 0 (atomically); all ranks call it.

        Under stage 3 this needs `stage3_gather_16bit_weights_on_model_save: true` (as in
        DeepSpeed); otherwise it warns, saves nothing and returns False.
        """
        if self.config.zero_optimization.stage == 3 and not self.config.zero_optimization.gather_16bit_weights_on_model_save:
            warnings.warn("save_16bit_model: stage3_gather_16bit_weights_on_model_save is false, nothing saved "
                          "(set it to true to gather the weights)", stacklevel=2)
            return False
        from zero.checkpoint import atomic_save

        state = self.consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.comm.rank == 0:
            atomic_save(state, os.path.join(save_dir, save_filename))
        self.comm.barrier()
        return True

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Logical calls/elements/bytes per collective during the last optimizer step's window
        (from the previous step's end to this step's end). See [Note: logical counts]."""
        return self._last_comm


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data=None,
    lr_scheduler=None,
    collate_fn: Callable | None = None,
    config: dict | str | os.PathLike | None = None,
    config_params: dict | None = None,
    dist_init_required: bool | None = None,
):
    """Wrap `model` for ZeRO training; DeepSpeed's `deepspeed.initialize` signature and result.

    Args:
        args: unused (DeepSpeed reads `args.deepspeed_config`; pass `config` instead).
        model: the torch module to train.
        optimizer: a torch.optim.Adam/AdamW whose hyperparameters and param groups are used, or
            None to build Adam/AdamW from the config's `optimizer` section.
        model_parameters: parameters or param groups to train (default: model.parameters()).
        training_data: a torch Dataset; a distributed DataLoader over it is returned.
        lr_scheduler: a scheduler object, or a callable taking the optimizer and returning one;
            None builds the config's `scheduler` if any.
        collate_fn: collate function of the returned DataLoader.
        config: a DeepSpeed-style config dict or path to a JSON file.
        config_params: DeepSpeed's older name for `config`.
        dist_init_required: join torchrun's process group if not yet joined (default: yes).

    Returns:
        (engine, optimizer, training_dataloader or None, lr_scheduler or None)
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    config = config if config is not None else config_params
    if config is None:
        raise ValueError("initialize() needs config= (a dict or a JSON path)")
    if dist_init_required is not False:
        init_distributed()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config(config, world_size=world_size)  # every config error is raised here, first
    check_supported(cfg, IMPLEMENTED)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    engine = Engine(model, cfg, model_parameters, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.distributed.DistributedSampler(
            training_data, num_replicas=world_size, rank=engine.comm.rank) if world_size > 1 else None
        loader = torch.utils.data.DataLoader(
            training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
            shuffle=sampler is None, collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last)
    return engine, engine.optimizer, loader, engine.lr_scheduler

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
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.comm import Comm
from zero.config import ZeroConfig, load_config
from zero.guards import (
    _claim,
    _refuse_claimed,
    _refuse_foreign_parameters,
    check_ranks_agree,
    next_engine_number,
)
from zero.partition.layout import local_tensor
from zero.precision import NonFiniteGradientError
from zero.stages import build_optimizer
from zero.stages.adam import check_param_groups
from zero.stages.choice import _client_optimizer, _optimizer_defaults, _param_groups

log = logging.getLogger("zero")


def init_distributed(dist_backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the torch.distributed group that torchrun (or a similar launcher) describes.

    Does nothing if a group is already initialised or no launcher environment is present (a
    world of one). The backend is NCCL when CUDA is available, gloo otherwise.

    Args:
        dist_backend: override the backend ("nccl", "gloo").
        timeout_s: the process group's collective timeout in seconds (default: ZERO_COLLECTIVE_TIMEOUT,
            600), after which NCCL's watchdog ends a hung collective; see [Note: bounded waits].
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {}
    if "nccl" in backend:  # bind the rank to its GPU up front (no device guessing, eager communicator)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    from datetime import timedelta

    if timeout_s is None:
        from zero.comm import collective_timeout_s

        timeout_s = collective_timeout_s()
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s), **kwargs)
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


def _compute_device(comm: Comm) -> torch.device:
    """The current CUDA device, unless there is none or the process group is gloo-only (CPU ranks)."""
    if not torch.cuda.is_available() or (comm.distributed and not comm.uses_nccl):
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    local = os.environ.get("LOCAL_RANK")
    if comm.distributed and local is not None and int(local) != device.index and torch.cuda.device_count() > 1:
        warnings.warn(f"zero: LOCAL_RANK is {local} but the current CUDA device is {device}; call "
                      f"torch.cuda.set_device(LOCAL_RANK) before init_process_group (or let zero.initialize do it), "
                      f"or several ranks will share one GPU", stacklevel=3)
    return device


@torch.no_grad()
def _place_the_rest(module: nn.Module, placed: list[nn.Parameter], device: torch.device, dtype: torch.dtype,
                    comm: Comm) -> None:
    """Parameters the optimizer did not place (frozen ones, stages 0-2) and buffers: to the device,
    floating ones in the training dtype, with rank 0's values."""
    done = {id(p) for p in placed}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in done or getattr(t, "_zero", None) is not None:
            continue
        local = local_tensor(t)  # a DTensor's piece: module.to() would swap the DTensor object itself
        target = dtype if local.is_floating_point() else local.dtype
        if local.device != device or local.dtype != target:
            local.data = local.data.to(device=device, dtype=target)
        if local.numel():
            comm.broadcast(local.data, src=0)


class Engine(nn.Module):
    """A model wrapped for ZeRO data-parallel training. Build it with `zero.initialize`."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        model_parameters=None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler=None,
        comm: Comm | None = None,
    ):
        super().__init__()
        self.config = config
        self.comm = comm if comm is not None else Comm()  # the data-parallel group (the world without a mesh)
        self.comm.engine = next_engine_number()
        self.device = _compute_device(self.comm)
        defaults = _optimizer_defaults(config, optimizer)
        groups = _param_groups(module, model_parameters if optimizer is None else optimizer.param_groups, defaults)
        check_param_groups(groups, "Check model_parameters / the optimizer's param groups.")
        if any(g.get("eps") == 0 for g in groups):
            warnings.warn("zero: Adam eps is 0: an element whose gradient is 0 (an unused parameter, a padding row) "
                          "gets 0/0 = NaN in the update, as with torch.optim.Adam; use a small eps such as 1e-8",
                          stacklevel=3)
        _refuse_claimed(module, {p for g in groups for p in g["params"]}, config.zero_optimization.stage)
        _refuse_foreign_parameters(module, groups, config)
        check_ranks_agree(module, config, self.comm)  # before the first broadcast
        self.module = module
        self.optimizer = build_optimizer(module, groups, config, self.comm, self.device)
        client, client_defaults = _client_optimizer(config, optimizer)
        if client is not None:
            if self.optimizer.offload is not None:
                raise ValueError(f"optimizer offload runs zero's CPU Adam; a {client.__name__} optimizer cannot be "
                                 f"offloaded (remove offload_optimizer or use Adam/AdamW)")
            self.optimizer.client_class = client  # see [Note: other optimizers on shards]
            self.optimizer.client_defaults = client_defaults
        _claim(module, self.optimizer, config.zero_optimization.stage)  # whose hooks take the gradients now
        self._trainable = [(n, p, p.requires_grad) for n, p in module.named_parameters()]
        self._backwards = 0  # backward passes since the last optimizer step (ranks must agree)
        self._warned_count = False
        self._pending_save = None  # an asynchronous checkpoint save being written
        self.training_dataloader = None  # the loader initialize(training_data=...) made
        self._step_applied = False
        _place_the_rest(module, self.optimizer.params, self.device, config.dtype, self.comm)
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
        if not isinstance(loss, torch.Tensor):
            hint = " (pass the loss inside it, e.g. outputs[0] or outputs.loss)" if isinstance(loss, (tuple, list, dict)) \
                or hasattr(loss, "loss") else ""
            raise TypeError(f"engine.backward(loss) takes the scalar loss tensor, got a {type(loss).__name__}{hint}")
        scaled = loss.float() * (self.optimizer.loss_scaler.scale / self.config.gradient_accumulation_steps)
        with self._timed("backward"):
            scaled.backward(retain_graph=retain_graph)
        self._backwards += 1
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` call will update the weights."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Call after every micro-batch's backward; updates weights only at the boundary."""
        if self._in_no_sync:
            raise RuntimeError("engine.step() was called inside no_sync(): the gradients of the steps inside are not "
                               "reduced across ranks, so stepping now would update each rank with its own gradient "
                               "and the ranks would diverge. Leave the no_sync() context before calling step().")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:  # refused before anything changes:
            self.optimizer.check_hyperparameters()  # a bad lr
            self._check_trainable_unchanged()  # requires_grad flipped since initialize
            self.optimizer.adopt_edits()  # parameters changed in place since the last step
            # every rank at this step after the same number of backward passes (a rank that
            # skipped one would contribute stale or zero gradients), before its collectives
            self.comm.agree([4, self.global_steps + 1, self._backwards], f"optimizer step {self.global_steps + 1}")
            if not self._backwards and not self._warned_count:
                self._warned_count = True
                warnings.warn(
                    f"zero: optimizer step {self.global_steps + 1} comes after no engine.backward() call: it applies "
                    f"weight decay and Adam's momentum without new gradients. Call engine.backward(loss) (not "
                    f"loss.backward()) before engine.step() (warned once)", stacklevel=2)
            self._backwards = 0
        self.micro_steps += 1
        self._step_applied = False
        self.optimizer.at_boundary = self.is_gradient_accumulation_boundary()  # for the next backward
        self.global_samples += self.config.train_micro_batch_size_per_gpu * self.comm.world_size
        if not boundary:
            return
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
        self._step_applied = bool(updated)
        if not updated:
            self._report_skip()
        self._last_comm = self.comm.report()
        self.comm.reset_counts()
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0 and self.comm.rank == 0:
            self._print_progress(every)

    def _check_trainable_unchanged(self) -> None:
        changed = [(n, p.requires_grad) for n, p, was in self._trainable if p.requires_grad != was]
        if changed:
            name, now = changed[0]
            raise RuntimeError(
                f"parameter {name!r} was {'un' if now else ''}frozen (requires_grad={now}) after zero.initialize "
                f"({len(changed)} parameter(s) changed). The engine fixes which parameters it trains when it is "
                f"built: a parameter frozen later would still be moved by Adam's momentum, one unfrozen later would "
                f"never be trained. Set requires_grad before zero.initialize (a parameter to freeze for a while can "
                f"stay trainable with its learning rate set to 0 in its own param group).")

    def _report_skip(self) -> None:
        """Log a skipped step (rank 0), and stop when fp16 cannot lower the loss scale any more
        (as DeepSpeed does): every later step would be skipped too."""
        norm, before, after = self.optimizer.skipped
        scaler = self.optimizer.loss_scaler
        if scaler.dynamic and scaler.exhausted:
            raise NonFiniteGradientError(
                f"step {self.global_steps}: fp16 gradients overflowed at the minimum loss scale {scaler.min_scale:g} "
                f"({self.skipped_steps} steps skipped so far). Every further step would be skipped. The loss or the "
                f"gradients are inf/NaN by themselves: check the data and the loss, lower the learning rate, or "
                f"train in bf16.")
        if self.comm.rank != 0:
            return
        if scaler.dynamic:
            log.warning("zero: step %d skipped: fp16 gradients overflowed; loss scale %g -> %g",
                        self.global_steps, before, after)
        else:
            log.warning("zero: step %d skipped: the gradient holds inf or NaN (norm %s) on at least one rank; "
                        "parameters and optimizer state are unchanged. Check the batch and the loss (lower the "
                        "learning rate, or clip gradients, if this repeats).", self.global_steps, norm)

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
        """Stages 0/1: backward passes inside the context accumulate gradients locally without
        communicating, as DDP.no_sync; the reduction happens at the first `step()` outside it
        (calling `step()` inside is an error, as in DeepSpeed). Not allowed with stages 2 and 3,
        whose gradients are partitioned as they arrive."""
        if self.config.zero_optimization.stage >= 2:
            raise RuntimeError(f"no_sync() cannot be used with ZeRO stage {self.config.zero_optimization.stage}: "
                               f"gradients are partitioned as they arrive")
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

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.optimizer.loss_scaler.scale

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the weights (False inside an accumulation window and on
        a skipped (overflowed) step)."""
        return self._step_applied

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Make the coming `step()` an accumulation boundary (True) or not (False), whatever the
        micro-step count says (DeepSpeed's manual override)."""
        ga = self.config.gradient_accumulation_steps
        at = self.micro_steps % ga == ga - 1
        if is_boundary and not at:
            self.micro_steps += ga - 1 - self.micro_steps % ga
        elif not is_boundary and at:
            raise ValueError("set_gradient_accumulation_boundary(False) at the last micro-step of a window: "
                             "raise gradient_accumulation_steps instead")
        self.optimizer.at_boundary = self.is_gradient_accumulation_boundary()

    def get_mom(self) -> list:
        """Per param group, Adam's betas, or the momentum of an optimizer that has one (SGD,
        RMSprop), or None (DeepSpeed's momentum accessor)."""
        client = self.optimizer.client_defaults if self.optimizer.client_class is not None else None
        if client is None:
            return [tuple(g["betas"]) for g in self.optimizer.param_groups]
        key = "momentum" if "momentum" in client else "betas" if "betas" in client else None
        return [(tuple(g[key]) if key == "betas" else g[key]) if key else None for g in self.optimizer.param_groups]

    # -- reports ----------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds, measured from the storages the engine holds (an alias counts
        once; a freed stage-3 buffer counts 0), not computed from a formula.

        Keys: `params`, `grads`, `fp32_master`, `optimizer_states` and their sum
        `model_states_total`; `device_bytes` and `host_bytes` (where they live: offload moves
        optimizer states, and stage-3 parameter shards, to the host); `host_staging` (offload's
        host gradient and copy-back buffers); `reduce_buffers` and `reduce_buffers_peak`
        (gradient buffers being filled or reduced, now and at most). Stage 3 adds
        `gathered_bytes` and `gathered_peak` (gathered full parameters now and at most, persistent
        ones excluded), `gather_buffers_peak` (all-gather outputs before they are copied into
        units) and `persistent_params` (elements kept whole on every rank).
        """
        return self.optimizer.memory_report()

    # -- saving -----------------------------------------------------------------------------

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full state dict in the training dtype on rank 0 (None elsewhere); all ranks call it.
        Under stage 3 parameters are gathered one at a time."""
        from zero.checkpoint import consolidated_state_dict

        return consolidated_state_dict(self.module, self.comm, exclude_frozen_parameters)

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict  # DeepSpeed's name (accelerate calls it)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's accessor)."""
        return self.config.zero_optimization.gather_16bit_weights_on_model_save

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the consolidated 16-bit state dict from rank 0 (atomically); all ranks call it.
        `model.safetensors` by default (tied parameters once, as HuggingFace saves them); a
        filename ending in `.bin` or `.pt` gets torch.save instead.

        Under stage 3 this needs `stage3_gather_16bit_weights_on_model_save: true` (as in
        DeepSpeed); otherwise it warns, saves nothing and returns False.
        """
        from zero.checkpoint import atomic_save, checked_save_path

        save_path = checked_save_path(save_dir, save_filename)  # on every rank, before any gather or write
        if self.config.zero_optimization.stage == 3 and not self.config.zero_optimization.gather_16bit_weights_on_model_save:
            warnings.warn("save_16bit_model: stage3_gather_16bit_weights_on_model_save is false, nothing saved "
                          "(set it to true to gather the weights)", stacklevel=2)
            return False
        state = self.consolidated_16bit_state_dict(exclude_frozen_parameters)
        error = None
        if self.comm.rank == 0:
            try:
                atomic_save(state, save_path)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then it is raised
                error = exc
        if self.comm.any_rank(error is not None):  # as long as the write takes: the process group's timeout
            if error is not None:
                raise error
            raise RuntimeError(f"save_16bit_model: rank 0 could not write {save_path} (its error says why); nothing "
                               f"was written and training can go on")
        return True

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool | None = None) -> str:
        """Save the whole training state under `save_dir/tag` (default tag `global_step<N>`); all
        ranks call it. See docs/checkpoint.md for the layout and guarantees.

        Args:
            save_dir: the checkpoint directory (shared by all ranks).
            tag: the sub-directory name; `latest` then names it (with `save_latest`).
            client_state: your own JSON-serialisable values, returned by `load_checkpoint`.
            save_latest: point `save_dir/latest` at this tag once it is complete.
            exclude_frozen_parameters: leave out parameters with requires_grad=False.
            async_save: copy the state to host memory and write it in the background (default:
                the config's `checkpoint.async_save`); the next save, `load_checkpoint`,
                `wait_for_checkpoint()` and process exit wait for it.
        """
        from zero.checkpoint.training import save_checkpoint

        self.wait_for_checkpoint()
        if async_save is None:
            async_save = self.config.checkpoint.async_save
        result = save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, async_save)
        if not async_save:
            return result
        self._pending_save = result
        return result.path

    def wait_for_checkpoint(self) -> str | None:
        """Wait for an asynchronous save to finish (raising its error, if any); returns its path."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, dict]:
        """Resume from `load_dir/tag` (default: the tag `latest` names), saved at any world size and
        stage; all ranks call it. Every check is made before anything changes.

        Returns:
            (the tag's path, the client_state saved with it)
        """
        from zero.checkpoint.training import load_checkpoint

        self.wait_for_checkpoint()
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def wall_clock_report(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent in forward, backward and step since the last reset (with
        `wall_clock_breakdown: true`); `communication_wait`, the part of them the host spent
        waiting for collectives (measured on gloo; under NCCL the waits are on the GPU's streams
        and this stays 0); and, with optimizer offload, inside the step: waiting for gradient
        copies, in CPU Adam, waiting for parameter copies.

        Args:
            reset: start counting again from zero after reading.
        """
        report = dict(self._times)
        report["communication_wait"] = self.comm.waited_s()  # inside forward, backward and step; gloo only
        host = self.optimizer.host_adam
        if host is not None:
            report.update(host.times)
        if reset:
            self._times = dict.fromkeys(self._times, 0.0)
            self.comm.reset_waited()
            if host is not None:
                host.times = dict.fromkeys(host.times, 0.0)
        return report

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
    elif not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            f"zero.initialize(dist_init_required=False): WORLD_SIZE={os.environ['WORLD_SIZE']} says this process is "
            f"one of several ranks, but no torch.distributed process group exists, so every rank would train alone. "
            f"Call torch.distributed.init_process_group() first, or leave dist_init_required unset.")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    from zero.pipe.module import PipelineModule

    pipelined = isinstance(model, PipelineModule)
    # every config error is raised here, first
    cfg = load_config(config, world_size=world_size, pipeline_stages=model.num_stages if pipelined else None)
    if cfg.pipeline.stages > 1 and not pipelined:
        raise ValueError(f"pipeline.stages is {cfg.pipeline.stages}: the model must be a zero.pipe.PipelineModule "
                         f"(a list of layers each stage builds its own part of), not a {type(model).__name__}")
    auto_plan = None
    if cfg.tensor_parallel.size > 1:
        from zero.tp.plans import auto_plan_for

        auto_plan = auto_plan_for(model, cfg.tensor_parallel.size)
    mesh = None
    if pipelined or cfg.tensor_parallel.size > 1:
        from zero.mesh import build_mesh

        mesh = build_mesh(cfg.pipeline.stages, world_size // (cfg.pipeline.stages * cfg.tensor_parallel.size),
                          cfg.tensor_parallel.size, _compute_device(Comm()))
        if auto_plan is not None:  # an HF model nobody sliced: its plan (DeepSpeed's AutoTP)
            from zero.tp import parallelize_for_initialize

            model_parameters = parallelize_for_initialize(model, mesh, auto_plan, model_parameters, optimizer)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    if pipelined:
        from zero.pipe.engine import PipelineEngine

        engine = PipelineEngine(model, cfg, mesh, model_parameters, optimizer, lr_scheduler)
    elif mesh is not None:
        from zero.tp import TensorParallelEngine

        engine = TensorParallelEngine(model, cfg, mesh, model_parameters, optimizer, lr_scheduler)
    else:
        engine = Engine(model, cfg, model_parameters, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:  # its position in the epoch goes into checkpoints
        from zero.data import ResumableLoader

        loader = engine.training_dataloader = ResumableLoader(
            training_data, batch_size=cfg.train_micro_batch_size_per_gpu, num_replicas=engine.comm.world_size,
            rank=engine.comm.rank, collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last)
    return engine, engine.optimizer, loader, engine.lr_scheduler

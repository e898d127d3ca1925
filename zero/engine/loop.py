"""The user-facing engine: forward, backward, step, accumulation, loss scaling, reports.

    engine, optimizer, loader, scheduler = zero.initialize(model=model, config=cfg)
    for x, y in loader:
        loss = engine(x, y)
        engine.backward(loss)        # or loss.backward(), as with plain PyTorch (bf16, fp32)
        engine.step()

The engine delegates: gradients and partitioning live in zero/stages, collectives in zero/parallel/comm.py,
config keys in zero/config/, the mesh of a 3D-parallel run in zero/parallel/mesh.py and the pipeline
schedule in zero/pipe/schedule.py. It owns the training-loop bookkeeping DeepSpeed users rely on:
micro-steps and the accumulation boundary, the loss scale, the global step count.

[Note: one engine, any mesh]
There is one Engine class. A mesh (zero/parallel/mesh.py) changes its data, not its type: the optimizer
partitions over the mesh's "dp" group, the global gradient norm sums over the whole world
(`ModelParallelNorm`), the reports add the pipeline and tensor traffic and how the mesh divides
the parameters (`MeshTraffic`), and a PipelineModule gives the engine a schedule
(`PipelineSchedule`), which `train_batch`/`eval_batch` run; `engine(...)`, `backward` and `step`
are then refused, since the schedule interleaves micro-batches' forward and backward passes.

[Note: backward from PyTorch]
`loss.backward()` followed by `engine.step()` is exactly `engine.backward(loss)` + `engine.step()`
in fp32 and bf16:
- Gradients reach the stage's buckets and units through hooks on the parameters, whoever calls
  backward.
- The loss is not divided by the accumulation steps: the step divides the summed gradients by
  them (see [Note: one divisor] in zero/optim/step.py), so the loss as it is gives the same bits.
- The engine counts backward passes (the step's rank-agreement tag carries the count) with
  `BackwardCounter` (zero/engine/progress.py): hooks on the parameters, ahead of the stage's, count
  each backward that gives a parameter a gradient once, at its end. `engine.backward` counts
  its own call when no parameter got a gradient.
- fp16 needs the loss multiplied by the loss scale, and, as DeepSpeed does, divided by the
  accumulation steps (which keeps fp16 gradients' headroom): `engine.backward(loss)` does it,
  and so does `engine.scale(loss).backward()`. A backward whose loss did not pass through
  `scale` is refused at its first parameter gradient, before the stage takes any.

[Note: an engine without an optimizer]
`initialize` without an optimizer (no `optimizer` section, no `optimizer=`) builds an engine
that evaluates and generates, as DeepSpeed's does: how large models are evaluated and how RLHF
reference models are held. It places the model as a training engine would, every parameter
treated as frozen: stages 0-2 keep a replica in the training dtype on each rank, stage 3 shards
every parameter and gathers each module's around its forward. No gradients, master weights or
optimizer states are kept. `engine.backward` and `engine.step` are refused; a scheduler is ignored
with a warning (a reference model built from the training config has one).
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.checkpoint.periodic import PeriodicSaves
from zero.components import Component
from zero.config import ZeroConfig
from zero.config.rules import client_state_dtype
from zero.engine.build import build_optimizer
from zero.engine.guards import (
    _claim,
    _refuse_claimed,
    _refuse_foreign_parameters,
    check_ranks_agree,
    next_engine_number,
)
from zero.engine.progress import BackwardCounter, TrainingProgress, mark_scaled
from zero.offload.relocation import BACKWARD_NEEDS
from zero.optim.choice import optimizer_groups
from zero.optim.loss_scale import NonFiniteGradientError
from zero.optim.step import ADAM_DEFAULTS, check_param_groups
from zero.parallel.comm import Comm
from zero.parallel.dims import ParallelDims
from zero.parallel.groups import ParallelGroups
from zero.parallel.mesh import MeshTraffic, ModelParallelNorm, ParallelMesh
from zero.parallel.process_group import compute_device
from zero.parallel.sliced import local_tensor
from zero.parallel.tags import Tag
from zero.pipe.module import PipelineModule
from zero.sequence.ulysses import SequenceParallelism
from zero.stages.policies import strict_tag_checks

log = logging.getLogger("zero")
_PIPELINE_API = ("train_batch", "eval_batch", "is_first_stage", "is_last_stage", "agg_train_loss", "agg_eval_loss")


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


def _warn_scheduler_without_optimizer(config: ZeroConfig, lr_scheduler) -> None:
    if lr_scheduler is not None or config.scheduler is not None:
        what = "initialize(lr_scheduler=...)" if lr_scheduler is not None else "the config's 'scheduler' section"
        warnings.warn(f"zero: {what} is ignored: this engine has no optimizer (no 'optimizer' section in the config "
                      f"and no initialize(optimizer=...)) whose learning rate it would change; it evaluates and "
                      f"generates (as DeepSpeed, which also builds no scheduler then)", stacklevel=4)


def _refuse_without_optimizer(what: str) -> None:
    raise RuntimeError(f"{what}: this engine was built without an optimizer (the config has no 'optimizer' section "
                       f"and initialize got no optimizer=), so it evaluates and generates but does not train. "
                       f"Add an 'optimizer' section to the config, or pass initialize(optimizer=...), to train.")


def _check_loss(loss: Any, what: str) -> None:
    if not isinstance(loss, torch.Tensor):
        hint = " (pass the loss inside it, e.g. outputs[0] or outputs.loss)" if isinstance(loss, (tuple, list, dict)) \
            or hasattr(loss, "loss") else ""
        raise TypeError(f"{what} takes the scalar loss tensor, got a {type(loss).__name__}{hint}")


class TrainingLoop(nn.Module):
    """A model wrapped for ZeRO data-parallel training, on any (pp, dp, tp) mesh; see [Note: one
    engine, any mesh]. Build it with `zero.initialize`.

    Args:
        module: the model (a zero.pipe.PipelineModule to train with pipeline stages).
        config: the validated config (`zero.load_config`).
        mesh: the mesh of a run with pipeline stages or tensor slices (zero/parallel/mesh.py); None for
            data parallelism over the whole world.
        parallel: the run's process groups by name (zero/parallel/groups.py); None: the ones the
            config's dimensions give on `mesh`.
        model_parameters: parameters or param groups to train (default: the module's).
        optimizer: a torch optimizer whose hyperparameters and param groups are used.
        lr_scheduler: a scheduler, or a callable building one from the optimizer.
    """

    def __init__(self, module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None = None, *,
                 parallel: ParallelGroups | None = None, model_parameters=None,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None):
        super().__init__()
        if mesh is not None and not isinstance(mesh, ParallelMesh):
            raise TypeError(f"Engine(mesh=...) takes a zero.parallel.mesh.ParallelMesh (zero.tp.mesh(config) builds the one a "
                            f"config asks for), got a {type(mesh).__name__}")
        pipelined = isinstance(module, PipelineModule)
        if pipelined:
            from zero.pipe.schedule import check_pipeline_module

            if mesh is None:
                raise ValueError("a PipelineModule trains on a mesh: build the engine with zero.initialize")
            check_pipeline_module(module, config)
        self.config = config
        self.mesh = mesh
        self.client_optimizer = optimizer  # the optimizer object initialize got (DeepSpeed's name), or None
        if parallel is None:  # the dimensions the config asks for (see [Note: parallel dimensions])
            world = dist.get_world_size() if dist.is_initialized() else 1
            parallel = ParallelGroups(ParallelDims.from_config(config, world), mesh)
        self.parallel = parallel
        # the ranks ZeRO partitions over (the world without a mesh)
        self.comm = parallel.comm("zero", strict_tag_checks(config))
        # hybrid sharding: the ranks holding the same partition (see [Note: placements])
        self.replicate = parallel.comm("replicate") if parallel.size("replicate") > 1 else None
        if self.replicate is not None and mesh is not None:
            raise NotImplementedError(
                f"hybrid sharding (zero_optimization.mics_shard_size, {parallel.size('replicate')} replicas) with "
                f"pipeline stages or tensor slices is not implemented; shard over every data-parallel rank there")
        # every rank whose gradient enters the sum: the zero group, and its replicas
        self.dp = parallel.comm("dp") if self.replicate is not None else self.comm
        # the layout a volume is split in (zero/spatial: the plan the model was converted with): its
        # group's and its grid lines' halo exchanges and statistics join the comm report
        self.spatial = next((m._zero_spatial for m in module.modules() if hasattr(m, "_zero_spatial")), None)
        self.comm.engine = next_engine_number()
        self.device = compute_device(self.comm)
        # without an optimizer (none passed, no optimizer section) the engine evaluates and generates:
        # see [Note: an engine without an optimizer]
        self.trains = optimizer is not None or config.optimizer is not None
        if self.trains:
            client, groups, muon = optimizer_groups(config, optimizer, module, model_parameters)
            check_param_groups(groups, "Check model_parameters / the optimizer's param groups.")
            if any(g.get("eps") == 0 for g in groups):
                warnings.warn("zero: Adam eps is 0: an element whose gradient is 0 (an unused parameter, a padding "
                              "row) gets 0/0 = NaN in the update, as with torch.optim.Adam; use a small eps such as "
                              "1e-8", stacklevel=3)
        else:
            _warn_scheduler_without_optimizer(config, lr_scheduler)
            lr_scheduler = None
            client, muon, groups = None, False, [{**ADAM_DEFAULTS, "params": []}]  # nothing to train: all frozen
        _refuse_claimed(module, {p for g in groups for p in g["params"]}, config.zero_optimization.stage)
        _refuse_foreign_parameters(module, groups, config)
        check_ranks_agree(module, config, self.dp)  # before the first broadcast (replicas included)
        self.module = module
        self.progress = TrainingProgress(accumulation=config.gradient_accumulation_steps)
        if pipelined:
            from zero.pipe.schedule import refuse_diverging_ties, tie_initial_values
            from zero.stages.policies import adam_format

            refuse_diverging_ties(module, adam_format(config, client_state_dtype(optimizer, config)))
            tie_initial_values(module, mesh)  # before ZeRO takes the parameters (it broadcasts over dp)
        else:  # its hooks go ahead of the stage's (see [Note: backward from PyTorch]); a schedule counts its own
            BackwardCounter(self.progress, config.fp16.enabled, {p: n for n, p in module.named_parameters()}).install(
                module, [p for g in groups for p in g["params"]])
        self.optimizer = build_optimizer(module, groups, config, self.comm, self.device, replicate=self.replicate,
                                         client=client,
                                         model_parallel=ModelParallelNorm.of(module, mesh) if mesh is not None else None,
                                         state_dtype=client_state_dtype(optimizer, config), muon=muon)
        _claim(module, self.optimizer, config.zero_optimization.stage)  # whose hooks take the gradients now
        self._trainable = [(n, p, p.requires_grad) for n, p in module.named_parameters()]
        self._warned_count = False
        self._pending_save = None  # an asynchronous checkpoint save being written
        self.training_dataloader = None  # the loader initialize(training_data=...) made
        _place_the_rest(module, self.optimizer.params, self.device, config.dtype, self.dp)
        self.optimizer.at_boundary = config.gradient_accumulation_steps == 1
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self._last_comm: dict = {}
        self._in_no_sync = False
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.pipeline = None
        # Ulysses sequence parallelism (zero.sequence): groups of consecutive ranks share samples
        self.sequence_parallel_size = config.sequence_parallel_size
        self.seq_parallel_group = parallel.group("sp") if parallel.size("sp") > 1 else None
        self.components: dict[str, Component] = {}  # see [Note: engine components]
        self._build_components(pipelined)
        if config.dump_state and self.dp.rank == 0:
            print(f"zero: engine state\n  config: {config.model_dump_json(exclude_defaults=True)}\n"
                  f"  device: {self.device}  world size: {self.dp.world_size}\n"
                  f"  trainable params: {sum(p.numel() for p in self.optimizer.params):,}\n"
                  f"  memory: {self.memory_report()}", flush=True)

    def add_component(self, component: Component) -> None:
        """Hold `component` under its name and call it at the loop's points (see [Note: engine
        components]); a component of the same name is replaced."""
        self.components[component.name] = component

    def _build_components(self, pipelined: bool) -> None:
        """The components the config asks for (see [Note: engine components])."""
        config, mesh = self.config, self.mesh
        if self.seq_parallel_group is not None:
            self.add_component(SequenceParallelism(self.seq_parallel_group, self.sequence_parallel_size))
        ck = config.checkpoint
        if ck.save_interval:
            self.add_component(PeriodicSaves(ck.dir, ck.save_interval, ck.keep_last))
        ac = config.activation_checkpointing  # ZeRO-R, for deepspeed.checkpointing.checkpoint
        if ac.partition_activations or ac.cpu_checkpointing:
            from zero.activations import ActivationCheckpointing

            self.add_component(ActivationCheckpointing(ac.partition_activations, ac.cpu_checkpointing,
                                                       mesh.group("tp") if mesh is not None and mesh.tp > 1 else None))
        if pipelined:
            from zero.pipe.schedule import PipelineSchedule

            self.pipeline = PipelineSchedule(self, mesh)
            self.add_component(self.pipeline)
        self.traffic = None if mesh is None else MeshTraffic(
            self.module, mesh, self.module.parts if pipelined else [],
            sum(slot.master.numel() for slot in self.optimizer.slots()))
        if self.traffic is not None:
            self.add_component(self.traffic)
        if config.csv_monitor.enabled or config.tensorboard.enabled:  # DeepSpeed's monitors (zero/events.py)
            from zero.events import MonitorEvents

            self.add_component(MonitorEvents(config, self.dp.rank))

    def _build_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
        if self.config.scheduler is None or not self.trains:
            return None
        from zero.lr_schedules import build_scheduler

        return build_scheduler(self.config.scheduler.type, dict(self.config.scheduler.params), self.optimizer)

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

    # -- training loop ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_with_pipeline("engine(...)")
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            cast = lambda t: t.to(torch.float16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        with self._timed("forward"):
            return self.module(*args, **kwargs)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale (divided by the accumulation steps, as DeepSpeed scales
        fp16 losses), to call `.backward()` on yourself: `engine.scale(loss).backward()`; without
        fp16, `loss` itself. See [Note: backward from PyTorch]."""
        _check_loss(loss, "engine.scale(loss)")
        if not self.config.fp16.enabled:
            return loss
        scaled = loss.float() * self.optimizer.loss_scaler.loss_factor
        mark_scaled(scaled)
        return scaled

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `engine.scale(loss)`: under fp16 the loss times the loss scale / the
        accumulation steps, otherwise the loss itself (as `loss.backward()`; the step divides by
        the accumulation steps). Gradients flow into the partitioned buffers through hooks.
        Returns the loss it was given."""
        self._refuse_with_pipeline("engine.backward")
        if not self.trains:
            _refuse_without_optimizer("engine.backward(loss)")
        self._check_states_home("engine.backward(loss)", BACKWARD_NEEDS | self.optimizer.storage.forward_kinds)
        _check_loss(loss, "engine.backward(loss)")
        scaled = self.scale(loss)
        counted = self.progress.backwards
        with self._timed("backward"):
            scaled.backward(retain_graph=retain_graph)
        if self.progress.backwards == counted:  # no parameter got a gradient: it is still a backward
            self.progress.backwards += 1
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` call will update the weights."""
        return (self.progress.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Call after every micro-batch's backward; updates weights only at the boundary."""
        self._refuse_with_pipeline("engine.step")
        if not self.trains:
            _refuse_without_optimizer("engine.step()")
        self._check_states_home("engine.step()")
        if self._in_no_sync:
            raise RuntimeError("engine.step() was called inside no_sync(): the gradients of the steps inside are not "
                               "reduced across ranks, so stepping now would update each rank with its own gradient "
                               "and the ranks would diverge. Leave the no_sync() context before calling step().")
        boundary = self.is_gradient_accumulation_boundary()
        updated = self._update() if boundary else False
        self._advance(1)
        if boundary:
            self._after_update(updated)

    def _update(self) -> bool:
        """The optimizer step at an accumulation boundary; nothing of the engine changes if it raises."""
        self._check_trainable_unchanged()  # requires_grad flipped since initialize
        # every rank at this step after the same number of backward passes (a rank that skipped
        # one would contribute stale or zero gradients), before its collectives
        steps, backwards = self.progress.global_steps + 1, self.progress.backwards
        self.dp.agree(Tag.STEP, steps, backwards, f"optimizer step {steps}")  # replicas too: they sum at the step
        for component in list(self.components.values()):
            component.before_step(self)
        if not backwards and not self._warned_count:
            self._warned_count = True
            warnings.warn(
                f"zero: optimizer step {steps} comes after no backward pass: it applies weight decay and Adam's "
                f"momentum without new gradients. Call loss.backward() or engine.backward(loss) before "
                f"engine.step() (warned once)", stacklevel=3)
        with self._timed("step"):
            return self.optimizer.step()  # checks its hyperparameters and takes in-place edits first

    def _advance(self, micro_steps: int) -> None:
        """Count `micro_steps` micro-batches done."""
        p = self.progress
        p.micro_steps += micro_steps
        p.global_samples += self.config.train_micro_batch_size_per_gpu * self.dp_world_size * micro_steps
        p.last_step_applied = p.last_step_skipped = False
        self.optimizer.at_boundary = self.is_gradient_accumulation_boundary()  # for the next backward

    def _after_update(self, updated: bool) -> None:
        """The bookkeeping of a boundary step: buffers, scheduler, counters, reports."""
        p = self.progress
        p.backwards = 0
        if self.dp.world_size > 1 and self.module.training:
            self._sync_buffers()
        if updated:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            p.skipped_steps += 1
        p.global_steps += 1
        p.last_step_applied, p.last_step_skipped = updated, not updated
        if not updated:
            self._report_skip()
        self._last_comm = self.comm.report()
        self.comm.reset_counts()
        spatial = () if self.spatial is None else (self.spatial.comm, *self.spatial.axes)
        for other in {id(c): c for c in (self.replicate, self.dp, *spatial, *self.optimizer.storage.side_comms())
                      if c is not None and c is not self.comm}.values():
            for label, count in other.report().items():  # the replicas' all-reduces, the buffers' sync, halos
                total = self._last_comm.setdefault(label, dict.fromkeys(count, 0))
                for key in count:
                    total[key] += count[key]
            other.reset_counts()
        every = self.config.steps_per_print
        if every and p.global_steps % every == 0 and self.dp.rank == 0:
            self._print_progress(every)
        for component in list(self.components.values()):  # see [Note: engine components]
            component.after_step(self, updated)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel replicas: the ranks that load different samples (a sequence-parallel group
        shares its samples; see [Note: parallel dimensions] in zero/parallel/dims.py)."""
        return self.parallel.size("batch")

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """Keep BatchNorm-style running statistics identical on every rank: average running_mean
        and running_var over ranks (the update is linear, so the average is the running statistic
        of the global batch) and take rank 0's batch count. Other buffers (masks, rotary tables)
        are constants and are left alone."""
        for m in self.module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
                for b in (m.running_mean, m.running_var):
                    self.dp.all_reduce(b, "sum")
                    b.div_(self.dp.world_size)
                self.dp.broadcast(m.num_batches_tracked, src=0)

    # -- the pipeline schedule (a PipelineModule's engine) --------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's pipeline API (`train_batch`, `eval_batch`, `is_first_stage`, `is_last_stage`,
        `agg_train_loss`, `agg_eval_loss`) exists when the engine has a pipeline schedule. Any other
        name the engine lacks is looked up on the wrapped module, as DeepSpeed does
        (`engine.generate(...)`, a user's own method or attribute)."""
        if name in _PIPELINE_API:
            pipeline = self.__dict__.get("pipeline")
            if pipeline is not None:
                return getattr(pipeline, name)
            raise AttributeError(f"'Engine' object has no attribute {name!r}: it belongs to a pipeline schedule, which "
                                 f"an engine has when its model is a zero.pipe.PipelineModule (docs/parallelism.md); "
                                 f"train this one with engine(...), engine.backward(loss) and engine.step()")
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            hint = "" if name.startswith("_") else (
                "; DeepSpeed's engine accessors and methods (engine.train_batch_size(), engine.fp16_enabled(), ...) "
                "are on the engine `import zero.deepspeed as deepspeed; deepspeed.initialize(...)` returns, and "
                "zero's engine has the config itself as engine.config")
            raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an attribute "
                                 f"{name!r}{hint}") from None

    def _refuse_with_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise RuntimeError(f"{what}: a pipeline engine runs whole batches, forward and backward interleaved over "
                               f"the micro-batches: call engine.train_batch(data_iter) (or eval_batch)")

    def _step_batch(self, micro_batches: int) -> None:
        """The optimizer step after a schedule ran `micro_batches` forward and backward passes."""
        self.progress.backwards = micro_batches
        updated = self._update()
        self._advance(micro_batches)
        self._after_update(updated)

    # -- state ---------------------------------------------------------------------------------

    @property
    def micro_steps(self) -> int:
        return self.progress.micro_steps

    @property
    def global_steps(self) -> int:
        return self.progress.global_steps

    @property
    def skipped_steps(self) -> int:
        return self.progress.skipped_steps

    @property
    def global_samples(self) -> int:
        return self.progress.global_samples

    # -- checks and reports of a step ----------------------------------------------------------

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
        if self.dp.rank != 0:
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

    def _check_states_home(self, what: str, needs: set[str] | None = None) -> None:
        """Raise if model states `what` needs (None: all) are offloaded (see offload_states)."""
        away = self.__dict__.get("_away")
        if away is not None:
            away.check(what, needs)

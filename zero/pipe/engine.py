"""PipelineEngine: DeepSpeed's train_batch / eval_batch on torch.distributed.pipelining, with ZeRO
over each stage's data-parallel group.

[Note: a pipelined step]
`train_batch(data_iter)` is one optimizer step over M micro-batches (M = pipeline.micro_batches,
which is gradient_accumulation_steps):
1. The first stage's ranks draw M (inputs, labels) micro-batches, the last stage's ranks the same
   M (their labels); the schedule (torch's ScheduleGPipe, Schedule1F1B or
   ScheduleInterleaved1F1B over the mesh's "pp" group) runs every micro-batch's forward and
   backward. The loss of each micro-batch is divided by M (times the fp16 loss scale), so the
   gradients add up to the gradient of the mean loss, as with accumulation; the schedule's own
   gradient scaling is off.
2. Gradients reach the ZeRO optimizer through its hooks exactly as with accumulation: at stages
   0 and 1 into the flat gradient, at stage 2 reduce-scattered over the "dp" group after each
   micro-batch's backward (the interleaved schedule's backwards each cover one part, so each one
   reduces every bucket; see docs/parallelism.md).
3. Tied parameters (a TiedLayerSpec's module on several stages) have their gradients summed over
   the stages that hold them, before the step.
4. The step: the global norm over every stage and slice (zero/mesh.py's ModelParallelNorm),
   clipping, the fp16 overflow check (a non-finite gradient anywhere skips the step on every
   rank), Adam on each rank's shard and the parameter all-gather over "dp".
5. The mean loss of the M micro-batches goes from the last stage to every rank, averaged over the
   data-parallel replicas, and is returned.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from zero.comm import Comm
from zero.config import ZeroConfig
from zero.engine import Engine
from zero.mesh import MeshReports, ModelParallelNorm, ParallelMesh, WholeModelSaveRefusal, group_of, replica_counts
from zero.partition.layout import local_tensor
from zero.pipe.module import PipelineModule

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class PipelineEngine(WholeModelSaveRefusal, MeshReports, Engine):
    """A PipelineModule trained with pipeline stages (and tensor slices) composed with ZeRO over
    the data-parallel group. Built by `zero.initialize`; train with `train_batch`."""

    def __init__(self, module: PipelineModule, config: ZeroConfig, mesh: ParallelMesh, model_parameters=None,
                 optimizer=None, lr_scheduler=None):
        p = config.pipeline
        if module.num_stages != p.stages:
            raise ValueError(f"the PipelineModule has num_stages={module.num_stages} but pipeline.stages is {p.stages}")
        for key, mine, theirs in (("partition_method", module.partition_method, p.partition_method),
                                  ("virtual_stages", module.virtual_stages, p.virtual_stages)):
            if theirs is not None and str(theirs).lower() != str(mine).lower():
                raise ValueError(f"pipeline.{key} is {theirs!r} but the PipelineModule was built with {key}={mine!r}: "
                                 f"the module splits its layers when it is built (each rank builds only its own); "
                                 f"give the same value, or leave pipeline.{key} out")
        interleaved = p.schedule == "interleaved_1f1b"
        if interleaved != (module.virtual_stages > 1):
            raise ValueError(f"pipeline.schedule {p.schedule!r} with a PipelineModule of virtual_stages="
                             f"{module.virtual_stages}: the interleaved schedule needs virtual_stages >= 2 (build "
                             f"PipelineModule(..., virtual_stages=2)), the others virtual_stages=1")
        if config.zero_optimization.stage == 3:
            raise ValueError("zero_optimization.stage 3 with a pipeline is not supported: each stage would gather "
                             "its parameters again for every micro-batch's forward and backward (M times a step). "
                             "Use stage 1 or 2, which partition optimizer states and gradients over the data-"
                             "parallel ranks of each stage")
        if module.loss_fn is None:
            raise ValueError("PipelineModule(loss_fn=...) is needed: the last stage computes the loss of each "
                             "micro-batch with it")
        self.mesh = mesh
        _tie_initial_values(module, mesh)  # before ZeRO takes the parameters (it broadcasts over dp)
        super().__init__(module, config, model_parameters, optimizer, lr_scheduler,
                         comm=Comm(mesh.group("dp")) if dist.is_initialized() else Comm())
        self.world = Comm()
        self._first, self._last = mesh.coordinate("pp") == 0, mesh.coordinate("pp") == mesh.pp - 1
        self._tied = _tied_groups(module, mesh, self.optimizer)
        copies = replica_counts(module, mesh)
        for key, tied in module.tied_modules.items():
            for q in tied.parameters():
                copies[q] = copies.get(q, 1) * len(module.tied_stages(key))
        self.optimizer.model_parallel = ModelParallelNorm(self.world, copies)
        parts = module.num_stages * module.virtual_stages
        self._stages = [PipelineStage(part, part.index, parts, self.device, group=mesh.group("pp"))
                        for part in module.parts]
        schedule = _SCHEDULES[p.schedule]
        stage = self._stages if interleaved else self._stages[0]
        self._schedule = schedule(stage, p.micro_batches, loss_fn=self._loss, scale_grads=False)
        self._losses: list[torch.Tensor] = []
        self._init_mesh_reports(module.parts)
        self.agg_train_loss: torch.Tensor | None = None
        self.agg_eval_loss: torch.Tensor | None = None

    # -- DeepSpeed's pipeline API -----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) (or "
                           "eval_batch), not engine(...)")

    def backward(self, loss, retain_graph: bool = False):
        raise RuntimeError("a pipeline engine runs backward inside engine.train_batch(data_iter)")

    def step(self) -> None:
        raise RuntimeError("a pipeline engine steps inside engine.train_batch(data_iter)")

    def is_first_stage(self) -> bool:
        """This rank runs the first pipeline stage (it reads the inputs)."""
        return self._first

    def is_last_stage(self) -> bool:
        """This rank runs the last pipeline stage (it reads the labels and computes the loss)."""
        return self._last

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over `pipeline.micro_batches` micro-batches drawn from `data_iter`
        (each an (inputs, labels) pair; the first and last stages need it, the others may pass
        None). Returns the mean loss, the same on every rank. See [Note: a pipelined step]."""
        m = self.config.gradient_accumulation_steps
        inputs, labels = self._draw(self._default_iter() if data_iter is None else data_iter, m)
        self.module.train()
        self._losses = []
        self.optimizer.at_boundary = False  # gradient copies to the host (offload) wait for the step
        with self._timed("forward"):  # forward and backward are interleaved: one figure for both
            self._run(inputs, labels, backward=True)
        self._sum_tied_gradients()
        self._backwards = m
        for _ in range(m):  # the accumulation bookkeeping of m micro-steps; the last one steps
            Engine.step(self)
        self._close_traffic_window()
        self.agg_train_loss = self._mean_loss()
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", num_micro_batches: int | None = None) -> Any:
        """Forward only over the micro-batches of one batch; returns the mean loss on every rank
        (and, with `return_logits`, the last stage's outputs on the last stage's ranks)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output must be 'avg' or None, got {reduce_output!r}")
        m = num_micro_batches or self.config.gradient_accumulation_steps
        if m != self.config.gradient_accumulation_steps:
            raise ValueError(f"eval_batch(num_micro_batches={m}): the schedule was built for "
                             f"{self.config.gradient_accumulation_steps} micro-batches per batch")
        inputs, labels = self._draw(data_iter, m)
        was_training = self.module.training
        self.module.eval()
        self._losses = []
        try:
            with torch.no_grad():
                outputs = self._run(inputs, labels, backward=False)
        finally:
            self.module.train(was_training)
        self.agg_eval_loss = self._mean_loss() if compute_loss else None
        if return_logits:
            return self.agg_eval_loss, outputs
        return self.agg_eval_loss

    # -- the pieces -------------------------------------------------------------------------------

    def _default_iter(self) -> Iterator | None:
        """DeepSpeed's train_batch() without data_iter: the loader of initialize(training_data=...),
        repeated."""
        if self.training_dataloader is None:
            return None
        if getattr(self, "_repeating", None) is None:
            from zero.data import RepeatingLoader

            self._repeating = RepeatingLoader(self.training_dataloader)
        return self._repeating

    def _loss(self, output: Any, labels: Any) -> torch.Tensor:
        loss = self.module.loss_fn(output, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"the PipelineModule's loss_fn must return a scalar tensor, got "
                            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        m = self.config.gradient_accumulation_steps
        return loss.float() * (self.optimizer.loss_scaler.scale / m)

    def _draw(self, data_iter: Iterator | None, m: int) -> tuple[Any, Any]:
        """The M micro-batches as one batch of inputs and one of labels (the schedule splits them
        again), for the stages that need them."""
        needs = self._first or self._last
        if not needs:
            return None, None
        if data_iter is None:
            raise ValueError(f"train_batch/eval_batch on pipeline stage {self.mesh.coordinate('pp')} (a first or last "
                             f"stage) needs data_iter: an iterator of (inputs, labels) micro-batches")
        batches = []
        for i in range(m):
            try:
                item = next(data_iter)
            except StopIteration:
                raise ValueError(f"data_iter ran out after {i} of the {m} micro-batches of this step") from None
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"data_iter must yield (inputs, labels) pairs, got a {type(item).__name__}")
            batches.append(item)
        return _concat([b[0] for b in batches]), _concat([b[1] for b in batches])

    def _run(self, inputs: Any, labels: Any, backward: bool) -> Any:
        args = (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)) if self._first else ()
        args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        target = labels.to(self.device) if self._last and isinstance(labels, torch.Tensor) else labels
        losses: list[torch.Tensor] = []  # the schedule's: one per micro-batch (its first step also runs the loss
        # once on a shape-inference output, which does not land here)
        kwargs = {"target": target if self._last else None, "losses": losses if self._last else None}
        run = self._schedule.step if backward else self._schedule.eval
        out = run(*args, **kwargs)
        unscale = self.config.gradient_accumulation_steps / self.optimizer.loss_scaler.scale
        self._losses = [loss.detach().float() * unscale for loss in losses]
        return out

    def _mean_loss(self) -> torch.Tensor:
        """The micro-batches' mean loss, from the last stage to every rank, averaged over dp."""
        last = self.mesh.pp - 1
        loss = torch.stack(self._losses).mean() if self._losses else torch.zeros(())
        loss = loss.to(self.device).reshape(1)
        if self.mesh.pp > 1:
            dist.broadcast(loss, src=dist.get_global_rank(self.mesh.group("pp"), last), group=self.mesh.group("pp"))
        if self.comm.world_size > 1:
            self.comm.all_reduce(loss, "sum")
            loss /= self.comm.world_size
        return loss[0]

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        """See [Note: a pipelined step], 3."""
        for param, group in self._tied:
            offset, piece, reduced = self.optimizer.grad_piece(param)
            if not reduced:  # this rank's own gradient, whole: sum over the stages (same data rank)
                dist.all_reduce(piece, group=group)
                continue
            # stage 2: each data rank holds a different part of the reduced sum, at another place
            # on another stage; the parts of the whole gradient, summed over stages and data ranks
            whole = torch.zeros(local_tensor(param).numel(), dtype=piece.dtype, device=piece.device)
            whole[offset : offset + piece.numel()] = piece
            dist.all_reduce(whole, group=group)
            piece.copy_(whole[offset : offset + piece.numel()])


def _concat(items: list[Any]) -> Any:
    if isinstance(items[0], torch.Tensor):
        return torch.cat(items)
    if isinstance(items[0], (tuple, list)):
        return tuple(_concat([x[i] for x in items]) for i in range(len(items[0])))
    raise TypeError(f"micro-batch inputs and labels must be tensors or tuples of tensors, got {type(items[0]).__name__}")


def _tie_groups_ranks(module: PipelineModule, mesh: ParallelMesh, key: str, all_data: bool) -> list[int]:
    dp, tp = mesh.coordinate("dp"), mesh.coordinate("tp")
    stages = module.tied_stages(key)
    data = range(mesh.dp) if all_data else [dp]
    return [mesh.rank_of(s, d, tp) for s in stages for d in data]


@torch.no_grad()
def _tie_initial_values(module: PipelineModule, mesh: ParallelMesh) -> None:
    """Every stage holding a tied module starts from the first such stage's values."""
    for key, tied in module.tied_modules.items():
        ranks = _tie_groups_ranks(module, mesh, key, all_data=False)
        if len(ranks) < 2:
            continue
        group = group_of(ranks)
        for t in [*tied.parameters(), *tied.buffers()]:
            dist.broadcast(local_tensor(t).data, src=ranks[0], group=group)


def _tied_groups(module: PipelineModule, mesh: ParallelMesh, optimizer) -> list[tuple[torch.nn.Parameter, Any]]:
    """(parameter, group) for every trainable tied parameter held on more than one stage."""
    out = []
    reduced = getattr(optimizer, "stage", 0) >= 2
    for key, tied in module.tied_modules.items():
        ranks = _tie_groups_ranks(module, mesh, key, all_data=reduced)
        if len(module.tied_stages(key)) < 2:
            continue
        group = group_of(ranks)
        out += [(q, group) for q in tied.parameters() if q.requires_grad]
    return out

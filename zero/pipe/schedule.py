"""The pipeline schedule an engine owns when its model is a PipelineModule: DeepSpeed's train_batch /
eval_batch on torch.distributed.pipelining, with ZeRO over each stage's data-parallel group.

[Note: a pipelined step]
`train_batch(data_iter)` is one optimizer step over M micro-batches (M = pipeline.micro_batches,
which is gradient_accumulation_steps):
1. The first stage's ranks draw M (inputs, labels) micro-batches, the last stage's ranks the same
   M (their labels); the schedule (torch's ScheduleGPipe, Schedule1F1B or
   ScheduleInterleaved1F1B over the mesh's "pp" group) runs every micro-batch's forward and
   backward. The loss of each micro-batch goes in as it is (under fp16 times the loss scale / M);
   the gradients add up as with accumulation and the step divides as it does there (see
   [Note: one divisor] in zero/optim/step.py); the schedule's own gradient scaling is off.
2. Gradients reach the ZeRO optimizer through its hooks exactly as with accumulation: at stages
   0 and 1 into the flat gradient, at stage 2 reduce-scattered over the "dp" group after each
   micro-batch's backward (the interleaved schedule's backwards each cover one part, so each one
   reduces every bucket; see docs/parallelism.md).
3. Tied parameters (a TiedLayerSpec's module on several stages) have their gradients summed over
   the stages that hold them, before the step.
4. The step: the global norm over every stage and slice (zero/parallel/mesh.py's ModelParallelNorm),
   clipping, the fp16 overflow check (a non-finite gradient anywhere skips the step on every
   rank), Adam on each rank's shard and the parameter all-gather over "dp".
5. The mean loss of the M micro-batches goes from the last stage to every rank, averaged over the
   data-parallel replicas, and is returned.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from zero.components import Component
from zero.config import ZeroConfig
from zero.parallel.comm import Comm
from zero.parallel.groups import group_of, shared_comm
from zero.parallel.mesh import ParallelMesh
from zero.parallel.sliced import local_tensor
from zero.pipe.module import PipelineModule

KIND = "pipeline"  # the shared Comms' kind (see [Note: one group registry] in zero/parallel/groups.py)
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def check_pipeline_module(module: PipelineModule, config: ZeroConfig) -> None:
    """The PipelineModule was built the way the config's `pipeline` section describes (each rank
    builds its own layers when the module is built, so the config cannot change the split)."""
    p = config.pipeline
    if module.num_stages != p.stages:
        raise ValueError(f"the PipelineModule has num_stages={module.num_stages} but pipeline.stages is {p.stages}")
    for key, mine, theirs in (("partition_method", module.partition_method, p.partition_method),
                              ("virtual_stages", module.virtual_stages, p.virtual_stages)):
        if theirs is not None and str(theirs).lower() != str(mine).lower():
            raise ValueError(f"pipeline.{key} is {theirs!r} but the PipelineModule was built with {key}={mine!r}: "
                             f"the module splits its layers when it is built (each rank builds only its own); "
                             f"give the same value, or leave pipeline.{key} out")
    if (p.schedule == "interleaved_1f1b") != (module.virtual_stages > 1):
        raise ValueError(f"pipeline.schedule {p.schedule!r} with a PipelineModule of virtual_stages="
                         f"{module.virtual_stages}: the interleaved schedule needs virtual_stages >= 2 (build "
                         f"PipelineModule(..., virtual_stages=2)), the others virtual_stages=1")
    if module.loss_fn is None:
        raise ValueError("PipelineModule(loss_fn=...) is needed: the last stage computes the loss of each "
                         "micro-batch with it")
    for part in module.parts:  # recomputation is the config's to choose, as in DeepSpeed
        if p.activation_checkpoint_interval > 0:
            part.checkpoint_every = p.activation_checkpoint_interval
        part.use_reentrant = bool(p.use_reentrant)


def refuse_diverging_ties(module: PipelineModule, fmt) -> None:
    """Tied modules on several stages stay equal because every stage applies the same update to
    the same values; a stochastically rounded bf16 master or bf16 moments would round each
    stage's copy with other random bits (the counter is the element's place in its own stage's
    layout), and the copies would drift apart. Refused before anything is built."""
    from zero.config.errors import ConfigError

    spread = [key for key in module.tied_modules if len(module.tied_stages(key)) > 1]
    if spread and fmt.stochastic and "bf16" in (fmt.master, fmt.state):
        raise ConfigError(f"bf16.stochastic_rounding: the pipeline ties {spread} across stages, whose copies would "
                          f"be rounded with different random bits and drift apart; set bf16.stochastic_rounding to "
                          f"false (round to nearest) with a bf16 master or bf16 moments, or use 8-bit moments with "
                          f"an fp32 master")


@torch.no_grad()
def tie_initial_values(module: PipelineModule, mesh: ParallelMesh) -> None:
    """Every stage holding a tied module starts from the first such stage's values (before ZeRO
    takes the parameters, which broadcasts over "dp")."""
    for key, tied in module.tied_modules.items():
        ranks = _tie_ranks(module, mesh, key, all_data=False)
        if len(ranks) < 2:
            continue
        comm = shared_comm(group_of(ranks), KIND)
        for t in [*tied.parameters(), *tied.buffers()]:
            comm.broadcast(local_tensor(t).data, src=sorted(ranks).index(ranks[0]), label="broadcast (tied parameters)")


class PipelineSchedule(Component):
    """One rank's stages of a PipelineModule and the schedule that runs them (see [Note: a
    pipelined step]): the pipeline API of the engine that owns it (`engine.train_batch`, ...); the
    engine's "pipeline" component (see [Note: engine components]).

    Args:
        engine: the engine whose model is the PipelineModule (held weakly); it steps the optimizer.
        mesh: the (pp, dp, tp) mesh.
    """

    name = "pipeline"

    def __init__(self, engine, mesh: ParallelMesh):
        module, config = engine.module, engine.config
        p = config.pipeline
        self._engine = weakref.proxy(engine)
        self.module, self.mesh, self.device = module, mesh, engine.device
        self.storage, self.loss_scaler = engine.optimizer.storage, engine.optimizer.loss_scaler
        self.micro_batches = config.gradient_accumulation_steps
        self.first, self.last = mesh.coordinate("pp") == 0, mesh.coordinate("pp") == mesh.pp - 1
        self._tied = [(key, q) for key, tied in module.tied_modules.items() if len(module.tied_stages(key)) > 1
                      for q in tied.parameters() if q.requires_grad]
        parts = module.num_stages * module.virtual_stages
        self._stages = [PipelineStage(part, part.index, parts, self.device, group=mesh.group("pp"))
                        for part in module.parts]
        stage = self._stages if p.schedule == "interleaved_1f1b" else self._stages[0]
        self._schedule = _SCHEDULES[p.schedule](stage, p.micro_batches, loss_fn=self._loss, scale_grads=False)
        self._losses: list[torch.Tensor] = []
        self._repeating = None  # initialize(training_data=...)'s loader, repeated, for train_batch()
        self.agg_train_loss: torch.Tensor | None = None  # the last train_batch's mean loss
        self.agg_eval_loss: torch.Tensor | None = None

    # -- DeepSpeed's pipeline API ----------------------------------------------------------------

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over `pipeline.micro_batches` micro-batches drawn from `data_iter`
        (each an (inputs, labels) pair; the first and last stages need it, the others may pass
        None; default: the loader of initialize(training_data=...), repeated). Returns the mean
        loss, the same on every rank. See [Note: a pipelined step]."""
        engine = self._engine
        inputs, labels = self._draw(self._data(data_iter), self.micro_batches)
        engine.optimizer.at_boundary = False  # offload's copies to the host wait for the step: every micro-batch adds
        self.module.train()
        self._losses = []
        with engine._timed("forward"):  # forward and backward are interleaved: one figure for both
            self._run(inputs, labels, backward=True)
        self._sum_tied_gradients()
        engine._step_batch(self.micro_batches)
        self.agg_train_loss = self._mean_loss(engine.comm)
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", num_micro_batches: int | None = None) -> Any:
        """Forward only over the micro-batches of one batch; returns the mean loss on every rank
        (and, with `return_logits`, the last stage's outputs on the last stage's ranks)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output must be 'avg' or None, got {reduce_output!r}")
        m = num_micro_batches or self.micro_batches
        if m != self.micro_batches:
            raise ValueError(f"eval_batch(num_micro_batches={m}): the schedule was built for "
                             f"{self.micro_batches} micro-batches per batch")
        inputs, labels = self._draw(data_iter, m)
        was_training = self.module.training
        self.module.eval()
        self._losses = []
        try:
            with torch.no_grad():
                outputs = self._run(inputs, labels, backward=False)
        finally:
            self.module.train(was_training)
        self.agg_eval_loss = self._mean_loss(self._engine.comm) if compute_loss else None
        if return_logits:
            return self.agg_eval_loss, outputs
        return self.agg_eval_loss

    def is_first_stage(self) -> bool:
        """This rank runs the first pipeline stage (it reads the inputs)."""
        return self.first

    def is_last_stage(self) -> bool:
        """This rank runs the last pipeline stage (it reads the labels and computes the loss)."""
        return self.last

    def _data(self, data_iter: Iterator | None) -> Iterator | None:
        loader = self._engine.training_dataloader
        if data_iter is not None or loader is None:
            return data_iter
        if self._repeating is None:
            from zero.data import RepeatingLoader

            self._repeating = RepeatingLoader(loader)
        return self._repeating

    def _mean_loss(self, comm: Comm) -> torch.Tensor:
        """The micro-batches' mean loss, from the last stage to every rank, averaged over dp (`comm`)."""
        last = self.mesh.pp - 1
        loss = torch.stack(self._losses).mean() if self._losses else torch.zeros(())
        loss = loss.to(self.device).reshape(1)
        if self.mesh.pp > 1:
            shared_comm(self.mesh.group("pp"), KIND).broadcast(loss, src=last, label="broadcast (pipeline loss)")
        if comm.world_size > 1:
            comm.all_reduce(loss, "sum")
            loss /= comm.world_size
        return loss[0]

    # -- the pieces -------------------------------------------------------------------------------

    def _loss(self, output: Any, labels: Any) -> torch.Tensor:
        loss = self.module.loss_fn(output, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"the PipelineModule's loss_fn must return a scalar tensor, got "
                            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        factor = self.loss_scaler.loss_factor  # fp16; 1 otherwise (see [Note: one divisor])
        return loss.float() * factor if factor != 1.0 else loss.float()

    def _draw(self, data_iter: Iterator | None, m: int) -> tuple[Any, Any]:
        """The M micro-batches as one batch of inputs and one of labels (the schedule splits them
        again), for the stages that need them."""
        if not (self.first or self.last):
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
        args = (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)) if self.first else ()
        args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        target = labels.to(self.device) if self.last and isinstance(labels, torch.Tensor) else labels
        losses: list[torch.Tensor] = []  # the schedule's: one per micro-batch (its first step also runs the loss
        # once on a shape-inference output, which does not land here)
        kwargs = {"target": target if self.last else None, "losses": losses if self.last else None}
        run = self._schedule.step if backward else self._schedule.eval
        out = run(*args, **kwargs)
        unscale = 1.0 / self.loss_scaler.loss_factor
        self._losses = [loss.detach().float() * unscale for loss in losses]
        return out

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        """See [Note: a pipelined step], 3."""
        for key, param in self._tied:
            offset, piece, reduced = self.storage.grad_piece(param)
            # stages 0 and 1: this rank's own gradient, whole: summed over the stages (same data
            # rank); stage 2: each data rank holds a different part of the reduced sum, at another
            # place on another stage: the parts of the whole gradient, summed over stages and data ranks
            comm = shared_comm(group_of(_tie_ranks(self.module, self.mesh, key, all_data=reduced)), KIND)
            if not reduced:
                comm.all_reduce(piece, "sum", label="all_reduce (tied gradients)")
                continue
            whole = torch.zeros(local_tensor(param).numel(), dtype=piece.dtype, device=piece.device)
            whole[offset : offset + piece.numel()] = piece
            comm.all_reduce(whole, "sum", label="all_reduce (tied gradients)")
            piece.copy_(whole[offset : offset + piece.numel()])


def _concat(items: list[Any]) -> Any:
    if isinstance(items[0], torch.Tensor):
        return torch.cat(items)
    if isinstance(items[0], (tuple, list)):
        return tuple(_concat([x[i] for x in items]) for i in range(len(items[0])))
    raise TypeError(f"micro-batch inputs and labels must be tensors or tuples of tensors, got {type(items[0]).__name__}")


def _tie_ranks(module: PipelineModule, mesh: ParallelMesh, key: str, all_data: bool) -> list[int]:
    dp, tp = mesh.coordinate("dp"), mesh.coordinate("tp")
    stages = module.tied_stages(key)
    data = range(mesh.dp) if all_data else [dp]
    return [mesh.rank_of(s, d, tp) for s in stages for d in data]

"""Activation checkpointing with ZeRO-R's two savings: checkpointed activations partitioned over
the model-parallel group, and kept in host memory.

[Note: ZeRO-R checkpoints]
A checkpointed block keeps only its inputs; backward recomputes the rest. Under tensor parallelism
those inputs (the hidden states between blocks) are the same on every rank of the tensor-parallel
group, so with `partition_activations` each rank keeps 1/P of them (a flat slice) and the group
all-gathers them before the recomputation (ZeRO-R's Pa). With `checkpoint_in_cpu` the kept inputs
(or slices) are copied to pinned host memory without blocking the host (on the current stream, so
the copy is ordered before any reuse of the device memory) and copied back when the block's
backward recomputes it (Pa+cpu); copying on a side stream and fetching ahead of the recomputation
are not done (not yet measured on a GPU). On a CPU-only run the activations already are in host
memory, and this is a no-op, logged once. The recomputation replays the CPU and (with CUDA) the
current device's random-number states of the forward, so dropout draws the same. Without either,
`checkpoint` is torch's non-reentrant checkpoint. With them, the recomputation runs in backward as a
reentrant checkpoint's does (DeepSpeed's is one too): each block's parameters get their gradients
from its own backward (zero's hooks take them as they arrive), and a block none of whose tensor
inputs requires grad gives its parameters none (frozen embeddings before it: make the input
require grad, as with torch's reentrant checkpoint).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from zero.components import Component

log = logging.getLogger("zero")


class _Settings:
    partition: bool = False
    cpu: bool = False
    group = None  # the model-parallel group whose ranks hold the same activations


settings = _Settings()
_told: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _told:
        _told.add(key)
        log.info(message)


def configure(partition_activations: bool | None = None, checkpoint_in_cpu: bool | None = None, group=None) -> None:
    """Switch ZeRO-R's partitioned (`partition_activations`, over `group`: ranks holding the same
    activations, e.g. the tensor-parallel group) and host-memory (`checkpoint_in_cpu`) checkpoints
    on or off (None: leave as is)."""
    if partition_activations is not None:
        settings.partition = bool(partition_activations)
    if checkpoint_in_cpu is not None:
        settings.cpu = bool(checkpoint_in_cpu)
    if group is not None:
        settings.group = group


def _group_size() -> int:
    g = settings.group
    return dist.get_world_size(g) if g is not None and dist.is_initialized() else 1


class _Kept:
    """One tensor input as the checkpoint keeps it: whole, a slice of it, in host memory or not."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.device, self.requires_grad = t.shape, t.dtype, t.device, t.requires_grad
        flat = t.detach().reshape(-1)
        self.parts = _group_size() if settings.partition else 1
        if self.parts > 1:
            n = -(-flat.numel() // self.parts)
            flat = torch.nn.functional.pad(flat, (0, n * self.parts - flat.numel()))
            flat = flat[dist.get_rank(settings.group) * n : (dist.get_rank(settings.group) + 1) * n].clone()
        elif settings.partition:
            _say_once("partition", "zero: partition_activations has no model-parallel group of more than one rank "
                                   "here; checkpointed activations are kept whole")
        if settings.cpu and flat.device.type != "cpu":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(flat, non_blocking=True)
            flat = host
        elif settings.cpu:
            _say_once("cpu", "zero: checkpoint_in_cpu: the activations already are in host memory (a CPU-only run); "
                             "nothing to move")
        self.flat = flat

    def restore(self) -> torch.Tensor:
        flat = self.flat.to(self.device, non_blocking=True)
        if self.parts > 1:
            whole = torch.empty(flat.numel() * self.parts, dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(whole, flat, group=settings.group)
            flat = whole
        numel = 1
        for s in self.shape:
            numel *= s
        return flat[:numel].view(self.shape).detach().requires_grad_(self.requires_grad)

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def _rng_states() -> tuple:
    """The CPU generator's state and, with CUDA, the current device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.kept = [_Kept(a) if isinstance(a, torch.Tensor) else a for a in args]
        ctx.rng = _rng_states()
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [k.restore() if isinstance(k, _Kept) else k for k in ctx.kept]
        rng = _rng_states()
        _set_rng_states(ctx.rng)  # dropout draws what the forward drew, on the CPU and the GPU
        try:
            with torch.enable_grad():
                out = ctx.function(*inputs)
        finally:
            _set_rng_states(rng)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *[t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs])


def checkpoint(function, *args):
    """`function(*args)` without keeping its activations (recomputed in backward); its tensor inputs
    kept partitioned and/or in host memory as `configure` says (see [Note: ZeRO-R checkpoints])."""
    if not (settings.partition or settings.cpu):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return _Checkpoint.apply(function, *args)


def kept_bytes(args) -> int:
    """Bytes the checkpoint would keep of `args` now (for tests and the estimator)."""
    return sum(_Kept(a).nbytes() for a in args if isinstance(a, torch.Tensor))


class ActivationCheckpointing(Component):
    """ZeRO-R as the engine's "activations" component (see [Note: engine components]): the
    config's `activation_checkpointing` switches partitioned and host-memory checkpoints on for
    `deepspeed.checkpointing.checkpoint` when the engine is built.

    Args:
        partition_activations, cpu_checkpointing: the config's keys.
        group: the ranks holding the same activations (the tensor-parallel group), or None.
    """

    name = "activations"

    def __init__(self, partition_activations: bool, cpu_checkpointing: bool, group=None):
        configure(partition_activations, cpu_checkpointing, group)

"""Collectives over torch.distributed, with logical element counting and profiler labels.

Every collective zero issues goes through `Comm`, so the communication of a step can be counted
(`Engine.comm_report()`) and seen in a profile (each call is a `record_function` range).

[Note: reduce with SUM]
Reductions always use SUM, and callers divide locally. AVG and PREMUL_SUM are missing from gloo in
several torch versions and some versions ignore the op of a gloo reduce-scatter altogether; SUM is
the one op every backend and version gets right. tests/test_collectives.py checks the numbers of
the installed torch.

[Note: reduce-scatter on gloo]
gloo has no native reduce-scatter: torch emulates it, and the emulation is slow (measured on
torch 2.13, 2 ranks, a 92 MB fp32 bucket: 208 ms, against 79 ms for an all-reduce of the same
bucket). So on gloo `Comm.reduce_scatter` all-reduces the input in place and copies out the
rank's slice: the same numbers, the same logical count, less time. This clobbers the input,
which is always one of zero's own bucket buffers. NCCL and other backends get the real one.

[Note: host tensors and NCCL]
NCCL moves only GPU memory, but some callers hand `Comm` host tensors: `zero.Init` broadcasting a
parameter built on the CPU, `GatheredParameters` gathering a shard kept in host memory
(`remote_device="cpu"`, `offload_param`), the engine broadcasting a CPU model's parameters. Under
NCCL every collective (all-gather, reduce-scatter, all-reduce, broadcast) sends host tensors
through temporary copies on the current GPU (outputs are allocated there, not copied there), so
callers need not care where a tensor lives; such a call completes before it returns. gloo takes
host tensors directly.

[Note: logical counts]
Counts are logical: a reduce-scatter of a bucket of E elements counts E elements, an all-gather
into a bucket of E elements counts E, an all-reduce of E elements counts E. That is what the ZeRO
paper's "Psi per collective" means; what the backend moves on the wire differs (gloo emulates
reduce-scatter with an all-reduce; a ring all-reduce sends about 2E), so do not time comm on gloo.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_CONTROL: dict[tuple[int, int], tuple[object, Comm]] = {}  # see Comm.control


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message says which and what to check."""


class _Done:
    """The handle of a collective that completed at once (a world of one)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _SliceAfter:
    """Handle of a gloo reduce-scatter done as an all-reduce: copies the rank's slice on wait."""

    def __init__(self, work, output: torch.Tensor, input: torch.Tensor, rank: int):
        self.work, self.output, self.input, self.rank = work, output, input, rank

    def wait(self, timeout=None) -> None:
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        n = self.output.numel()
        mine = self.input.view(-1)[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != self.output.data_ptr():
            self.output.view(-1).copy_(mine)


@dataclass
class CollectiveCount:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


def collective_timeout_s(value: str | None = None) -> float:
    """Seconds a stage-3 collective may take (`Comm.wait_for`): ZERO_COLLECTIVE_TIMEOUT, default 600.

    Args:
        value: the setting to parse; None reads ZERO_COLLECTIVE_TIMEOUT from the environment.

    Raises:
        ValueError: the value is not a positive, finite number of seconds.
    """
    raw = os.environ.get("ZERO_COLLECTIVE_TIMEOUT", "600") if value is None else value
    try:
        seconds = float(raw)
        timedelta(seconds=seconds)  # what `wait_for` passes on; overflows past ~2.7 million years
    except (ValueError, OverflowError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ZERO_COLLECTIVE_TIMEOUT must be a positive finite number of seconds, got {raw!r}")
    return seconds


class Comm:
    """The collectives of one process group, counted.

    Args:
        group: the torch.distributed group; None means the default group, or a world of one
            when torch.distributed is not initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.counts: dict[str, CollectiveCount] = defaultdict(CollectiveCount)
        self.backend = dist.get_backend(group) if self.distributed else "local"
        # Seconds `wait_for` lets a collective take before raising; ZERO_COLLECTIVE_TIMEOUT
        # (default 600). Only stage 3 waits this way: its collectives depend on which modules
        # run, so ranks that run different modules must end in an error, not a hang.
        self.timeout_s = collective_timeout_s()

    def control(self) -> Comm:
        """A gloo group over the same ranks, for small host messages (stage 3's rank-divergence
        tags) that must not queue behind this group's data collectives: gloo runs a group's
        collectives in order, so a tag sent on the data group would wait for every prefetch and
        reduction issued before it. Made once per group and process; the first call is collective
        (every rank of the group must make it)."""
        if not self.distributed or self.world_size == 1:
            return self
        world = dist.group.WORLD
        key = (id(world), id(self.group))
        entry = _CONTROL.get(key)
        if entry is None or entry[0] is not world:
            ranks = dist.get_process_group_ranks(self.group if self.group is not None else world)
            entry = _CONTROL[key] = (world, Comm(dist.new_group(ranks, backend="gloo")))
        return entry[1]

    # -- counting

    def _count(self, name: str, t: torch.Tensor) -> None:
        c = self.counts[name]
        c.calls += 1
        c.elements += t.numel()
        c.bytes += t.numel() * t.element_size()

    def reset_counts(self) -> None:
        self.counts.clear()

    def report(self) -> dict[str, dict[str, int]]:
        """Logical calls, elements and bytes per collective since the last reset."""
        return {name: dict(vars(c)) for name, c in sorted(self.counts.items())}

    # -- collectives

    @property
    def uses_nccl(self) -> bool:
        """NCCL carries (at least the GPU part of) this group's collectives."""
        return "nccl" in self.backend

    def _staged(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]):
        """Device copies of host tensors under NCCL (see [Note: host tensors and NCCL]), or None."""
        if not self.uses_nccl or all(t.is_cuda for t in outputs + inputs):
            return None
        device = torch.device("cuda", torch.cuda.current_device())
        return ([torch.empty_like(t, device=device) for t in outputs],
                [t.to(device, non_blocking=True) for t in inputs])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """output = this rank's 1/world_size slice of the SUM of `input` over ranks.

        `input` may be modified (see [Note: reduce-scatter on gloo]); `output` may be the rank's
        own slice of `input` (in place)."""
        self._count("reduce_scatter", input)
        with record_function("zero::reduce_scatter"):
            if self.world_size == 1:
                if output.data_ptr() != input.data_ptr():
                    output.copy_(input)
                return _Done() if async_op else None
            staged = self._staged([output], [input])
            if staged is not None:
                (out,), (inp,) = staged
                _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.group)
                output.copy_(out)
                return _Done() if async_op else None
            if self.backend == "gloo":
                work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
                return _SliceAfter(work, output, input, self.rank) if async_op else _SliceAfter(None, output, input, self.rank).wait()
            return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "all_gather"):
        """output = concatenation of every rank's `input`, in rank order. `input` may be the
        rank's own slice of `output` (in place). `label` names it in the counts."""
        self._count(label, output)
        with record_function(f"zero::{label}"):
            if self.world_size == 1:
                if input.data_ptr() != output.data_ptr():
                    output.copy_(input)
                return _Done() if async_op else None
            staged = self._staged([output], [input])
            if staged is not None:
                (out,), (inp,) = staged
                _all_gather(out, inp, group=self.group)
                output.copy_(out)
                return _Done() if async_op else None
            return _all_gather(output, input, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In-place SUM or MAX over ranks (MAX is used for overflow flags)."""
        self._count(f"all_reduce_{op}", tensor)
        with record_function(f"zero::all_reduce_{op}"):
            if self.world_size == 1:
                return _Done() if async_op else None
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            staged = self._staged([], [tensor])
            if staged is not None:
                _, (t,) = staged
                dist.all_reduce(t, op=red, group=self.group)
                tensor.copy_(t)
                return _Done() if async_op else None
            return dist.all_reduce(tensor, op=red, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast from global rank `src`."""
        self._count("broadcast", tensor)
        with record_function("zero::broadcast"):
            if self.world_size == 1:
                return
            staged = self._staged([], [tensor])
            if staged is not None:
                _, (t,) = staged
                dist.broadcast(t, src=src, group=self.group)
                tensor.copy_(t)
            else:
                dist.broadcast(tensor, src=src, group=self.group)

    def wait_for(self, work, describe: Callable[[], str]) -> None:
        """Wait for `work` at most `timeout_s` seconds; on timeout raise CollectiveTimeout with
        `describe()` (which names what was being waited for).

        Under NCCL a timed wait would block the CPU until the GPU finishes, on every unit: there the
        wait only orders the current stream, and a hang is bounded by the process group's own
        timeout (NCCL's watchdog) instead."""
        if work is None:
            return
        if self.uses_nccl:
            work.wait()
            return
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise CollectiveTimeout(
                f"{describe()} did not complete within {self.timeout_s:.0f} s ({exc}). Usually this means the ranks "
                f"ran different modules (rank-divergent control flow): every rank must run the same modules in the "
                f"same order. Set ZERO_COLLECTIVE_TIMEOUT to wait longer."
            ) from exc

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

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

[Note: the byte ledger]
Once the engine knows which ranks share a node (`place_on_nodes`), each count also says how many
of its bytes cross a node boundary on this rank's behalf (`cross_node_bytes`), whatever algorithm
the backend runs: the bytes this rank must receive from, or send to, ranks of other nodes. With
N ranks in the group, L of them on this rank's node, and B logical bytes:
- all-gather: the parts of the N - L ranks of other nodes come in: B (N - L) / N;
- reduce-scatter and all-to-all: the parts for them go out: B (N - L) / N (an all-to-all of
  uneven blocks: the bytes of the blocks sent to them);
- all-reduce (a reduce-scatter, then an all-gather): 2 B (N - L) / N;
- broadcast: B into each rank on another node than the root's; reduce: B out of each.
Summed over the ranks, each byte that crosses is counted once. These are the ZeRO++ paper's units:
a flat ZeRO-3 step over nodes moves 3 Psi (N - L) / N per rank (two all-gathers of the parameters
and a reduce-scatter of the gradients); sharding inside a node makes them 0.
"""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from zero.errors import ZeroRuntimeError
from zero.parallel.tags import TAG_SIZE, RankDivergenceError, Tag, describe_tag

# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_CONTROL: dict[tuple[int, int, str], tuple[object, Comm]] = {}  # see Comm.control and Comm.io


class CollectiveTimeout(ZeroRuntimeError):
    """A collective did not complete in time; the message says which and what to check."""


class Done:
    """The handle of a collective that completed at once (a world of one, or done in place)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Then:
    """A collective's handle (or None) whose `wait` also runs `then` once after it: a follow-up
    collective (the replicas' all-reduce) or the decoding of what arrived (ZeRO++). `then` and what
    it holds are dropped once it ran. `failed` (optional) runs instead when the wait raises (the
    follow-up's temporaries given back), before the error goes on."""

    def __init__(self, work, then, failed=None):
        self.work, self.then, self.failed = work, then, failed

    def wait(self, timeout=None) -> None:
        if self.then is None:
            return
        if self.work is not None:
            try:
                self.work.wait()
            except BaseException:
                failed, self.then, self.failed = self.failed, None, None
                if failed is not None:
                    failed()
                raise
        then, self.then, self.work, self.failed = self.then, None, None, None
        then()

    def is_completed(self) -> bool:
        return self.then is None


class _SliceAfter:
    """Handle of a gloo reduce-scatter done as an all-reduce: copies the rank's slice on wait."""

    def __init__(self, work, output: torch.Tensor, input: torch.Tensor, rank: int):
        self.work, self.output, self.input, self.rank = work, output, input, rank

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout=None) -> None:
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        n = self.output.numel()
        mine = self.input.view(-1)[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != self.output.data_ptr():
            self.output.view(-1).copy_(mine)


# Handles of collectives that timed out or failed, kept alive: a gloo work's destructor may wait
# for a peer that never arrives.
_ABANDONED: list = []


class _Timed:
    """Handle of a gloo collective whose wait is bounded (see Comm.wait_for)."""

    def __init__(self, work, comm: Comm, what: str):
        self.work, self.comm, self.what = work, comm, what

    def wait(self, timeout=None) -> None:
        self.comm.wait_for(self.work, lambda: self.what)

    def is_completed(self) -> bool:
        return self.work.is_completed()


@dataclass
class CollectiveCount:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0  # of `bytes`, what crosses a node boundary (see [Note: the byte ledger])


def collective_timeout_s(value: str | None = None) -> float:
    """Seconds a collective may take (`Comm.wait_for`): ZERO_COLLECTIVE_TIMEOUT, default 1800 (torch's
    and DeepSpeed's process-group default: work one rank does alone, a long save or an evaluation,
    must fit in it; lower it to fail faster).

    Args:
        value: the setting to parse; None reads ZERO_COLLECTIVE_TIMEOUT from the environment.

    Raises:
        ValueError: the value is not a positive, finite number of seconds.
    """
    raw = os.environ.get("ZERO_COLLECTIVE_TIMEOUT", "1800") if value is None else value
    try:
        seconds = float(raw)
        timedelta(seconds=seconds)  # what `wait_for` passes on; overflows past ~2.7 million years
    except (ValueError, OverflowError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0.001):
        raise ValueError(f"ZERO_COLLECTIVE_TIMEOUT must be a finite number of seconds >= 0.001, got {raw!r}")
    return seconds


class Comm:
    """The collectives of one process group, counted.

    Args:
        group: the torch.distributed group; None means the default group, or a world of one
            when torch.distributed is not initialised.
        strict_tags: check the rank-agreement tags of a pass's collectives before each one also
            on NCCL, instead of at the end of the pass (see [Note: rank-agreement tags] in
            zero/parallel/tags.py).
    """

    node_of: list[int] | None = None  # each rank's node, in group order (see `place_on_nodes`)
    _cross = 0.0  # the share of the group's ranks on other nodes than this rank's

    def __init__(self, group: dist.ProcessGroup | None = None, strict_tags: bool = False):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.counts: dict[str, CollectiveCount] = defaultdict(CollectiveCount)
        self.backend = dist.get_backend(group) if self.distributed else "local"
        # Seconds `wait_for` lets a collective take before raising; ZERO_COLLECTIVE_TIMEOUT
        # (default 1800). Every gloo collective waits this way (see [Note: bounded waits]).
        self.timeout_s = collective_timeout_s()
        self.data: Comm | None = None  # for a control group (see `control`), the group it serves
        # the engine these collectives belong to (see [Note: rank-agreement tags] in zero/parallel/tags.py)
        self.engine = 0
        self.wait_s = 0.0  # seconds the host waited for this group's gloo collectives (NCCL: not measured)
        self.defer_tags = self.uses_nccl and not strict_tags  # check a pass's tags at its end (`tagged`)
        self.broken: str | None = None  # the first timeout on this group; later collectives refuse (`_usable`)
        self._deferred: list = []

    def control(self) -> Comm:
        """A gloo group over the same ranks, for small host messages (stage 3's rank-divergence
        tags) that must not queue behind this group's data collectives: gloo runs a group's
        collectives in order, so a tag sent on the data group would wait for every prefetch and
        reduction issued before it. Made once per group and process; the first call is collective
        (every rank of the group must make it)."""
        return self._side_group("control")

    def io(self) -> Comm:
        """Another gloo group over the same ranks, for checkpoint writing, which may run in a
        background thread while training uses the data and control groups. Made like `control`."""
        return self._side_group("io")

    def _made_control(self) -> Comm | None:
        """The control group `control()` made for this group, if it has (without making one)."""
        entry = _CONTROL.get((id(dist.group.WORLD), id(self.group), "control")) if self.distributed else None
        return entry[1] if entry is not None and entry[1] is not self else None

    def waited_s(self) -> float:
        """Seconds the host waited for this group's collectives and its control group's (if made)."""
        side = self._made_control()
        return self.wait_s + (side.wait_s if side is not None else 0.0)

    def reset_waited(self) -> None:
        self.wait_s = 0.0
        side = self._made_control()
        if side is not None:
            side.wait_s = 0.0

    def _side_group(self, kind: str) -> Comm:
        if not self.distributed or self.world_size == 1:
            return self
        world = dist.group.WORLD
        key = (id(world), id(self.group), kind)
        entry = _CONTROL.get(key)
        if entry is None or entry[0] is not world:
            ranks = dist.get_process_group_ranks(self.group if self.group is not None else world)
            # bounded like every wait of zero's: a rank that never gets here (it failed before) makes
            # the others fail in the connection set-up after ZERO_COLLECTIVE_TIMEOUT
            try:
                # local synchronisation: only this group's ranks take part (a mesh has several data groups)
                group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=self.timeout_s),
                                       use_local_synchronization=self.group is not None)
            except (RuntimeError, dist.DistError) as exc:
                raise CollectiveTimeout(
                    f"setting up zero's {kind} group: ranks {ranks} did not all arrive within {self.timeout_s:g} s "
                    f"(ZERO_COLLECTIVE_TIMEOUT). Another rank probably failed before this point (see its log for "
                    f"the first error) ({exc})") from exc
            entry = _CONTROL[key] = (world, Comm(group))
            entry[1].data = self
        return entry[1]

    # -- counting

    def place_on_nodes(self, node_of_global: list[int]) -> None:
        """Know each rank's node (indexed by global rank), for the byte ledger (see [Note: the
        byte ledger]); no collective."""
        members = dist.get_process_group_ranks(self.group or dist.group.WORLD) if self.distributed else [0]
        self.node_of = [node_of_global[r] for r in members]
        mine = self.node_of[self.rank]
        self._cross = sum(n != mine for n in self.node_of) / len(self.node_of)

    def _count(self, name: str, t: torch.Tensor, kind: str = "part", root: int | None = None,
               crossing: int | None = None) -> None:
        """Count one collective of `t`; `kind`: "part" (all-gather, reduce-scatter, all-to-all),
        "all" (all-reduce), "to" (broadcast from group rank `root`), "from" (reduce into it);
        `crossing`: its bytes across nodes where they are not the kind's share (uneven blocks)."""
        self._usable()  # every collective counts itself first, before it is issued
        c = self.counts[name]
        nbytes = t.numel() * t.element_size()
        c.calls += 1
        c.elements += t.numel()
        c.bytes += nbytes
        if crossing is not None:
            c.cross_node_bytes += crossing
        elif self._cross:
            if kind == "part":
                c.cross_node_bytes += round(nbytes * self._cross)
            elif kind == "all":
                c.cross_node_bytes += round(2 * nbytes * self._cross)
            elif self.node_of[root] != self.node_of[self.rank]:  # into (broadcast) or out of (reduce) this rank
                c.cross_node_bytes += nbytes

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

    def _usable(self) -> None:
        """Raise if an earlier collective on this group timed out: its work is still pending in
        gloo, so a new one would pair with it."""
        if self.broken:
            raise CollectiveTimeout(f"this group is unusable after an earlier collective timed out: {self.broken}")

    def _bounded(self, work, async_op: bool, what: str):
        """A gloo collective issued asynchronously: its handle, or (sync) wait for it, bounded."""
        timed = _Timed(work, self, what)
        if async_op:
            return timed
        timed.wait()
        return None

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """output = this rank's 1/world_size slice of the SUM of `input` over ranks.

        `input` may be modified (see [Note: reduce-scatter on gloo]); `output` may be the rank's
        own slice of `input` (in place)."""
        self._count("reduce_scatter", input)
        with record_function("zero::reduce_scatter"):
            if self.world_size == 1:
                if output.data_ptr() != input.data_ptr():
                    output.copy_(input)
                return Done() if async_op else None
            staged = self._staged([output], [input])
            if staged is not None:
                (out,), (inp,) = staged
                _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.group)
                output.copy_(out)
                return Done() if async_op else None
            if self.backend == "gloo":
                work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                what = f"a gradient reduce-scatter of {input.numel():,} elements"
                return self._bounded(_SliceAfter(work, output, input, self.rank), async_op, what)
            return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "all_gather"):
        """output = concatenation of every rank's `input`, in rank order. `input` may be the
        rank's own slice of `output` (in place). `label` names it in the counts."""
        self._count(label, output)
        with record_function(f"zero::{label}"):
            if self.world_size == 1:
                if input.data_ptr() != output.data_ptr():
                    output.copy_(input)
                return Done() if async_op else None
            staged = self._staged([output], [input])
            if staged is not None:
                (out,), (inp,) = staged
                _all_gather(out, inp, group=self.group)
                output.copy_(out)
                return Done() if async_op else None
            if self.backend == "gloo":
                work = _all_gather(output, input, group=self.group, async_op=True)
                return self._bounded(work, async_op, f"an all-gather of {output.numel():,} elements ({label})")
            return _all_gather(output, input, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, label: str | None = None):
        """In-place SUM or MAX over ranks (MAX is used for overflow flags). `label` names it in the
        counts (default `all_reduce_<op>`)."""
        label = label or f"all_reduce_{op}"
        self._count(label, tensor, "all")
        with record_function(f"zero::{label}"):
            if self.world_size == 1:
                return Done() if async_op else None
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            staged = self._staged([], [tensor])
            if staged is not None:
                _, (t,) = staged
                dist.all_reduce(t, op=red, group=self.group)
                tensor.copy_(t)
                return Done() if async_op else None
            if self.backend == "gloo":
                work = dist.all_reduce(tensor, op=red, group=self.group, async_op=True)
                return self._bounded(work, async_op, f"an all-reduce of {tensor.numel():,} elements")
            return dist.all_reduce(tensor, op=red, group=self.group, async_op=async_op)

    def all_gather_object(self, obj, label: str = "all_gather_object") -> list:
        """`obj` (picklable) of every rank, in rank order: two bounded all-gathers, of the pickled
        sizes and of the padded bytes (counted as bytes)."""
        import pickle

        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.empty(self.world_size, dtype=torch.int64)
        self.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), label=f"{label} (sizes)")
        width = int(sizes.max())
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.numel()] = data
        gathered = torch.empty(self.world_size * width, dtype=torch.uint8)
        self.all_gather(gathered, padded, label=label)
        rows = gathered.view(self.world_size, width)
        return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, label: str = "all_to_all",
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> None:
        """Block r of `output` = block `rank` of rank r's `input`: world_size equal blocks along dim
        0, or blocks of `input_splits[i]` rows sent to rank i and `output_splits[r]` rows received
        from rank r (blocks may be empty: a neighbours' exchange)."""
        crossing = None
        if input_splits is not None and self._cross:  # uneven blocks: the rows sent to other nodes
            row = input.numel() // max(1, input.shape[0]) * input.element_size() if input.dim() else 0
            crossing = row * sum(n for r, n in enumerate(input_splits) if self.node_of[r] != self.node_of[self.rank])
        self._count(label, input, crossing=crossing)
        splits = {} if input_splits is None else {"output_split_sizes": output_splits, "input_split_sizes": input_splits}
        with record_function(f"zero::{label}"):
            if self.world_size == 1:
                output.copy_(input)
                return
            staged = self._staged([output], [input])
            if staged is not None:
                (out,), (inp,) = staged
                dist.all_to_all_single(out, inp, group=self.group, **splits)
                output.copy_(out)
            elif self.backend == "gloo":
                work = dist.all_to_all_single(output, input, group=self.group, async_op=True, **splits)
                self._bounded(work, False, f"an all-to-all of {input.numel():,} elements ({label})")
            else:
                dist.all_to_all_single(output, input, group=self.group, **splits)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False, label: str = "broadcast"):
        """In-place broadcast from the group's rank `src` (its place in this group, which is the
        global rank for the default group). `label` names it in the counts."""
        return self._rooted(lambda t, root, **kw: dist.broadcast(t, src=root, **kw), tensor, src, async_op, label,
                            f"a broadcast of {tensor.numel():,} elements from rank {src}", "to")

    def reduce(self, tensor: torch.Tensor, dst: int, async_op: bool = False, label: str = "reduce"):
        """In-place SUM over ranks into the group's rank `dst` (other ranks' `tensor` is left
        undefined, as torch's reduce leaves it). `label` names it in the counts."""
        return self._rooted(lambda t, root, **kw: dist.reduce(t, dst=root, op=dist.ReduceOp.SUM, **kw), tensor, dst,
                            async_op, label, f"a reduce of {tensor.numel():,} elements to rank {dst}", "from")

    def _rooted(self, collective: Callable, tensor: torch.Tensor, root: int, async_op: bool, label: str, what: str,
                kind: str):
        """One in-place collective with a root rank of this group (broadcast, reduce): counted,
        staged through the GPU for a host tensor under NCCL, bounded on gloo."""
        self._count(label, tensor, kind, root)
        root = dist.get_global_rank(self.group, root) if self.distributed and self.group is not None else root
        with record_function(f"zero::{label}"):
            if self.world_size == 1:
                return Done() if async_op else None
            staged = self._staged([], [tensor])
            if staged is not None:
                _, (t,) = staged
                collective(t, root, group=self.group)
                tensor.copy_(t)
                return Done() if async_op else None
            if self.backend == "gloo":
                return self._bounded(collective(tensor, root, group=self.group, async_op=True), async_op, what)
            return collective(tensor, root, group=self.group, async_op=async_op)

    # -- bounded waits and rank agreement

    def wait_for(self, work, describe: Callable[[], str]) -> None:
        """[Note: bounded waits]
        Wait for `work` at most `timeout_s` seconds (ZERO_COLLECTIVE_TIMEOUT) and raise
        CollectiveTimeout naming `describe()` if it does not complete (a rank stopped, or waits in
        another collective) or fails (a rank died). After a failure this process's groups are
        aborted, so that it can exit at once instead of waiting in gloo's threads for the process
        group's own timeout; after a timeout the group is marked broken instead (gloo's abort
        would hold this process until the live peer closes its end) and every later collective on
        it raises at once.

        Under NCCL a timed wait would block the CPU until the GPU finishes: there the wait only
        orders the current stream, and a hang is bounded by the process group's own timeout
        (NCCL's watchdog; `zero.init_distributed` sets it to ZERO_COLLECTIVE_TIMEOUT)."""
        if work is None:
            return
        if isinstance(work, _Timed):
            work = work.work
        if self.uses_nccl:
            work.wait()
            return
        start = time.perf_counter()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
            self.wait_s += time.perf_counter() - start
        except RuntimeError as exc:
            _ABANDONED.append(work)  # its destructor would wait for the peer that never came
            if "timed out" in str(exc).lower():
                # The peer is alive (stalled, or waiting in another collective): gloo's abort would
                # hold this process until the peer closes its end, delaying this error by as long.
                # The group is marked broken instead (`_usable`): a later collective on it would
                # pair with the abandoned one.
                cause = (f"did not complete within {self.timeout_s:g} s. Usually this means the ranks ran different "
                         f"code (rank-divergent control flow, or a rank stalled): every rank must run the same "
                         f"modules in the same order and call backward, step and save the same number of times. "
                         f"Set ZERO_COLLECTIVE_TIMEOUT to wait longer")
            else:  # a peer that crashed closed its connections: aborting is quick, and this process can exit
                self.abort()
                cause = "failed because another rank stopped or crashed (see its log for the first error)"
            message = f"{describe()} {cause} ({exc})."
            self.broken = self.broken or message
            raise CollectiveTimeout(message) from exc

    def start_tag(self, tag: Tag, a: int = 0, b: int = 0):
        """All-gather (tag, a, b) and this group's engine number on the control group; returns
        (handle, gathered tags). See [Note: rank-agreement tags] in zero/parallel/tags.py."""
        ctl = self.control()
        mine = torch.tensor([int(tag), a, b, self.engine], dtype=torch.int64)
        tags = torch.empty(self.world_size * TAG_SIZE, dtype=torch.int64)
        return ctl.all_gather(tags, mine, async_op=True, label="rank_tags"), tags

    def check_tags(self, work, tags: torch.Tensor, what: str | Callable[[], str],
                   unit_label: Callable[[int], str] | None = None, advice: str = "",
                   key: Callable[[list[int]], object] = tuple) -> list[list[int]]:
        """Wait for a tag exchange (bounded) and raise RankDivergenceError if the ranks' tags
        differ (in `key`, which must include the engine number unless it is being agreed on);
        returns every rank's tag. `what` (or what it returns) names the place, for messages."""
        describe = what if callable(what) else lambda: what
        self.control().wait_for(work, lambda: f"{describe()}: the rank-agreement check")
        rows = tags.view(self.world_size, TAG_SIZE).tolist()
        if any(key(r) != key(rows[0]) for r in rows):
            self.abort()
            engines = len({row[3] for row in rows}) > 1
            seen = "; ".join(f"rank {r}: {describe_tag(row, unit_label, engines)}" for r, row in enumerate(rows))
            raise RankDivergenceError(
                f"{describe()}: ranks diverged ({seen}). Every rank must run the same modules in the same order and "
                f"call backward, step, GatheredParameters and the savers the same number of times{advice}.")
        return rows

    def agree(self, tag: Tag, a: int, b: int, what: str) -> None:
        """Every rank must be at the same point (`tag`, `a`, `b`) before the collective that follows:
        checked now."""
        if self.world_size > 1:
            self.check_tags(*self.start_tag(tag, a, b), what)

    def tagged(self, tag: Tag, a: int, b: int, what: str | Callable[[], str],
               unit_label: Callable[[int], str] | None = None, advice: str = "") -> None:
        """Tag a data collective of a backward (or forward) about to be issued: its tag is checked
        now, or, when `defer_tags` is set (NCCL without strict checks), by `check_deferred` at the
        end of the pass. See [Note: rank-agreement tags] in zero/parallel/tags.py."""
        if self.world_size == 1:
            return
        work, tags = self.start_tag(tag, a, b)
        if not self.defer_tags:
            self.check_tags(work, tags, what, unit_label, advice)
            return
        self._deferred.append((work, tags, what, unit_label, advice))
        if len(self._deferred) > 4096:  # forwards with grad but no backward: do not pile up
            self.check_deferred()

    def check_deferred(self) -> None:
        """Check the tags `tagged` deferred (host tensors on the control group: no GPU synchronisation)."""
        pending, self._deferred = self._deferred, []
        for work, tags, what, unit_label, advice in pending:
            self.check_tags(work, tags, what, unit_label, advice)

    def abort(self) -> None:
        """Abort this group and its control group after a fatal divergence or a failed collective,
        so the process can exit at once (their pending collectives will never complete). Later
        collectives on them fail."""
        if not self.distributed:
            return
        if self.data is not None:  # this is a control group: abort its data group with it
            return self.data.abort()
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        groups = [self.group or dist.group.WORLD]
        for kind in ("control", "io"):
            entry = _CONTROL.get((id(dist.group.WORLD), id(self.group), kind))
            if entry is not None:
                groups.append(entry[1].group)

        for group in groups:
            try:
                if abort is not None:
                    abort(group)
                else:
                    group.abort()
            except Exception:  # noqa: BLE001 - best effort: the error being raised matters more
                pass

    def any_rank(self, flag: bool, what: str = "a save") -> bool:
        """True on every rank if `flag` is True on any; a barrier bounded only by the process
        group's own timeout (one rank may be busy for long, writing a checkpoint). `what` names
        the work being waited for, in the error if a rank dies meanwhile."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([float(flag)])
        staged = self._staged([], [t])
        if staged is not None:
            t = staged[1][0]
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:
            self.abort()
            raise CollectiveTimeout(f"waiting for every rank to finish {what} failed because another rank stopped "
                                    f"or crashed (see its log for the first error) ({exc}).") from exc
        return bool(t.item())


def __getattr__(name: str):
    raise AttributeError(f"zero.parallel.comm.{name} does not exist: zero.parallel.comm is zero's own collectives layer; for "
                         f"DeepSpeed's deepspeed.comm (get_rank, all_reduce, ...) use `import zero.deepspeed as "
                         f"deepspeed`")

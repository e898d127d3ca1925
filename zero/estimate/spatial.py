"""One rank's slab of a split volume, for the activation trace (zero/spatial, docs/spatial.md).

[Note: tracing a split volume]
`estimate_activations(..., spatial_parallel_size=P)` takes the example of the whole volume and
traces what one rank of a spatial group of P does: its slab (the canonical split of every tensor
of the example along `spatial_dim`) through the model's layers converted for slabs, the halo
exchanges allocating what they would and sending nothing. The traced rank is the one with the
most halo: a middle rank, which has neighbours on both sides, when P > 2 (either rank when P = 2),
the first of the widest slabs among them (the canonical split gives the first ranks the extra
plane).

The model is converted for the trace with zero.spatial.parallelize over a stand-in group
(`TraceComm`) of P ranks seen from the traced one. The layers learn the global length of their
input's split dimension from an all-gather of the ranks' rows (`Split.of`: each rank's slab length,
then what names the layer), which the stand-in answers without the other ranks: the canonical
split of the global length, each rank's row otherwise this rank's (every rank runs the same
layer). A rank's slab length does not name the global length (on 2 ranks, rank 0 holds 4 planes
of 7 and of 8), so before the trace one pass of the unsplit model on fake tensors (no backward,
nothing counted) records the length every module's input has, and every length any tensor has;
in the trace, forward hooks keep the stack of running modules (recomputation by checkpointing
included), and the stand-in answers a converted layer with its own input's length, and
zero.spatial's functions (volume_mean in a loss, F.interpolate in a forward) with the one length
whose slab on this rank no other length shares.

The layers' bookkeeping reads small integer tensors (`tolist()` of the gathered lengths, the
source planes of an interpolation), which fake tensors cannot answer: in the trace a tensor of up
to 4096 elements made from numbers alone, and what is computed from such tensors alone, is real
(`_Bookkeeping`, a dispatch mode above the fake one; where it meets an activation it joins it as a
fake tensor), so the layers read their values while every activation stays fake. The stand-in
counts its calls,
elements and bytes per label exactly as `Comm._count` does, so the halo bytes of the trace are the
real run's "spatial_halo" count of that rank: what it sends, forward and backward, recomputation
by checkpointed blocks included.

The model is converted in place for the trace and put back after it (classes, the converted
modules' attributes, the hooks `parallelize` adds and zero.spatial's current layout); a model
converted already (zero.initialize with spatial_parallel_size) has its layers' own classes back
for the unsplit pass and is converted over the stand-in for the trace, then over its own group
again.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from zero.parallel.comm import CollectiveCount, Comm

_SPATIAL_NAMES = {2: "depth", 3: "height", 4: "width"}


def dimension_name(dim: int) -> str:
    """"depth", "height" or "width" for dimension 2, 3 or 4 of an (N, C, D, H, W) tensor."""
    return _SPATIAL_NAMES.get(dim, f"dimension {dim}")


class TraceComm:
    """A stand-in for a spatial group of `world_size` ranks, seen from `rank`, for the trace: sends
    nothing, and answers `Split.of`'s all-gather of the ranks' rows (each its slab length first)
    with the canonical split of the global length `global_length` gives for this rank's slab
    length (see [Note: tracing a split volume]).

    Args:
        world_size, rank: the group's size and the traced rank.
        global_length: this rank's slab length -> the global length; None: the slab is the whole.
    """

    def __init__(self, world_size: int, rank: int, global_length: Callable[[int], int] | None = None):
        self.world_size, self.rank, self.global_length = world_size, rank, global_length
        self.counts: dict[str, CollectiveCount] = defaultdict(CollectiveCount)
        self.group, self.distributed, self.backend, self.broken = None, False, "trace", None

    _count = Comm._count  # the real group's counting, so that the two agree byte for byte
    node_of, _cross = None, 0.0  # one node: the byte ledger's share across nodes is 0
    _usable = Comm._usable
    reset_counts = Comm.reset_counts
    report = Comm.report

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   label: str = "all_gather"):
        self._count(label, output)
        if label == "spatial_sizes":  # Split.of: every rank's row, its slab length first
            from zero.spatial.halo import Split

            mine = _values(input)
            local = int(mine[0])
            total = local if self.global_length is None else self.global_length(local)
            _write(output, [v for n in Split(total, self.world_size).sizes() for v in (n, *mine[1:])])
        return None

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, label: str = "all_to_all",
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> None:
        self._count(label, input)  # what this rank sends; `output`, allocated by the caller, stays unwritten

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, label: str | None = None):
        self._count(label or f"all_reduce_{op}", tensor)
        return None


def _values(t: torch.Tensor) -> list:
    """The values of a small bookkeeping tensor (real in the trace: see the note)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        raise ValueError(f"spatial trace: the slab lengths sent are a fake tensor {tuple(t.shape)}, without values "
                         f"(more than {_SMALL} elements?)")
    return t.reshape(-1).tolist()


def _write(output: torch.Tensor, values: list[int]) -> None:
    output.copy_(torch.tensor(values, dtype=output.dtype).view(output.shape))


_SMALL = 4096  # elements of a bookkeeping tensor, at most (see the note)


class _Bookkeeping(TorchDispatchMode):
    """Inside a FakeTensorMode: small tensors made from numbers alone (torch.tensor([n, site]),
    torch.zeros(world), torch.arange(lo, hi)) and whatever is computed from them alone stay real,
    so that the layers read their values; where one meets a fake tensor it joins it as a fake one
    (see [Note: tracing a split volume])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        fakes = [t for t in tensors if is_fake(t)]
        if fakes:  # real small ones join the fake ones (FakeTensorMode refuses real inputs)
            if len(fakes) < len(tensors):
                mode = fakes[0].fake_mode
                args, kwargs = tree_unflatten([mode.from_tensor(t) if isinstance(t, torch.Tensor) and not is_fake(t)
                                               and t.numel() <= _SMALL else t for t in flat], spec)
            return func(*args, **kwargs)
        if tensors and all(t.numel() <= _SMALL and t.device.type == "cpu" for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)  # from numbers alone: real instead of fake if small
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not tensors and made and all(is_fake(t) and t.numel() <= _SMALL and t.device.type == "cpu" for t in made):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return out


def traced_rank(length: int, size: int) -> int:
    """The rank whose slab the trace runs: a middle one when size > 2 (halos on both sides), the
    first of the widest slabs among the candidates (see [Note: tracing a split volume])."""
    from zero.spatial.halo import Split

    sizes = Split(length, size).sizes()
    candidates = range(1, size - 1) if size > 2 else range(size)
    return max(candidates, key=lambda r: (sizes[r], -r))


def is_converted(module: nn.Module) -> bool:
    """`module` runs over a split volume (zero.spatial converted it)."""
    return any(c.__module__.startswith("zero.spatial") for c in type(module).__mro__)


@contextlib.contextmanager
def unconverted(model: nn.Module):
    """`model` with any layer zero.spatial converted given back its own class (its forward over the
    whole volume), then converted again."""
    kept = [(m, type(m)) for m in model.modules() if is_converted(m)]
    try:
        for m, cls in kept:
            m.__class__ = next(c for c in cls.__mro__ if not c.__module__.startswith("zero.spatial"))
        yield
    finally:
        for m, cls in kept:
            m.__class__ = cls


_ROOT_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs")


@contextlib.contextmanager
def stand_in_group(model: nn.Module, comm: TraceComm, dim: int):
    """`model`'s layers converted for slabs along `dim` over the stand-in `comm`
    (zero.spatial.parallelize), then everything as it was: classes, the converted modules'
    attributes, the hooks parallelize adds and zero.spatial's current layout (see [Note: tracing
    a split volume])."""
    import zero.spatial as sp

    kept = [(m, type(m), {k: v for k, v in vars(m).items() if k.startswith("_zero_spatial")}) for m in model.modules()]
    hooks = {name: set(getattr(model, name, {})) for name in _ROOT_HOOKS}
    current = sp._current
    try:
        with unconverted(model):
            sp.parallelize(model, comm, dim)
            with _Bookkeeping():
                yield
    finally:
        for m, cls, attrs in kept:
            m.__class__ = cls
            for k in [k for k in vars(m) if k.startswith("_zero_spatial")]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
        for name, before in hooks.items():  # what parallelize hooked on (zero/spatial/functional.py)
            added = getattr(model, name, {})
            for key in [k for k in added if k not in before]:
                del added[key]
        sp._current = current


@dataclass
class SpatialTrace:
    """What the trace of one rank's slab needs, and what it counted (see [Note: tracing a split volume]).

    Attributes:
        size, dim, rank: the group's size, the split dimension and the traced rank.
        args, kwargs: the example's slab: every tensor with a `dim` narrowed to the rank's planes.
        volume, slab: the shape of the example's first split tensor, whole and the traced rank's.
        inputs: id of a module -> its inputs' global lengths along `dim` (the unsplit pass).
        levels: every global length along `dim` of a module's input or output (the unsplit pass).
        everywhere: every global length along `dim` a tensor of the unsplit pass has.
        comm: the stand-in group of the trace, and its counts.
    """

    size: int
    dim: int
    rank: int
    args: tuple
    kwargs: dict
    volume: tuple[int, ...]
    slab: tuple[int, ...]
    inputs: dict[int, list[int]] = field(default_factory=dict)
    levels: set[int] = field(default_factory=set)
    everywhere: set[int] = field(default_factory=set)
    comm: TraceComm | None = None

    @property
    def halo_bytes(self) -> int:
        """Bytes this rank sends in halo exchanges, forward and backward ("spatial_halo")."""
        count = self.comm.counts.get("spatial_halo") if self.comm is not None else None
        return count.bytes if count is not None else 0

    def report(self) -> dict[str, dict[str, int]]:
        """The stand-in's counts, as a real group's Comm reports them."""
        return self.comm.report() if self.comm is not None else {}

    def _slabs(self, lengths, what: str, strict: bool) -> dict[int, int]:
        """This rank's slab length -> the global length, for `lengths` (`strict`: two lengths
        with the same slab raise; else both are left out)."""
        from zero.spatial.halo import Split

        found: dict[int, set[int]] = defaultdict(set)
        for length in lengths:
            found[Split(length, self.size).sizes()[self.rank]].add(length)
        clash = next((ls for ls in found.values() if len(ls) > 1), None)
        if strict and clash:
            raise ValueError(f"spatial trace: {what} takes inputs of {sorted(clash)} planes along dimension "
                             f"{self.dim}, which give rank {self.rank} of {self.size} the same slab; the trace cannot "
                             f"tell them apart")
        return {local: next(iter(ls)) for local, ls in found.items() if len(ls) == 1}

    @contextlib.contextmanager
    def groups(self, model: nn.Module):
        """`model` converted over this trace's stand-in group, for the trace only. Which module
        is running (a stack kept by forward hooks, recomputation by checkpointing included) says
        which lengths a slab length can be: a converted layer's own inputs', else any length."""
        names = {id(m): name or "<model>" for name, m in model.named_modules()}
        anywhere = self._slabs(self.everywhere, "", strict=False)
        running: list[nn.Module] = []
        tables: dict[int, dict[int, int]] = {}

        def global_length(local: int) -> int:
            top = running[-1] if running else None
            if top is not None and is_converted(top):
                what = f"{names[id(top)]} ({type(top).__name__})"
                if id(top) not in tables:
                    tables[id(top)] = self._slabs(self.inputs.get(id(top), []), what, strict=True)
                table = tables[id(top)]
            else:
                what, table = "a zero.spatial function (volume_mean, F.interpolate, ...)", anywhere
            if local not in table:
                raise ValueError(f"spatial trace: {what} gets a slab of {local} planes, which no tensor of the unsplit "
                                 f"pass gives rank {self.rank} of {self.size}")
            return table[local]

        def enter(module, args) -> None:
            running.append(module)

        def leave(module, args, out) -> None:
            running.pop()

        self.comm = TraceComm(self.size, self.rank, global_length)
        handles = []
        try:
            with stand_in_group(model, self.comm, self.dim):
                for m in model.modules():
                    handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave, always_call=True)]
                yield
        finally:
            for h in handles:
                h.remove()


class _Lengths(TorchDispatchMode):
    """Records the length along `dim` of every tensor operations make."""

    def __init__(self, dim: int, into: set[int]):
        super().__init__()
        self.dim, self.into = dim, into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() > self.dim:
                self.into.add(t.shape[self.dim])
        return out


def plan_trace(model: nn.Module, args: tuple, kwargs: dict, size: int, dim: int,
               dtype: torch.dtype | None) -> SpatialTrace:
    """The slab of the example the trace runs and the global lengths its stand-ins answer with:
    one unsplit pass of `model` on fake tensors, recording every module's input length along `dim`
    (see [Note: tracing a split volume])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zero.estimate.activations import _fake_input, _fake_parameters, _without_module_hooks
    from zero.spatial.halo import Split

    split = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not split:
        raise ValueError(f"spatial_parallel_size {size}: no tensor of the example has a dimension {dim} to split "
                         f"(give the whole volume's tensors, (N, C, D, H, W))")
    volume = tuple(split[0].shape)
    rank = traced_rank(volume[dim], size)
    for t in split:
        if 0 in Split(t.shape[dim], size).sizes():
            raise ValueError(f"spatial_parallel_size {size}: the example's {tuple(t.shape)} has {t.shape[dim]} planes "
                             f"along dimension {dim}, fewer than the {size} spatial ranks")

    def narrow(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return t
        a, b = Split(t.shape[dim], size).bounds(rank)
        shape = (*t.shape[:dim], b - a, *t.shape[dim + 1:])
        return torch.empty(shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)

    slab_args, slab_kwargs = tree_map(narrow, (args, kwargs))
    a, b = Split(volume[dim], size).bounds(rank)
    trace = SpatialTrace(size, dim, rank, slab_args, slab_kwargs, volume, (*volume[:dim], b - a, *volume[dim + 1:]))
    # the unsplit pass: every module's input length along `dim`, and the output's
    seen: dict[int, list[int]] = defaultdict(list)

    def record(module, inputs):
        first = inputs[0] if inputs else None
        if isinstance(first, torch.Tensor) and first.dim() > dim:
            seen[id(module)].append(first.shape[dim])
            trace.levels.add(first.shape[dim])

    def record_out(module, inputs, out):
        trace.levels.update(t.shape[dim] for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() > dim)

    fake = FakeTensorMode(allow_non_fake_inputs=False)
    with fake, _without_module_hooks(model), unconverted(model), torch.no_grad():
        params = _fake_parameters(model, dtype)  # before _Bookkeeping, which would make small ones real
        a, k = tree_map(lambda t: _fake_input(t, dtype), (args, kwargs))
        with _Bookkeeping(), _Lengths(dim, trace.everywhere):
            handles = [h for m in model.modules()
                       for h in (m.register_forward_pre_hook(record), m.register_forward_hook(record_out))]
            try:
                torch.func.functional_call(model, params, tuple(a), k, tie_weights=True, strict=False)
            finally:
                for h in handles:
                    h.remove()
    trace.inputs = dict(seen)
    return trace


__all__ = ["SpatialTrace", "TraceComm", "dimension_name", "is_converted", "plan_trace", "stand_in_group",
           "traced_rank", "unconverted"]

"""What one forward and backward of a model take in memory beyond its parameters, found by running
them on tensors without data.

    act = zero.estimate_activations(model, micro_batch_size=1, seq_len=4096)   # HF causal LM, zero GPT
    act = zero.estimate_activations(unet, (torch.empty(2, 1, 96, 96, 96),))     # any module: example inputs
    zero.estimate_memory(model, 8, activations=act)                            # + model states = peak

[Note: tracing activations]
Activation memory depends on what the model's code does (which tensors autograd saves, what the
attention kernel keeps, whether blocks are checkpointed, tiled or sequence-parallel), so the
estimate runs that code instead of a formula: one forward, the loss and one backward on fake tensors
(torch's FakeTensorMode: shapes, dtypes and devices, no data, nothing allocated), with the model's
parameters swapped for fake ones of their full shapes (torch.func.functional_call). A dispatch mode
sees every tensor each operation creates and a finalizer sees its storage die, so the count of live
bytes is the allocator's count of a real run, operation by operation, and its maximum is the peak.
Fake tensors are CPU tensors, so operations pick the CPU kernels: SDPA runs its flash kernel, whose
memory (output plus a log-sum-exp per row) is what CUDA's flash and memory-efficient kernels keep
too (not yet measured on a GPU: the ±10% of the tests is against the CPU allocator).

Some kernels allocate scratch memory inside themselves, which no tensor shows: convolutions
(oneDNN's reorders into blocked layouts and workspaces) and SDPA's CPU flash kernel (per-thread
block buffers, copies of inputs not laid out [batch, sequence, heads, dim]). For these the trace
adds a measured amount beside the outputs: the real kernel is run once per signature on random data
of the same layouts at a small size (a convolution at spatial edge 16, scaled by the input's
elements; attention for one sequence, with one and two heads at its length up to 2,048 tokens, else
with one head at 1,024 and 2,048 tokens, extended along those lines to its heads and length). These are
this machine's CPU kernels; cuDNN's and the CUDA attention kernels' scratch is not modelled.

What is counted: every tensor made in the forward, the loss and the backward, while it lives:
activations saved for backward, temporaries, activation gradients, and each parameter's gradient
until its hook hands it on (the engine copies it into a bucket or shard at once; where it then
lives is a model state, counted by the estimator's other half, so the trace drops it there). Not
counted: the parameters, the example inputs, and what the model's forward hooks do (ZeRO's gathers
and the like are the `buffers` of the model-state estimate); the hooks do not run in the trace.
`peak` is the most alive at once; `saved` is what is alive when backward starts.

A sequence-parallel model traces with its own group size (each rank's slice of the sequence, the
whole sequence for its heads after the exchange, which allocates what it would and sends nothing);
`sequence_parallel_size` gives a zero GPT or an HF model that exchange for the trace only.
`spatial_parallel_size` traces one rank's slab of a volume split over that many ranks, its halo
exchanges allocating what they would and sending nothing, and counts the bytes they would send
(see [Note: tracing a split volume] in zero/estimate/spatial.py).
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes of one forward and backward beyond the parameters (see [Note: tracing activations]).

    Attributes:
        peak: the most bytes alive at once, from the start of forward to the end of backward.
        saved: bytes alive when backward starts (what forward keeps for it, and the loss).
        inputs: the example's shapes, for the record ("input_ids [1, 4096] int64, ...").
        halo_bytes: with a volume split over spatial ranks, the bytes the traced rank sends in
            one forward and backward's halo exchanges (the real run's "spatial_halo" count); 0
            otherwise.
        slab: the traced rank's slab of the example's first split tensor ((N, C, D, H, W) with D
            narrowed, for the default depth split); () without a split.
        volume: that tensor's whole shape; () without a split.
        spatial_rank: the rank of the spatial group whose slab was traced (see [Note: tracing a
            split volume] in zero/estimate/spatial.py).
        collectives: the spatial group's collectives on that rank in one forward and backward,
            as its Comm.report() counts them (label -> calls, elements, bytes); {} without a split.
    """

    peak: int
    saved: int
    inputs: str
    halo_bytes: int = 0
    slab: tuple[int, ...] = ()
    volume: tuple[int, ...] = ()
    spatial_rank: int = 0
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages operations create while they live."""

    def __init__(self, known: list[torch.Tensor], scratch: bool = True):
        super().__init__()
        self.scratch = scratch
        self.sizes: dict[int, int] = {}  # id of a live storage -> bytes (0 for the known ones)
        self.now = self.peak = 0
        for t in known:
            self._track(t, count=False)

    def _track(self, t: torch.Tensor, count: bool = True) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.sizes:
            return
        nbytes = storage.nbytes() if count else 0
        self.sizes[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        # its kernel's scratch memory, beside its outputs (see the note); measuring it needs the
        # profiler, which cannot run inside another one
        if self.scratch and func in _CONVOLUTIONS + _ATTENTION and not torch.autograd.profiler._is_profiler_enabled:
            scratch = _convolution_workspace(func, args) if func in _CONVOLUTIONS else \
                _attention_scratch(func, args, kwargs or {})
            self.peak = max(self.peak, self.now + scratch)
        return out


def _scratch(func, *args, **kwargs) -> int:
    """Bytes the real `func(*args, **kwargs)` allocates beyond its outputs, at the most."""
    from zero.probes import AllocatorPeak

    with AllocatorPeak() as measured:
        outs = func(*args, **kwargs)
    made = sum(t.untyped_storage().nbytes() for t in tree_flatten(outs)[0] if isinstance(t, torch.Tensor))
    return max(0, measured.peak - made)


_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
_WORKSPACE_EDGE = 16  # spatial size of the measured stand-in
_workspace_per_element: dict[tuple, float] = {}  # a convolution's signature -> scratch bytes per input element


_ATTENTION = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
_SCRATCH_LENGTHS = (1024, 2048)  # beyond these the kernel's block sizes no longer change
_attention_line: dict[tuple, tuple[float, float]] = {}  # signature -> (bytes, bytes per head (x token))


def _attention_scratch(func, args: tuple, kwargs: dict) -> int:
    """Scratch bytes SDPA's CPU flash kernel (or its backward) allocates inside itself beyond its
    outputs: per-thread block buffers, whose sizes stop growing past 1024 tokens, and copies of
    inputs that are not laid out [batch, sequence, heads, dim], which grow with batch x heads x
    sequence. Measured once per signature on random data of the same layouts, for one sequence: up
    to 2048 tokens at the real length with one and two heads, scaled along that line to batch x
    heads; beyond, with one head at 1024 and 2048 tokens, extended along that line to the length and
    scaled by batch x heads (see [Note: tracing activations])."""
    from torch.utils._python_dispatch import _disable_current_modes

    backward = func is _ATTENTION[1]
    q = args[1] if backward else args[0]
    batch, heads, length = q.shape[:3]
    if kwargs.get("attn_mask") is not None:
        return 0  # a mask's own shape decides; not modelled
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    short = length <= _SCRATCH_LENGTHS[1]
    key = (backward, short and length, *((t.dtype, _order(t)) for t in tensors),
           *(a for a in args if not isinstance(a, torch.Tensor)), tuple(sorted(kwargs.items())))
    if key not in _attention_line:
        # one sequence: one and two heads at this length (up to 2048), or one head at 1024 and 2048
        shapes = [(1, 1, length), (1, 2, length)] if short else [(1, 1, n) for n in _SCRATCH_LENGTHS]
        points = []
        with _disable_current_modes(), torch.no_grad():
            for b, h, n in shapes:
                real = [_stand_in(a, (b, h, n)) if isinstance(a, torch.Tensor) else a for a in args]
                if backward:  # out and logsumexp of the stand-in's own forward
                    out, lse = _ATTENTION[0](real[1], real[2], real[3], *real[6:8], **kwargs)[:2]
                    real[4], real[5] = _stand_in(args[4], (b, h, n), like=out), lse
                points.append(_scratch(func, *real, **kwargs))
        step = points[1] - points[0]  # per head, or per 1024 tokens of one head
        per_unit = step if short else step / (_SCRATCH_LENGTHS[1] - _SCRATCH_LENGTHS[0])
        _attention_line[key] = (points[0] - per_unit * (1 if short else _SCRATCH_LENGTHS[0]), per_unit)
    fixed, per_unit = _attention_line[key]
    return max(0, int(fixed + per_unit * batch * heads * (1 if short else length)))


def _order(t: torch.Tensor) -> tuple[int, ...]:
    """The dimensions from the outermost in memory to the innermost (the tensor's layout)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d)))


def _stand_in(t: torch.Tensor, shape: tuple[int, int, int], like: torch.Tensor | None = None) -> torch.Tensor:
    """A real random tensor like attention's `t` ([batch, heads, sequence, ...]) with the leading
    sizes `shape`, laid out in memory as `t` is (`like`'s values copied in, if given)."""
    size = [*shape, *t.shape[3:]][: t.dim()]
    order = _order(t)
    made = torch.empty([size[d] for d in order], dtype=t.dtype).permute(*[order.index(d) for d in range(t.dim())])
    if like is not None:
        return made.copy_(like)
    return made.normal_() if t.is_floating_point() else made.zero_()


def _convolution_workspace(func, args: tuple) -> int:
    """Scratch bytes a convolution (or its backward) allocates inside its kernel, beyond its
    outputs: measured once per signature by running it on random data of a small spatial size, and
    scaled by the input's elements (see [Note: tracing activations])."""
    from torch.utils._python_dispatch import _disable_current_modes

    backward = func is torch.ops.aten.convolution_backward.default
    x, weight = (args[1], args[2]) if backward else (args[0], args[1])
    rest = args[3:] if backward else args[2:]  # bias (sizes), stride, padding, ..., groups(, output_mask)
    small = (*x.shape[:2], *(min(d, _WORKSPACE_EDGE) for d in x.shape[2:]))
    key = (backward, small, tuple(weight.shape), x.dtype, *(tuple(r) if isinstance(r, list) else
                                                           tuple(r.shape) if isinstance(r, torch.Tensor) else r
                                                           for r in rest))
    if key not in _workspace_per_element:
        with _disable_current_modes(), torch.no_grad():
            xs = torch.randn(small, dtype=x.dtype)
            ws = torch.randn(weight.shape, dtype=weight.dtype)
            if backward:
                # the bias's sizes ([0] when there is none: a transposed convolution called without one)
                bias = torch.zeros(rest[0], dtype=x.dtype) if rest[0] is not None and all(rest[0]) else None
                ys = torch.ops.aten.convolution.default(xs, ws, bias, *rest[1:-1])
                scratch = _scratch(func, torch.randn_like(ys), xs, ws, *rest)
            else:
                bias = torch.randn(rest[0].shape, dtype=rest[0].dtype) if rest[0] is not None else None
                scratch = _scratch(func, xs, ws, bias, *rest[1:])
        _workspace_per_element[key] = scratch / xs.numel()
    return int(_workspace_per_element[key] * x.numel())


def estimate_activations(model: nn.Module, example: Any = None, *, loss: Callable[[Any], torch.Tensor] | None = None,
                         micro_batch_size: int = 1, seq_len: int | None = None, dtype: torch.dtype | None = None,
                         sequence_parallel_size: int = 1, kernel_scratch: bool = True,
                         spatial_parallel_size: int = 1, spatial_dim: int = 2) -> ActivationEstimate:
    """Activation memory of one training step of `model` on one rank (see [Note: tracing activations]).

    Args:
        model: the module as it trains (checkpointing, tiling and attention as configured). Its
            parameters are not touched: fake ones of their full shapes (stage 3's `ds_shape`) take
            their place in the trace.
        example: the forward's inputs: a tuple of positional arguments, a dict of keyword
            arguments, or a (tuple, dict) pair; tensors give shape and dtype only (real, meta or
            fake). None: token ids of [micro_batch_size, seq_len] for an HF causal LM
            (`input_ids`, `labels`) or a zero.models GPT (`idx`, `targets`).
        loss: output -> the scalar that backward starts from. Default: the output if it is a
            scalar, else its `.loss`, else the sum of its floating-point tensors.
        micro_batch_size, seq_len: the token example's shape (whole sequences: each rank of a
            sequence-parallel group gets seq_len / sequence_parallel_size tokens).
        dtype: the training dtype the engine casts the model to (None: the parameters' own);
            floating-point inputs are cast too.
        sequence_parallel_size: trace a zero GPT or an HF model with Ulysses attention over this
            many ranks (a model that has it already traces with its own group).
        kernel_scratch: add the scratch memory this machine's CPU kernels allocate inside
            convolutions and attention (see the note); False for a run on another kind of device.
        spatial_parallel_size: trace the slab of the most loaded rank of a volume split over
            this many ranks (zero.spatial): `example` holds the whole volume's tensors, and each
            tensor with a `spatial_dim` is split canonically. The model's layers are converted
            for the trace and put back after it (see [Note: tracing a split volume] in
            zero/estimate/spatial.py). A model split already (zero.initialize with
            spatial_parallel_size) needs it too, with the whole volume's example.
        spatial_dim: the split dimension of an (N, C, *spatial) tensor (default 2, depth).

    Returns:
        An ActivationEstimate (bytes per rank).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(model, nn.Module):
        raise TypeError(f"estimate_activations takes an nn.Module, got {type(model).__name__}")
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be a positive integer, got {sequence_parallel_size!r}")
    if isinstance(spatial_parallel_size, bool) or not isinstance(spatial_parallel_size, int) or spatial_parallel_size < 1:
        raise ValueError(f"spatial_parallel_size must be a positive integer, got {spatial_parallel_size!r}")
    if isinstance(spatial_dim, bool) or not isinstance(spatial_dim, int) or spatial_dim < 2:
        raise ValueError(f"spatial_dim must be a dimension >= 2 of an (N, C, *spatial) tensor, got {spatial_dim!r}")
    if spatial_parallel_size > 1 and sequence_parallel_size > 1:
        raise ValueError("spatial_parallel_size and sequence_parallel_size do not combine (zero's spatial parallelism "
                         "does not combine with sequence parallelism yet)")
    from zero.estimate.spatial import is_converted

    if spatial_parallel_size == 1 and any(is_converted(m) for m in model.modules()):
        raise ValueError("estimate_activations: the model's layers are split over a spatial group "
                         "(zero.spatial.parallelize); pass spatial_parallel_size= (the group's size) and the whole "
                         "volume's example")
    if example is None:
        example = _token_example(model, micro_batch_size, seq_len, sequence_parallel_size)
    args, kwargs = _split_example(example)
    inputs = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor))
    spatial = None
    if spatial_parallel_size > 1:  # this rank's slab (see [Note: tracing a split volume])
        from zero.estimate.spatial import plan_trace

        spatial = plan_trace(model, args, kwargs, spatial_parallel_size, spatial_dim, dtype)
        args, kwargs = spatial.args, spatial.kwargs
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    with fake, contextlib.ExitStack() as stack:
        stack.enter_context(_without_module_hooks(model))
        stack.enter_context(_hf_masks_for_trace())
        if sequence_parallel_size > 1:
            stack.enter_context(_ulysses_for_trace(model, sequence_parallel_size))
        params = _fake_parameters(model, dtype)
        args, kwargs = tree_map(lambda t: _fake_input(t, dtype), (args, kwargs))
        if spatial is not None:  # after the fake parameters and inputs are made (see the spatial note)
            stack.enter_context(spatial.groups(model))
        known = [*params.values(), *(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))]
        for p in {id(p): p for p in params.values()}.values():
            if p.requires_grad:  # the engine hands each gradient on at once (see the note)
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        step = _Step(model, loss or _default_loss)
        with _LiveBytes(known, kernel_scratch) as live:
            step.live = live
            # backward inside the call too: a checkpointed block's recomputation reads the fake parameters
            saved = torch.func.functional_call(step, {f"model.{k}": v for k, v in params.items()}, (args, kwargs),
                                               tie_weights=True, strict=False)
    if spatial is None:
        return ActivationEstimate(peak=int(live.peak), saved=int(saved), inputs=inputs)
    return ActivationEstimate(peak=int(live.peak), saved=int(saved), inputs=inputs, halo_bytes=spatial.halo_bytes,
                              slab=spatial.slab, volume=spatial.volume, spatial_rank=spatial.rank,
                              collectives=spatial.report())


class _Step(nn.Module):
    """Forward, loss and backward of `model`, as one call; returns the bytes alive when backward starts."""

    def __init__(self, model: nn.Module, loss: Callable[[Any], torch.Tensor]):
        super().__init__()
        self.model, self.loss, self.live = model, loss, None

    def forward(self, args: tuple, kwargs: dict) -> int:
        out = self.model(*args, **kwargs)
        value = self.loss(out)
        del out
        saved = self.live.now
        value.backward()
        return saved


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if getattr(out, "loss", None) is not None:
        return out.loss
    floats = [t for t in tree_flatten(out if not hasattr(out, "to_tuple") else out.to_tuple())[0]
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError("estimate_activations: the model's output has no floating-point tensor to start backward "
                         "from; pass loss=(output -> scalar)")
    return sum(t.float().sum() for t in floats)


def _split_example(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], (tuple, list)) \
            and isinstance(example[1], dict):
        return tuple(example[0]), dict(example[1])
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise TypeError(f"estimate_activations: example must be a tuple of arguments, a dict of keyword arguments or an "
                    f"(args, kwargs) pair, got {type(example).__name__}")


def _token_example(model: nn.Module, micro: int, seq_len: int | None, sp: int) -> tuple[tuple, dict]:
    """Token ids (and labels) of one rank's slice for an HF causal LM or a zero.models GPT."""
    from zero.models import GPT

    if not isinstance(seq_len, int) or seq_len < 1 or not isinstance(micro, int) or micro < 1:
        raise ValueError(f"estimate_activations without an example needs a positive seq_len and micro_batch_size, "
                         f"got seq_len={seq_len!r}, micro_batch_size={micro!r}")
    if seq_len % sp:
        raise ValueError(f"seq_len {seq_len} does not split over sequence_parallel_size {sp}")
    ids = torch.empty(micro, seq_len // sp, dtype=torch.long, device="meta")
    if isinstance(model, GPT):
        return (ids, ids), {}
    if getattr(getattr(model, "config", None), "vocab_size", None) is not None:
        return (), {"input_ids": ids, "labels": ids}
    raise ValueError(f"estimate_activations: {type(model).__name__} is neither an HF causal LM nor a zero.models GPT; "
                     f"pass example=(its forward's inputs)")


def _fake_parameters(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Fake tensors of every parameter's and buffer's full shape, tied ones shared (call inside the
    fake mode)."""
    made: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in made:
            shape = tuple(getattr(t, "ds_shape", None) or t.shape)
            cast = dtype if dtype is not None and t.is_floating_point() and isinstance(t, nn.Parameter) else t.dtype
            made[id(t)] = torch.empty(shape, dtype=cast, requires_grad=isinstance(t, nn.Parameter) and t.requires_grad)
        out[name] = made[id(t)]
    return out


def _fake_input(t: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=cast, requires_grad=t.requires_grad)  # inside the fake mode: fake, on the CPU


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _without_module_hooks(model: nn.Module):
    """The model's module hooks (ZeRO's gathers and the like) set aside for the trace."""
    kept = [(m, {name: getattr(m, name) for name in _HOOK_DICTS if hasattr(m, name)}) for m in model.modules()]
    try:
        for m, hooks in kept:
            for name, value in hooks.items():
                setattr(m, name, type(value)())
        yield
    finally:
        for m, hooks in kept:
            for name, value in hooks.items():
                setattr(m, name, value)


@contextlib.contextmanager
def _hf_masks_for_trace():
    """transformers decides whether a causal mask can be left to SDPA's `is_causal` by reading the
    attention and position values, which fake tensors do not have; it then builds the whole
    [sequence x sequence] mask "to be safe". For the trace, its mask helpers see what a batch of
    unpadded, unpacked sequences is (what the example is): no mask is built, as in the real run."""
    import sys

    masks = sys.modules.get("transformers.masking_utils")
    if masks is None:  # transformers not in use
        yield
        return
    from torch._subclasses.fake_tensor import is_fake

    saved = {name: getattr(masks, name) for name in ("is_tracing", "fast_all", "find_packed_sequence_indices")
             if hasattr(masks, name)}
    replaced = {
        "is_tracing": lambda tensor=None: saved["is_tracing"](None if tensor is not None and is_fake(tensor) else tensor),
        "fast_all": lambda tensor: True if is_fake(tensor) else saved["fast_all"](tensor),
        "find_packed_sequence_indices": lambda position_ids: None if is_fake(position_ids) else
        saved["find_packed_sequence_indices"](position_ids),
    }
    try:
        for name in saved:
            setattr(masks, name, replaced[name])
        yield
    finally:
        for name, value in saved.items():
            setattr(masks, name, value)


@contextlib.contextmanager
def _ulysses_for_trace(model: nn.Module, size: int):
    """A zero GPT's blocks or an HF model's attention given the Ulysses exchange over `size`
    stand-in ranks, for the trace only."""
    from zero.models import Block
    from zero.sequence.ulysses import DistributedAttention, ShapeGroup, _causal_bhsd

    group = ShapeGroup(size)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if blocks:
        before = [b.attend for b in blocks]
        for b in blocks:
            b.attend = DistributedAttention(_causal_bhsd, group, scatter_idx=1, gather_idx=2)
        try:
            yield
        finally:
            for b, attend in zip(blocks, before):
                b.attend = attend
        return
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"sequence_parallel_size: {type(model).__name__} is neither a zero.models GPT nor an HF model; "
                         f"give it DistributedAttention and trace it as it is")
    from transformers import AttentionInterface

    from zero.sequence.hf import UlyssesSPAttentionHF

    core = config._attn_implementation
    if core not in AttentionInterface._global_mapping:
        raise ValueError(f"sequence_parallel_size: the model's attention {core!r} is not a transformers attention "
                         f"implementation that can be wrapped; load it with attn_implementation='sdpa'")
    name = "zero_ulysses_estimate"
    AttentionInterface.register(name, UlyssesSPAttentionHF(AttentionInterface._global_mapping[core], group, size).forward)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(core)


__all__ = ["ActivationEstimate", "estimate_activations"]

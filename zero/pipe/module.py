"""PipelineModule: a model given as a list of layers, of which each rank builds only its stage's.

[Note: pipeline layers]
DeepSpeed's pipeline API, on torch.distributed.pipelining:
- `layers` is a list of LayerSpec (a class and its arguments, built only on the stage that runs
  it), TiedLayerSpec (the same, shared under a key: every stage holding the key builds one
  module, and their gradients are summed), nn.Module instances (already built everywhere; kept
  only where they run) and plain callables (functions of the activation, such as a reshape).
- Each layer takes one argument, the previous layer's output (a tensor or a tuple), and returns
  one. The first stage's input is the micro-batch's inputs; the last stage's output goes to
  `loss_fn(output, labels)`.
- The layers are split into `num_stages` consecutive parts by `partition_method` (see
  `partition`); with `virtual_stages` = V > 1 (the interleaved schedule) into P x V parts, rank r
  holding parts r, r + P, r + 2P, ...
- A local layer is registered under its global index (`"3"`, as DeepSpeed names them) and a tied
  module under `tied_modules.<key>`, so parameter names do not depend on the stage count and
  a checkpoint loads into another split.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn


class LayerSpec:
    """A layer to build later, on its own stage: `typename(*module_args, **module_kwargs)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec takes an nn.Module class and its arguments, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every place that names `key` (an embedding and the output head, say).

    Args:
        key: the name the places share.
        typename, module_args, module_kwargs: as LayerSpec.
        forward_fn: `forward_fn(module, x)` runs the shared module here instead of `module(x)`
            (the head: `lambda emb, x: x @ emb.weight.t()`).
        tied_weight_attr: the attribute(s) of the module that are tied (DeepSpeed's argument; zero
            ties every parameter of the module).
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = "weight", **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec's key must be a non-empty string, got {key!r}")
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def partition(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries [b_0 = 0, b_1, ..., b_parts = len(weights)] of `parts` consecutive non-empty
    groups whose largest weight sum is as small as it can be; of the splits that reach it, the one
    whose first group is largest, then the second's, and so on (ties go to earlier stages)."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} non-empty pipeline parts")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def fits(limit: float) -> list[int] | None:
        # greedy from the front, leaving at least one layer for every later part
        bounds, start = [0], 0
        for k in range(parts - 1):
            end = start + 1
            while end < n - (parts - 1 - k) and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            if prefix[end] - prefix[start] > limit:
                return None
            bounds.append(end)
            start = end
        return bounds + [n] if prefix[n] - prefix[start] <= limit else None

    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # the smallest candidate limit that fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    return fits(candidates[lo])  # type: ignore[return-value]


def partition_uniform(n: int, parts: int) -> list[int]:
    """Boundaries of `parts` groups of n // parts layers, the first n % parts groups one more."""
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} non-empty pipeline parts")
    size, extra = divmod(n, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def _count_parameters(layer: Any) -> int:
    """Trainable parameters of a layer, built on the meta device if it is a spec (no memory)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def layer_weights(layers: Sequence[Any], method: str) -> list[float] | None:
    """Per-layer weights of `method` ("parameters", "type:<regex>"), or None for "uniform"."""
    if method == "uniform":
        return None
    if method == "parameters":
        return [float(_count_parameters(layer)) for layer in layers]
    if method.lower().startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        names = [(layer.typename if isinstance(layer, LayerSpec) else type(layer)).__name__ for layer in layers]
        weights = [1.0 if pattern.search(name) else 0.0 for name in names]
        if not any(weights):
            raise ValueError(f"partition_method {method!r}: no layer's class name matches (layers: {sorted(set(names))})")
        return weights
    raise ValueError(f"partition_method must be 'parameters', 'uniform' or 'type:<regex>', got {method!r}")


class PipelinePart(nn.Module):
    """One consecutive part of the layers, the module a pipeline stage runs."""

    def __init__(self, index: int, layers: list[tuple[int, Any]], tied: nn.ModuleDict, checkpoint_every: int):
        super().__init__()
        self.index = index
        self.entries: list[tuple[int, Any]] = layers  # (global index, module / spec / callable)
        for idx, layer in layers:
            if isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
        self.tied = tied  # shared with the PipelineModule and its other parts
        self.checkpoint_every = checkpoint_every
        self.use_reentrant = False  # the config's pipeline.use_reentrant (zero/pipe/schedule.py)

    def _run(self, start: int, stop: int, x: Any) -> Any:
        for _, layer in self.entries[start:stop]:
            if isinstance(layer, TiedLayerSpec):
                module = self.tied[layer.key]
                x = layer.forward_fn(module, x) if layer.forward_fn is not None else module(x)
            else:
                x = layer(x)
        return x

    def forward(self, *args: Any) -> Any:
        x = args[0] if len(args) == 1 else args
        every = self.checkpoint_every
        if not every or not torch.is_grad_enabled():
            return self._run(0, len(self.entries), x)
        from torch.utils.checkpoint import checkpoint

        for start in range(0, len(self.entries), every):
            x = checkpoint(self._run, start, start + every, x, use_reentrant=self.use_reentrant)
        return x


class PipelineModule(nn.Module):
    """DeepSpeed's PipelineModule: `layers` split into `num_stages` stages (see [Note: pipeline
    layers]). Needs torch.distributed (rank and world size) when built: each rank builds only
    the layers of its own stage.

    Args:
        layers: LayerSpec, TiedLayerSpec, nn.Module or callable entries, in order.
        num_stages: pipeline stages P; the world must be a multiple of it.
        loss_fn: `loss_fn(output, labels)` on the last stage.
        partition_method: "parameters", "uniform" or "type:<regex>" (see `partition`).
        seed_layers: build layer i after `torch.manual_seed(base_seed + i)`, so its initial
            values do not depend on the stage count.
        base_seed: see `seed_layers`.
        activation_checkpoint_interval: recompute every this many layers' activations in
            backward (0: off).
        virtual_stages: parts per rank, for the interleaved schedule (zero's own argument).
        topology: DeepSpeed's process topology; refused (the config's mesh decides).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: Any = None,
                 virtual_stages: int = 1):
        super().__init__()
        import torch.distributed as dist

        if topology is not None:
            raise ValueError("PipelineModule(topology=...) is DeepSpeed's process grid; zero takes the mesh from the "
                             "config (pipeline.stages, tensor_parallel.size): pass num_stages instead")
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages, a positive integer, got {num_stages!r}")
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"layers[{i}] is a {type(layer).__name__}: expected a LayerSpec, TiedLayerSpec, "
                                f"nn.Module or callable")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world % num_stages:
            raise ValueError(f"PipelineModule(num_stages={num_stages}) on {world} ranks: the world size must be a "
                             f"multiple of the stage count")
        self.num_stages, self.virtual_stages = num_stages, virtual_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.stage_id = rank // (world // num_stages)  # see [Note: the parallel mesh]
        parts = num_stages * virtual_stages
        weights = layer_weights(layers, partition_method.lower() if partition_method.lower() in
                                ("parameters", "uniform") else partition_method)
        self.parts_bounds = partition_uniform(len(layers), parts) if weights is None else partition(weights, parts)
        self.part_ids = [self.stage_id + v * num_stages for v in range(virtual_stages)]
        self.tied_modules = nn.ModuleDict()
        self.tied_keys: dict[str, list[int]] = {}  # key -> parts that use it
        for p in range(parts):
            for layer in layers[self.parts_bounds[p] : self.parts_bounds[p + 1]]:
                if isinstance(layer, TiedLayerSpec):
                    self.tied_keys.setdefault(layer.key, [])
                    if p not in self.tied_keys[layer.key]:
                        self.tied_keys[layer.key].append(p)
        seed = seed_fn or torch.manual_seed
        built: list[PipelinePart] = []
        for p in self.part_ids:
            entries = []
            for idx in range(self.parts_bounds[p], self.parts_bounds[p + 1]):
                layer = layers[idx]
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in self.tied_modules:
                        if seed_layers:
                            seed(base_seed + idx)
                        self.tied_modules[layer.key] = layer.build()
                    entries.append((idx, layer))
                    continue
                if isinstance(layer, LayerSpec):
                    if seed_layers:
                        seed(base_seed + idx)
                    layer = layer.build()
                if isinstance(layer, nn.Module):
                    self.add_module(str(idx), layer)
                entries.append((idx, layer))
            built.append(PipelinePart(p, entries, self.tied_modules, activation_checkpoint_interval))
        object.__setattr__(self, "parts", built)  # not registered: the layers are, under their indices

    @property
    def stage_parts(self) -> list[int]:
        """The global part indices this rank runs (one per virtual stage)."""
        return list(self.part_ids)

    def tied_stages(self, key: str) -> list[int]:
        """The pipeline stages (ranks' stage ids) that hold tied key `key`."""
        return sorted({p % self.num_stages for p in self.tied_keys[key]})

    def forward(self, *args: Any) -> Any:
        if self.num_stages * self.virtual_stages > 1:
            raise RuntimeError("a PipelineModule of several stages runs through engine.train_batch() / "
                               "engine.eval_batch(), not by calling it (each rank holds only its own layers)")
        return self.parts[0](*args)

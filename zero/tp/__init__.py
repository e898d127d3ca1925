"""Tensor slicing on torch's DTensor: `parallelize(model, mesh, plan)` over the mesh's "tp" dimension.

    mesh = zero.tp.mesh(config)                 # the (pp, dp, tp) mesh the config asks for
    zero.tp.parallelize(model, mesh, "gpt")     # or a {module path: ParallelStyle} plan
    engine, *_ = zero.initialize(model=model, config=config)

A plan is torch.distributed.tensor.parallel's: `ColwiseParallel` slices a Linear's outputs (its
weight's rows), `RowwiseParallel` its inputs (and sums the partial outputs), an Embedding's
RowwiseParallel slices the vocabulary. Our named plans (`PLANS`) are such dicts for the GPT of
zero.models (built with fused_qkv=False), HuggingFace Llama and GPT-2 (zero/tp/plans.py;
GPT-2's Conv1D layers and fused attention take the styles of zero/tp/styles.py); see
docs/parallelism.md.
The engine then runs ZeRO on each rank's pieces over the "dp" group ([Note: sliced parameters]
in zero/parallel/sliced.py).
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

import torch.nn as nn

from zero.tp.plans import PLANS

__all__ = ["mesh", "parallelize", "PLANS"]


def mesh(config: Any, world_size: int | None = None):
    """The ParallelMesh `config` asks for (pipeline.stages x data x tensor_parallel.size ranks),
    joining torchrun's process group if needed. `zero.initialize` reuses the same mesh."""
    import torch.distributed as dist

    from zero.config import load_config
    from zero.parallel.comm import Comm
    from zero.parallel.mesh import build_mesh
    from zero.parallel.process_group import compute_device, init_distributed

    init_distributed()
    world = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    cfg = load_config(config, world_size=world)
    p, t = cfg.pipeline.stages, cfg.tensor_parallel.size
    return build_mesh(p, world // (p * t), t, compute_device(Comm()))


def parallelize(model: nn.Module, mesh: Any, plan: dict[str, Any] | str) -> nn.Module:
    """Slice `model` in place over the "tp" dimension of `mesh` (a ParallelMesh, or torch's
    DeviceMesh: one-dimensional, or with a "tp" dimension) by `plan`: {module path (fnmatch
    patterns allowed): ParallelStyle}, or a name in PLANS. Returns the model.

    Parameters tied to each other (an embedding and the output head) stay tied when both ends
    are sliced alike (both keep their weight's rows: a vocabulary-sliced embedding and a
    column-sliced head)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from zero.parallel.mesh import ParallelMesh

    tp_mesh = mesh.tp_mesh() if isinstance(mesh, ParallelMesh) else (
        mesh["tp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh)
    if tp_mesh.ndim != 1:
        raise ValueError(f"parallelize needs a one-dimensional tensor-parallel mesh (or one with a 'tp' dimension), "
                         f"got a mesh of shape {tuple(tp_mesh.shape)}")
    size = tp_mesh.size()
    if any(getattr(p, "_zero", None) is not None for p in model.parameters()):
        raise ValueError("parallelize: this model's parameters are ZeRO stage-3 shards (built under zero.Init or "
                         "zero.integrations.hf.from_pretrained); build or load it whole, slice it, then initialize")
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"no tensor-parallel plan named {plan!r}; named plans: {sorted(PLANS)} (or pass a dict "
                             f"of module path -> ParallelStyle)")
        plan = PLANS[plan](model, size)
    paths = [name.split(".") for name, _ in model.named_modules() if name]
    unmatched = [key for key in plan if not any(
        len(atoms) == len(key.split(".")) and all(map(fnmatch, atoms, key.split("."))) for atoms in paths)]
    if unmatched:  # torch only warns, and the model would train whole on every tensor rank
        raise ValueError(f"parallelize: no module of the {type(model).__name__} is at plan path(s) {unmatched[:4]}; "
                         f"the plan's paths are relative to the model passed (a wrapped model, such as a PeftModel, "
                         f"has its own prefix)")
    ties = _ties(model)
    parallelize_module(model, tp_mesh, plan)
    _retie(model, ties)
    return model


def parallelize_for_initialize(model: nn.Module, mesh: Any, plan: str, model_parameters: Any, optimizer: Any) -> Any:
    """`parallelize` for `zero.initialize` (DeepSpeed's autotp_size): `model_parameters` (params
    or param groups) and a torch optimizer made from the unsliced parameters are pointed at the
    sliced ones that replace them. Returns the model_parameters to use."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
        raise ValueError("initialize would slice the model's parameters, but the optimizer given has state for the "
                         "unsliced ones; slice with zero.tp.parallelize before it takes a step")
    params = None if model_parameters is None else list(model_parameters)
    before = {(id(m), n): p for m in model.modules() for n, p in m.named_parameters(recurse=False)}
    parallelize(model, mesh, plan)
    moved = {id(before[(id(m), n)]): p for m in model.modules() for n, p in m.named_parameters(recurse=False)
             if (id(m), n) in before and before[(id(m), n)] is not p}

    def swap(group: Any) -> list:
        return [moved.get(id(p), p) for p in ([group] if isinstance(group, torch.Tensor) else group)]

    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = swap(group["params"])
    if params is None:
        return None
    return [{**g, "params": swap(g["params"])} if isinstance(g, dict) else moved.get(id(g), g) for g in params]


def _ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Places (module, attribute) that hold the same parameter, for parameters held in several."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((module, name))
    return [v for v in places.values() if len(v) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[nn.Module, str]]]) -> None:
    for places in ties:
        first_module, first_name = places[0]
        kept = getattr(first_module, first_name)
        for module, name in places[1:]:
            other = getattr(module, name)
            if other is kept:
                continue
            same = type(other) is type(kept) and getattr(other, "placements", None) == getattr(kept, "placements", None)
            if not same or other.shape != kept.shape:
                raise ValueError(f"a parameter shared by {type(first_module).__name__}.{first_name} and "
                                 f"{type(module).__name__}.{name} was sliced differently at the two places "
                                 f"({getattr(kept, 'placements', 'whole')} and {getattr(other, 'placements', 'whole')}); "
                                 f"slice both alike (a vocabulary-sliced embedding with a column-sliced head) or untie "
                                 f"them")
            setattr(module, name, kept)


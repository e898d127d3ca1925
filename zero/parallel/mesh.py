"""The (pp, dp, tp) device mesh of a 3D-parallel run, and the groups the engine's pieces use.

See [Note: the parallel mesh] in zero/config/parallel.py for the layout. The mesh is torch's
DeviceMesh: its "tp" dimension is what `zero.tp.parallelize` slices over, its "pp" dimension
carries torch.distributed.pipelining's stage-to-stage sends, and its "dp" dimension is the
group ZeRO partitions over (the engine's `comm`). The global gradient norm sums over the whole
world, each parameter counted once (see `ModelParallelNorm`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zero.components import Component
from zero.parallel.comm import Comm
from zero.parallel.sliced import local_tensor, slicing


@dataclasses.dataclass
class ParallelMesh:
    """The sizes, this rank's coordinates and the groups of a (pp, dp, tp) mesh.

    Args:
        device_mesh: torch's mesh, dimensions named "pp", "dp", "tp".
    """

    device_mesh: DeviceMesh

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.device_mesh.shape)  # type: ignore[return-value]

    @property
    def pp(self) -> int:
        return self.shape[0]

    @property
    def dp(self) -> int:
        return self.shape[1]

    @property
    def tp(self) -> int:
        return self.shape[2]

    def coordinate(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at mesh coordinates (pp, dp, tp)."""
        return int(self.device_mesh.mesh[pp, dp, tp].item())

    def tp_mesh(self) -> DeviceMesh:
        """The one-dimensional tensor-parallel mesh this rank belongs to."""
        return self.device_mesh["tp"]


def replica_counts(module: torch.nn.Module, mesh: ParallelMesh) -> dict[torch.nn.Parameter, int]:
    """Parameter -> how many tensor-parallel ranks hold the same values of it: the tp size for a
    parameter that is not sliced over "tp" (a plain tensor, or a DTensor replicated there), else 1."""
    if mesh.tp == 1:
        return {}
    return {q: 1 if slicing(q) is not None else mesh.tp for q in module.parameters()}


_MESHES: dict[tuple, ParallelMesh] = {}
def build_mesh(pp: int, dp: int, tp: int, device: torch.device) -> ParallelMesh:
    """The mesh of `pp` x `dp` x `tp` ranks over the world (every rank calls this)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if pp * dp * tp != world:
        raise ValueError(f"a mesh of pipeline {pp} x data {dp} x tensor {tp} = {pp * dp * tp} ranks does not cover the "
                         f"world of {world}")
    key = (id(dist.group.WORLD), pp, dp, tp, device.type)
    if key not in _MESHES:  # one per process: zero.tp.parallelize and initialize share it
        _MESHES[key] = ParallelMesh(init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp")))
    return _MESHES[key]


class ModelParallelNorm:
    """The global gradient norm of a model split over pipeline stages and tensor slices.

    Each rank's optimizer sums the squares of its own gradient pieces; the world's sum counts a
    parameter several times where several ranks hold the same values: a tensor-parallel layer's
    replicated parameters (a bias or norm weight every tensor rank holds whole) and tied
    parameters (one copy per stage that holds them, gradients already summed). Each such piece
    is counted with weight 1 / copies, and a stage-0 optimizer (every data rank holding the whole
    sum) with 1 / dp, so that one all-reduce over the world gives the norm of the whole model.

    Args:
        world: the world's collectives.
        copies: parameter -> how many ranks of one data replica hold the same values of it.
    """

    def __init__(self, world: Comm, copies: dict[torch.nn.Parameter, int]):
        self.world = world
        self.copies = {p: c for p, c in copies.items() if c > 1}

    @classmethod
    def of(cls, module: torch.nn.Module, mesh: ParallelMesh) -> ModelParallelNorm:
        """The norm of `module` on `mesh`: copies from tensor replication and, for a PipelineModule,
        from tied modules held on several stages."""
        copies = replica_counts(module, mesh)
        tied = getattr(module, "tied_modules", None)
        for key, shared in (tied.items() if tied is not None else []):
            for q in shared.parameters():
                copies[q] = copies.get(q, 1) * len(module.tied_stages(key))
        return cls(Comm(), copies)

    def reduce(self, storage, total: torch.Tensor) -> None:
        """Turn `total` (this rank's sum of squares over `storage`'s slots, float64) into the
        world's, in place."""
        for p, c in self.copies.items():
            piece = storage.owned_grad(p)
            if piece is not None and piece.numel():
                total -= (1 - 1 / c) * torch.linalg.vector_norm(piece, dtype=torch.float64).to(total.device) ** 2
        if storage.norm_copies() > 1:  # every data rank holds the same elements (stage 0)
            total /= storage.norm_copies()
        self.world.all_reduce(total, "sum")


def refuse_whole_model_save(mesh: ParallelMesh | None, what: str) -> None:
    """The whole-model savers with pipeline stages or tensor slices, refused with the way to get the
    same file: no rank holds the whole model (its stages and slices are on other ranks), and a
    training checkpoint (`save_checkpoint`, which 3D runs support) turns into a plain state dict
    with `python -m zero.checkpoint to-fp32`."""
    if mesh is not None and (mesh.pp > 1 or mesh.tp > 1):
        raise NotImplementedError(
            f"engine.{what} with pipeline stages or tensor slices is not implemented: no rank holds the whole model. "
            f"Nothing was written. Save with engine.save_checkpoint(dir) and write the weights with "
            f"`python -m zero.checkpoint to-fp32 dir out --dtype bf16` (or zero.checkpoint.consolidate.get_fp32_state_dict(dir))")


class MeshTraffic(Component):
    """The pipeline and tensor-parallel traffic of a 3D-parallel model, counted per step, and how
    the mesh divides its parameters: the engine's comm_report() and memory_report() add these (the
    engine's "mesh_traffic" component; see [Note: engine components]).

    - Communication, per step: "pp" the activations sent to the next stage and the gradients sent
      back (each part's outputs and inputs, counted by hooks); "tp" the tensor-parallel
      collectives inside the sliced layers (a column-sliced layer all-reduces its input's gradient
      in backward, a row-sliced one its output in forward; an output gathered whole counts its
      size), counted by hooks as logical bytes like the data-parallel group's ("dp").
    - Memory: the mesh's shape, this rank's coordinates, and how each dimension divides the
      parameters: the whole model's count, this pipeline stage's, what this rank stores (its
      tensor slices) and what its optimizer shard covers (the data-parallel partition).

    Args:
        module: the model.
        mesh: the mesh.
        stage_modules: this rank's pipeline parts (a PipelineModule's `parts`; none without a pipeline).
        optimizer_numel: elements of this rank's optimizer shard.
    """

    def __init__(self, module: torch.nn.Module, mesh: ParallelMesh, stage_modules: list[torch.nn.Module],
                 optimizer_numel: int):
        self.mesh = mesh
        self._traffic: dict[str, dict[str, dict[str, int]]] = {"pp": {}, "tp": {}}
        self.last: dict[str, dict[str, dict[str, int]]] = {"pp": {}, "tp": {}}

        def count(dim: str, name: str, tensors) -> None:
            entry = self._traffic[dim].setdefault(name, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += sum(t.numel() * t.element_size() for t in tensors)

        last = mesh.pp * getattr(module, "virtual_stages", 1) - 1
        for part in stage_modules:
            index = getattr(part, "index", 0)
            if index < last:
                part.register_forward_hook(lambda m, a, out: count("pp", "activations", _floats(out)))
            if index > 0:
                part.register_forward_pre_hook(lambda m, args: count("pp", "gradients", [
                    t for t in _floats(args) if t.requires_grad]) if torch.is_grad_enabled() else None)
        for sub in module.modules():
            sliced = _sliced_direction(sub)
            if sliced is None:
                continue
            direction, width = sliced
            if direction == "column":
                sub.register_forward_pre_hook(lambda m, args: count("tp", "all_reduce", needs) if (
                    needs := [t for t in _floats(args) if t.requires_grad]) and torch.is_grad_enabled() else None)
                # an output that comes back with all the columns was gathered
                sub.register_forward_hook(lambda m, a, out, width=width: count("tp", "all_gather", gathered) if (
                    gathered := [t for t in _floats(out) if t.shape[-1] == width]) and width > 1 else None)
            else:
                sub.register_forward_hook(lambda m, a, out: count("tp", "all_reduce", _floats(out)))
        params = {id(p): p for p in module.parameters()}.values()
        local = sum(_stored_numel(p) for p in params)
        whole = sum(_whole_numel(p) for p in params)  # global shapes: this stage's parameters, unsliced
        tied = getattr(module, "tied_modules", None)
        stages_of = {id(q): len(module.tied_stages(k)) for k, m in (tied.items() if tied is not None else [])
                     for q in m.parameters()}
        share = torch.tensor([sum(_whole_numel(p) / stages_of.get(id(p), 1) for p in params)], dtype=torch.float64)
        if mesh.tp > 1:  # every tensor rank of a stage holds the same global shapes
            share /= mesh.tp
        share /= mesh.dp
        Comm().all_reduce(share, "sum")
        self.parameters = {"model": int(round(share.item())), "stage": whole, "rank": local,
                           "optimizer_shard": optimizer_numel}

    name = "mesh_traffic"

    def after_step(self, engine, applied: bool) -> None:
        self.close_window()

    def close_window(self) -> None:
        """At the end of a step: this step's pipeline and tensor traffic becomes the report's."""
        self.last = self._traffic
        self._traffic = {"pp": {}, "tp": {}}

    def memory(self) -> dict:
        """The "mesh" entry of the engine's memory report."""
        return {"shape": {"pp": self.mesh.pp, "dp": self.mesh.dp, "tp": self.mesh.tp},
                "coordinate": {d: self.mesh.coordinate(d) for d in ("pp", "dp", "tp")},
                "parameters": dict(self.parameters)}


def _stored_numel(p: torch.Tensor) -> int:
    """Elements this rank stores of `p` when gathered: its tensor slice (a stage-3 shard's whole piece)."""
    z = getattr(p, "_zero", None)
    return z.numel if z is not None else local_tensor(p).numel()


def _whole_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter (a DTensor keeps its global shape; a stage-3 shard its `_zero`)."""
    z = getattr(p, "_zero", None)
    return p.numel() if hasattr(p, "_local_tensor") or z is None else z.numel


def _sliced_direction(module: torch.nn.Module) -> tuple[str, int] | None:
    """("column", whole output width) for a layer sliced by its outputs (each rank computes some
    columns from the whole input), ("row", width) for one sliced by its inputs (partial outputs
    summed over the ranks: also a vocabulary-sliced embedding); None for a layer not sliced."""
    weight = getattr(module, "weight", None)
    s = slicing(weight) if isinstance(weight, torch.Tensor) else None
    if s is None:
        return None
    if isinstance(module, torch.nn.Linear):  # weight [out, in]
        return ("column" if s[0] == 0 else "row"), weight.shape[0]
    if isinstance(module, torch.nn.Embedding):  # weight [vocab, dim]
        return ("row" if s[0] == 0 else "column"), weight.shape[1]
    from zero.parallel.sliced import is_conv1d

    if is_conv1d(module):  # HuggingFace Conv1D, weight [in, out]
        return ("column" if s[0] == 1 else "row"), weight.shape[1]
    return None


def _floats(obj) -> list[torch.Tensor]:
    from zero.graph import tensors_in

    return [t for t in tensors_in(obj) if t.is_floating_point()]

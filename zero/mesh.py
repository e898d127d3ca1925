"""The (pp, dp, tp) device mesh of a 3D-parallel run, and the groups the engine's pieces use.

See [Note: the parallel mesh] in zero/config/parallel.py for the layout. The mesh is torch's
DeviceMesh: its "tp" dimension is what `zero.tp.parallelize` slices over, its "pp" dimension
carries torch.distributed.pipelining's stage-to-stage sends, and its "dp" dimension is the
group ZeRO partitions over (the engine's `comm`). The global gradient norm sums over the whole
world, each parameter counted once (see `ModelParallelNorm`).
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zero.comm import Comm, collective_timeout_s


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
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for q in module.parameters():
        if mesh.tp == 1:
            break
        sliced = isinstance(q, DTensor) and any(not isinstance(pl, Replicate) for pl in q.placements)
        out[q] = 1 if sliced else mesh.tp
    return out


_MESHES: dict[tuple, ParallelMesh] = {}
_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def group_of(ranks: list[int]) -> dist.ProcessGroup:
    """A process group over `ranks` (made once per process; only its members take part)."""
    key = (id(dist.group.WORLD), *sorted(ranks))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(sorted(ranks), timeout=timedelta(seconds=collective_timeout_s()),
                                      use_local_synchronization=True)
    return _GROUPS[key]


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

    def reduce(self, optimizer, total: torch.Tensor) -> None:
        """Turn `total` (this rank's sum of squares, float64) into the world's, in place."""
        for p, c in self.copies.items():
            piece = optimizer.owned_grad(p)
            if piece is not None and piece.numel():
                total -= (1 - 1 / c) * torch.linalg.vector_norm(piece, dtype=torch.float64).to(total.device) ** 2
        if not optimizer.norm_is_partitioned():
            total /= optimizer.comm.world_size
        self.world.all_reduce(total, "sum")


class MeshCheckpointRefusal:
    """Checkpoint entry points of the pipeline and tensor-parallel engines: refused with the reason
    until zero's checkpoint format describes stage- and slice-local pieces. (Its files are named by
    data-parallel rank and its writers chosen within one data-parallel group, so two stages or two
    tensor slices would write over each other's files.)"""

    def _refuse(self, what: str):
        raise NotImplementedError(
            f"engine.{what} with pipeline stages or tensor slices is not implemented yet: zero's checkpoints are laid "
            f"out per data-parallel group, and the stages and slices of a 3D run would overwrite each other's files. "
            f"Nothing was written or read. Save the model's weights with engine.module.state_dict() per rank meanwhile")

    def save_checkpoint(self, *args, **kwargs):
        self._refuse("save_checkpoint")

    def load_checkpoint(self, *args, **kwargs):
        self._refuse("load_checkpoint")

    def save_16bit_model(self, *args, **kwargs):
        self._refuse("save_16bit_model")

    def consolidated_16bit_state_dict(self, *args, **kwargs):
        self._refuse("consolidated_16bit_state_dict")

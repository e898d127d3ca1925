"""Where this rank's pieces of each tensor lie in a checkpoint's global tensors, for engines whose
ranks hold different parts of the model (pipeline stages, tensor slices).

[Note: sliced tensors in checkpoints]
A checkpoint holds every tensor as one global 1-D tensor of its full length (see [Note: checkpoint
chunks]). A parameter sliced over T tensor-parallel ranks (a DTensor placed Shard(d) on the "tp"
mesh) is stored as its T local pieces back to back, tensor rank t's piece flattened at the offset
of pieces 0..t-1. For d = 0 that is the parameter's own row-major order, so nothing records it;
for d > 0 the checkpoint records the layout {"dim": d, "parts": T} beside the tensor's shape, and
for a strided slice (GPT-2's fused q/k/v, [Note: fused q/k/v slices] in zero/tp/styles.py) also
"split": 3, along any dimension: rank t's piece is then the t-th piece of each third. ZeRO's
flat buffers hold local pieces ([Note: sliced parameters] in zero/parallel/sliced.py), so a rank's
chunks are its optimizer's offsets within its local piece plus the piece's start.

Loading a tensor stored in another layout than this engine's (a change of tensor_parallel.size,
or a sliced checkpoint into an unsliced model and back) reads the whole tensor on each rank that
needs part of it and re-slices it there: for the duration of the load, host memory for the whole
of those tensors (model, master and both Adam moments) of this rank's pipeline stage.

A value held by several ranks is written by one of them: a stage-0 or frozen parameter and a
buffer by data rank 0 (the optimizer's rule), a tensor not sliced over "tp" by tensor rank 0, and a
tied parameter (a TiedLayerSpec's module on several pipeline stages) by the first stage holding it.
Pipeline layers keep their global index as their name on whatever stage holds them, so a
checkpoint loads at another pipeline stage count as well.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from zero.parallel.comm import Comm
from zero.parallel.sliced import slicing


def _piece_sizes(n: int, parts: int) -> list[int]:
    """Sizes of the `parts` pieces of a dimension of `n` (torch.chunk's rule, which DTensor's
    Shard follows: pieces of ceil(n / parts), the last ones shorter or empty)."""
    size = -(-n // parts)
    return [max(0, min(size, n - i * size)) for i in range(parts)]


def layout_of(t: torch.Tensor) -> dict | None:
    """The checkpoint layout of `t`: None for the row-major order, else {"dim", "parts"} and,
    for a strided slice, "split"."""
    s = slicing(t)
    if s is None or s == (0, 1):  # not sliced, or sliced by rows: its pieces back to back are its row-major order
        return None
    dim, split = s
    if t.shape[dim] % split:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} sliced in {split} strided parts along dimension {dim}, "
                         f"which {split} does not divide: zero checkpoints store strided slices of equal parts")
    return {"dim": dim, "parts": t.device_mesh.size(), **({"split": split} if split > 1 else {})}


def piece_offset(t: torch.Tensor) -> int:
    """Where this rank's local piece of `t` starts in its global 1-D tensor."""
    s = slicing(t)
    if s is None:
        return 0
    dim, split = s
    shape = tuple(t.shape)
    sizes = _piece_sizes(shape[dim] // split, t.device_mesh.size())
    return split * sum(sizes[: t.device_mesh.get_local_rank()]) * (math.prod(shape) // max(shape[dim], 1))


def to_whole(flat: torch.Tensor, shape: list[int], layout: dict | None) -> torch.Tensor:
    """The tensor of `shape` from its global 1-D tensor stored in `layout`: rank t's piece is,
    for each of the `split` equal parts of the dimension, that part's t-th piece."""
    if layout is None:
        return flat.view(shape)
    if set(layout) - {"dim", "parts", "split"}:
        raise ValueError(f"a tensor stored in layout {layout}, which this zero does not know (a newer zero wrote it?)")
    dim, parts, split = layout["dim"], layout["parts"], layout.get("split", 1)
    sizes = _piece_sizes(shape[dim] // split, parts)
    inner = math.prod(shape) // max(shape[dim], 1)
    pieces = [p.view(*shape[:dim], split * s, *shape[dim + 1:]).chunk(split, dim) if s else [p] * split
              for p, s in zip(flat.split([split * s * inner for s in sizes]), sizes)]
    return torch.cat([pieces[t][k] for k in range(split) for t in range(parts) if sizes[t]], dim=dim)


def from_whole(whole: torch.Tensor, layout: dict | None) -> torch.Tensor:
    """The global 1-D tensor of `whole` in `layout` (the reverse of `to_whole`)."""
    if layout is None:
        return whole.reshape(-1)
    dim, parts, split = layout["dim"], layout["parts"], layout.get("split", 1)
    sizes = _piece_sizes(whole.shape[dim] // split, parts)
    cut = [part.split(sizes, dim=dim) for part in whole.chunk(split, dim=dim)]
    return torch.cat([torch.cat([c[t] for c in cut], dim=dim).reshape(-1) for t in range(parts)])


class Placement:
    """The io group and the writers of an engine's checkpoint (see [Note: sliced tensors in
    checkpoints]). Without a mesh: the engine's data-parallel group, every tensor written by the
    optimizer's rule."""

    def __init__(self, engine):
        mesh = getattr(engine, "mesh", None)
        self.mesh = mesh
        # every rank of the run: with replicas (hybrid sharding), the shard group and its replicas
        self.world = Comm() if mesh is not None else getattr(engine, "dp", engine.comm)
        self._not_mine: set[int] = set()
        if mesh is None:
            return
        module = engine.module
        if mesh.coordinate("tp") != 0:  # tensors every tensor rank holds whole: tensor rank 0 writes them
            self._not_mine |= {id(t) for t in [*module.parameters(), *module.buffers()] if slicing(t) is None}
        tied = getattr(module, "tied_modules", None)
        for key, m in (tied.items() if isinstance(tied, nn.ModuleDict) else []):
            if module.tied_stages(key)[0] != mesh.coordinate("pp"):
                self._not_mine |= {id(t) for t in [*m.parameters(), *m.buffers()]}

    @functools.cached_property
    def io(self) -> Comm:
        """The gloo group checkpoint files are written over (made at first use: after the ranks
        agreed that they are all saving)."""
        return self.world.io()

    def writes(self, t: torch.Tensor) -> bool:
        """This rank writes its pieces of `t` (another rank holding the same values does not)."""
        return id(t) not in self._not_mine

    def mesh_shape(self) -> dict | None:
        return None if self.mesh is None else {"pp": self.mesh.pp, "dp": self.mesh.dp, "tp": self.mesh.tp}

    def gather(self, value):
        """`value` of every rank of the run, in rank order (one rank: [value])."""
        import torch.distributed as dist

        if self.io.world_size == 1:
            return [value]
        out = [None] * self.io.world_size
        dist.all_gather_object(out, value, group=self.io.group)
        return out

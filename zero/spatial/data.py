"""Each rank of a spatial group loads only its slab of every volume.

[Note: loading slabs]
The ranks of a spatial group share their samples (the engine's loader and `deepspeed_io` count
only the data-parallel ranks, see [Note: parallel dimensions] in zero/parallel/dims.py), and
each needs only its slab of them: the canonical split of the volume's split dimension
(`Split`, [Note: slabs and halos] in zero/spatial/halo.py). Two places can cut the slab out:
- the collate function (`SlabCollate`): the dataset reads whole volumes, the batch is cut before
  it leaves the loader, so only the slab is pinned, moved to the device and kept. Simple, but
  every rank of the group still reads the whole volume from disk;
- the dataset (`read_slab`): it slices its file lazily (a numpy memmap, an h5py dataset, a
  nibabel image's `dataobj`) so that only the slab's planes are read at all.
Each slab is this rank's own part of the split of *that tensor's* length, so a volume and its
label map are cut the same way whatever their lengths, and the result equals `shard_volume` of
the whole batch; never cut it again with `shard_volume`.

DataLoader workers get the collate function and the dataset pickled (with the "spawn" start
method they also start without the group `initialize` made), and a Comm does not pickle: what
they keep is this rank's place, `SpatialRank` (two numbers). `SlabCollate` takes it from the
group when it is built with `comm=`, else from the group `initialize` made when it is first used
or pickled, so it can be built before `initialize` and passed to it as `collate_fn`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from zero.parallel.comm import Comm
from zero.spatial.halo import Split
from zero.spatial.layers import SpatialError


@dataclass(frozen=True)
class SpatialRank:
    """This rank's place in its spatial group, without the group itself: what a collate function
    or a dataset keeps so that it pickles into DataLoader workers (a Comm does not). Accepted
    wherever a `comm=` of this module is.

    Args:
        rank: this rank's index in the group.
        world_size: the ranks of the group.
    """

    rank: int
    world_size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise SpatialError(f"SpatialRank: rank {self.rank} is not one of the group's {self.world_size} ranks")

    @staticmethod
    def of(comm: Comm | SpatialRank | None = None) -> SpatialRank:
        """The place of this rank in `comm` (default: the spatial group `initialize` made)."""
        if comm is None:
            import zero.spatial  # the package imports this module: look its group up at call time

            layout = zero.spatial._current
            if layout is not None and len(layout.dims) > 1:
                raise SpatialError(f"the volume is split over a grid of dimensions {list(layout.dims)}; SlabCollate, "
                                   f"read_slab and slab_bounds cut one dimension: cut batches with "
                                   f"zero.spatial.shard_volume")
            try:
                comm = zero.spatial._comm(None)
            except SpatialError as e:
                raise SpatialError(f"{e}. In a DataLoader worker started with 'spawn' there is no group: build "
                                   f"the dataset or collate function with comm=zero.spatial.SpatialRank.of() "
                                   f"after initialize") from None
        if isinstance(comm, SpatialRank):
            return comm
        return SpatialRank(comm.rank, comm.world_size)


def _bounds(length: int, place: SpatialRank, what: str) -> tuple[int, int]:
    start, stop = Split(length, place.world_size).bounds(place.rank)
    if start == stop:
        raise SpatialError(f"{what}: {length} plane(s) cannot give each of the {place.world_size} spatial ranks a "
                           f"plane (rank {place.rank} would get none); use volumes of at least "
                           f"{place.world_size} planes along the split dimension, or a smaller spatial_parallel_size")
    return start, stop


def slab_bounds(length: int, comm: Comm | SpatialRank | None = None) -> tuple[int, int]:
    """This rank's planes [start, stop) of a dimension of `length` planes: the canonical split
    (the first length % P ranks one plane more), as `shard_volume` cuts.

    Args:
        length: the dimension's whole length.
        comm: the spatial group, or a `SpatialRank` (default: the group `initialize` made).

    Raises:
        SpatialError: some rank of the group would get no plane, or there is no group.
    """
    return _bounds(length, SpatialRank.of(comm), "slab_bounds")


def read_slab(source, dim: int, comm: Comm | SpatialRank | None = None) -> torch.Tensor:
    """This rank's slab of `source` along `dim`, as a tensor of its own memory, asking `source`
    for those planes only: `source[:, ..., start:stop]` with `stop - start` planes at `dim`.

    Anything with `shape` and numpy-style basic slicing reads lazily this way: a memmap
    (`np.load(path, mmap_mode="r")`) reads only the slab's pages, an h5py dataset and a nibabel
    image's `dataobj` only its planes; a numpy array or a tensor is sliced and copied.

    Args:
        source: the whole volume, not read yet.
        dim: the split dimension *of `source`*: 1 for a (C, D, H, W) file whose D is dimension 2
            of the (N, C, D, H, W) batch; negative counts from the end.
        comm: the spatial group, or a `SpatialRank` (default: the group `initialize` made).

    Raises:
        SpatialError: `dim` is not a dimension of `source`, or some rank would get no plane.
    """
    shape = tuple(source.shape)
    if not -len(shape) <= dim < len(shape):
        raise SpatialError(f"read_slab: dim {dim} is not a dimension of a source of shape {shape}")
    dim %= len(shape)
    start, stop = _bounds(shape[dim], SpatialRank.of(comm), f"read_slab (dimension {dim} of shape {shape})")
    planes = source[(slice(None),) * dim + (slice(start, stop),)]
    if isinstance(planes, torch.Tensor):
        return planes.clone(memory_format=torch.contiguous_format)
    planes = np.asarray(planes)
    if not planes.dtype.isnative:  # a big-endian file (NIfTI, .npy saved elsewhere): torch takes native order only
        planes = planes.astype(planes.dtype.newbyteorder("="))
    if planes.base is not None or not planes.flags.writeable or not planes.flags.c_contiguous:
        planes = np.array(planes, order="C")  # not a view of the memmap or of a whole array read into memory
    return torch.from_numpy(planes)


class SlabCollate:
    """A collate function that cuts every volume of the batch to this rank's slab along `dim`,
    so that a DataLoader over whole volumes hands each rank of a spatial group its slabs (equal
    to `shard_volume` of the whole batch). Picklable for DataLoader workers; see [Note: loading
    slabs].

        zero.initialize(model=unet, config=config, training_data=volumes, collate_fn=SlabCollate())

    Args:
        collate_fn: makes the batch from the samples (default: torch's default_collate).
        dim: the split dimension of the batch's volumes ((N, C, D, H, W): 2, depth).
        keys: for batches that are dicts, the keys whose tensors are cut (default: every tensor
            of the batch with more than `dim` dimensions, in dicts, lists and tuples at any depth).
        comm: the spatial group, or a `SpatialRank` (default: the group `initialize` made, looked
            up when the function is first used or pickled).

    Raises:
        SpatialError (when called): a tensor of `keys` with too few dimensions, a key the batch
            lacks, `keys` with a batch that is not a dict, or a volume too short for the group.
    """

    def __init__(self, collate_fn: Callable[[list], Any] | None = None, dim: int = 2,
                 keys: Sequence[str] | None = None, comm: Comm | SpatialRank | None = None):
        if isinstance(keys, str):
            raise SpatialError(f"SlabCollate(keys={keys!r}): give a list of keys, e.g. keys=[{keys!r}]")
        if dim < 0:
            raise SpatialError(f"SlabCollate(dim={dim}): give the dimension counted from the front (2: the depth of "
                               f"an (N, C, D, H, W) batch)")
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.dim, self.keys = dim, None if keys is None else list(keys)
        self._place = None if comm is None else SpatialRank.of(comm)

    @property
    def place(self) -> SpatialRank:
        """This rank's place in the spatial group the slabs are cut for."""
        return self._place if self._place is not None else SpatialRank.of(None)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_place": self.place}  # a worker may not have the group: take it along

    def __call__(self, samples: list) -> Any:
        return self.cut(self.collate_fn(samples))

    def cut(self, batch: Any) -> Any:
        """`batch` with its volumes cut to this rank's slabs (new tensors; the rest as it was)."""
        place = self.place
        if self.keys is None:
            return self._cut(batch, place, "batch", strict=False)
        if not isinstance(batch, Mapping):
            raise SpatialError(f"SlabCollate(keys={self.keys}): the batch is a {type(batch).__name__}, not a dict; "
                               f"leave keys out to cut every tensor with more than {self.dim} dimensions")
        missing = [k for k in self.keys if k not in batch]
        if missing:
            raise SpatialError(f"SlabCollate(keys={self.keys}): the batch has no {missing} (its keys: {list(batch)})")
        out = dict(batch)
        for key in self.keys:
            out[key] = self._cut(batch[key], place, f"batch[{key!r}]", strict=True)
        return _like(batch, out)

    def _cut(self, value: Any, place: SpatialRank, where: str, strict: bool) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() <= self.dim:
                if strict:
                    raise SpatialError(f"SlabCollate: {where} has shape {tuple(value.shape)}, no dimension {self.dim} "
                                       f"to split")
                return value
            start, stop = _bounds(value.shape[self.dim], place, f"SlabCollate: {where} of shape {tuple(value.shape)}")
            return value.narrow(self.dim, start, stop - start).clone(memory_format=torch.contiguous_format)
        if isinstance(value, Mapping):
            out = {k: self._cut(v, place, f"{where}[{k!r}]", strict) for k, v in value.items()}
            return _like(value, out)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(self._cut(v, place, f"{where}.{f}", strict) for f, v in zip(value._fields, value)))
        if isinstance(value, (list, tuple)):
            return type(value)(self._cut(v, place, f"{where}[{i}]", strict) for i, v in enumerate(value))
        return value


def _like(mapping: Mapping, out: dict) -> Mapping:
    """`out` as a mapping of `mapping`'s type where that type can be made from a dict (an
    OrderedDict, a BatchEncoding), else the dict (as default_collate does)."""
    if type(mapping) is dict:
        return out
    try:
        return type(mapping)(out)
    except TypeError:
        return out

"""Every process group zero uses, made once per process, and the counted, bounded Comms over them.

[Note: one group registry]
A run's groups come from its ParallelDims (zero/parallel/dims.py) through `ParallelGroups`: a
named group ("zero", "sp", "pp", "batch", ...) is the set of ranks its dimensions give, made once
per process by `group_of` (torch's new_group, by its members only, with zero's collective
timeout), or taken from the device mesh when the mesh has that group already, or the default
group when it is the whole world. Collectives on them go through `Comm` (zero/parallel/comm.py),
which counts their logical bytes and bounds their waits on gloo:
- an engine's own collectives (gradient reductions, parameter gathers, the norm) through the
  Comms `ParallelGroups.comm` makes for it, counted in its comm report;
- the traffic around them (Ulysses' all-to-alls and the sequence loss's token count, a
  pipeline's tied gradients and loss, the sequence data loader's batch exchange) through the one
  shared Comm per group and kind that `shared_comm` hands out, counted once there; the engine
  adds the sequence kind's counts to its report at each step (`take_traffic`).
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from zero.parallel.comm import Comm, collective_timeout_s
from zero.parallel.dims import ParallelDims
from zero.parallel.nodes import node_of_ranks

if TYPE_CHECKING:
    from zero.parallel.mesh import ParallelMesh

# ranks -> (a weak reference to the world it was made in, the group); the reference does not keep a
# destroyed world alive (see [Note: gloo at exit] in zero/parallel/process_group.py)
_GROUPS: dict[tuple, tuple[weakref.ref, dist.ProcessGroup]] = {}
_SHARED: dict[tuple, tuple[object, Comm]] = {}  # (id of a group, kind) -> (the group, the shared Comm over it)
_NODES: dict[str, object] = {}  # "world": a weak reference to the world group, "nodes": each global rank's node


def group_of(ranks: list[int]) -> dist.ProcessGroup:
    """A process group over `ranks` (made once per process; only its members take part)."""
    key, world = tuple(sorted(ranks)), dist.group.WORLD
    entry = _GROUPS.get(key)
    if entry is None or entry[0]() is not world:  # made in a process group since destroyed: make it again
        group = dist.new_group(list(key), timeout=timedelta(seconds=collective_timeout_s()),
                               use_local_synchronization=True)
        entry = _GROUPS[key] = (weakref.ref(world), group)
    return entry[1]


def shared_comm(group, kind: str = "side") -> Comm:
    """The one counted, bounded Comm over `group` (None: the world) for traffic of `kind` outside
    an engine's own collectives; see [Note: one group registry]. Placed on the ranks' nodes once an
    engine has learnt them (the sequence, pipeline and tie groups' bytes join the byte ledger)."""
    key = (id(group), kind)
    entry = _SHARED.get(key)
    if entry is None or entry[0] is not group:
        entry = _SHARED[key] = (group, Comm(group))
    comm = entry[1]
    world, nodes = _NODES.get("world"), _NODES.get("nodes")
    if getattr(comm, "_placed_by", None) is not nodes and world is not None and dist.is_initialized() \
            and world() is dist.group.WORLD:  # the nodes the latest engine learnt
        comm.place_on_nodes(nodes)
        comm._placed_by = nodes
    return comm


def take_traffic(kind: str) -> dict[str, dict[str, int]]:
    """The shared Comms' counts of `kind` since the last call, summed per collective label, and
    their counts reset."""
    out: dict[str, dict[str, int]] = {}
    for (_, k), (_, comm) in _SHARED.items():
        if k != kind:
            continue
        for name, count in comm.report().items():
            total = out.setdefault(name, {"calls": 0, "elements": 0, "bytes": 0, "cross_node_bytes": 0})
            for key in total:
                total[key] += count[key]
        comm.reset_counts()
    return out


def waited_s(kind: str) -> float:
    """Seconds this process waited for the shared Comms of `kind` (gloo; see Comm.wait_for)."""
    return sum(comm.wait_s for (_, k), (_, comm) in _SHARED.items() if k == kind)


class ParallelGroups:
    """The process groups of one run on this rank, by name (see [Note: parallel dimensions] and
    [Note: one group registry]).

    Args:
        dims: the run's parallel dimensions.
        mesh: the device mesh of a run with pipeline stages or tensor slices, whose groups are used
            where they are the same ranks.
    """

    def __init__(self, dims: ParallelDims, mesh: ParallelMesh | None = None):
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if dims.world_size != world:
            raise ValueError(f"parallel dimensions for {dims.world_size} ranks in a world of {world}")
        self.dims, self.mesh = dims, mesh
        self.rank = dist.get_rank() if distributed else 0
        self._groups: dict[str, object] = {}
        self._nodes: list[int] | None = None  # each global rank's node (zero/parallel/nodes.py)

    def ranks(self, name: str) -> list[int]:
        """This rank's group `name`, as global ranks in rank order."""
        return self.dims.ranks(name, self.rank)

    def size(self, name: str) -> int:
        return self.dims.size(name)

    def index(self, name: str) -> int:
        """This rank's place in its group `name`."""
        return self.dims.index_in(name, self.rank)

    def group(self, name: str):
        """The process group of this rank's group `name`: the mesh's own where it has one over the
        same ranks, the default group for the whole world, else one made by `group_of` (None in a
        world of one without torch.distributed)."""
        if name not in self._groups:
            ranks = self.ranks(name)
            found = self._mesh_group(ranks)
            if found is None and dist.is_available() and dist.is_initialized():
                found = dist.group.WORLD if len(ranks) == self.dims.world_size else group_of(ranks)
            self._groups[name] = found
        return self._groups[name]

    def _mesh_group(self, ranks: list[int]):
        if self.mesh is None:
            return None
        for dim in self.mesh.device_mesh.mesh_dim_names:
            group = self.mesh.group(dim)
            if sorted(dist.get_process_group_ranks(group)) == ranks:
                return group
        return None

    def comm(self, name: str, strict_tags: bool = False) -> Comm:
        """A new Comm over this rank's group `name`, for an engine's own collectives (counted in its
        report, with the bytes that cross nodes: see [Note: the byte ledger] in
        zero/parallel/comm.py); `strict_tags` as Comm's. Over the whole world it is the default
        group's. The first call is collective (the ranks say their nodes)."""
        group = self.group(name)
        comm = Comm(None if group is dist.group.WORLD else group, strict_tags)
        if self._nodes is None:
            self._nodes = node_of_ranks()
            _NODES.update(world=weakref.ref(dist.group.WORLD) if dist.is_initialized() else None, nodes=self._nodes)
        comm.place_on_nodes(self._nodes)
        return comm


def sequence_parallel_group(size: int):
    """This rank's sequence-parallel group of `size` consecutive ranks (ranks r with the same
    r // size share samples; see [Note: parallel dimensions]), made once; None when size is 1.

    Raises:
        ValueError: `size` does not divide the world.
    """
    if size <= 1:
        return None
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"sequence_parallel_size {size} does not divide the world of {world} ranks")
    return ParallelGroups(ParallelDims(world, sp=size)).group("sp")


def data_parallel_rank_and_size(sequence_parallel_size: int) -> tuple[int, int]:
    """(this rank's place among the ranks loading different samples, their number) when
    `sequence_parallel_size` ranks share each sample."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = ParallelDims(world, sp=sequence_parallel_size)
    return dims.index_in("batch", rank), dims.size("batch")

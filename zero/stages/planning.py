"""Stage 3 planning: shard every parameter, then decide which parameters form which unit."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from zero.parallel.comm import Comm
from zero.parallel.sliced import local_tensor
from zero.partition.shards import ShardedParam, gather_param, mark_ds, shard_numel, take_shard


def _owner(paths: list[str]) -> str:
    """The deepest module path that is a prefix (an ancestor) of every path in `paths`."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _in_subtree(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def plan_units(module: nn.Module, persistence_threshold: int, unit_threshold: int,
               persistence_budget: int | None = None) -> tuple[list[tuple[str, list[nn.Parameter]]], list[nn.Parameter]]:
    """Decide which parameters form which unit.

    A parameter belongs to the deepest module that contains every module holding it (a tied
    embedding/output weight belongs to their common ancestor, so it stays gathered across both
    uses). Parameters of at most `persistence_threshold` elements are persistent. Walking the
    module tree bottom-up, a module becomes a unit when the unclaimed parameters of its subtree
    reach `unit_threshold` elements, or when it is marked with `zero.set_z3_leaf_modules` (then
    its whole subtree is that one unit); the root takes whatever is left. ModuleList/ModuleDict are skipped: they are never called.
    `persistence_budget` caps the total elements kept persistent (smallest parameters first).

    Returns:
        ([(module path, params)] in module order, persistent params)
    """
    holders: dict[nn.Parameter, list[str]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(p, []).append(path)
    owner = {p: _owner(paths) for p, paths in holders.items()}
    size = {p: p._zero.numel if getattr(p, "_zero", None) is not None else p.numel() for p in holders}
    persistent, kept = [], 0
    for p in sorted((p for p in holders if size[p] <= persistence_threshold), key=size.__getitem__):
        if persistence_budget is not None and kept + size[p] > persistence_budget:
            break
        persistent.append(p)
        kept += size[p]
    unclaimed = set(holders) - set(persistent)
    modules = dict(module.named_modules())
    order = {path: i for i, path in enumerate(modules)}
    rank_of = {p: i for i, p in enumerate(holders)}
    leaves = [path for path, m in modules.items() if getattr(m, "_zero_unit", False)]
    units: list[tuple[str, list[nn.Parameter]]] = []
    for path in sorted(modules, key=lambda p: (-(p.count(".") + 1 if p else 0), order[p])):
        if isinstance(modules[path], (nn.ModuleList, nn.ModuleDict)):
            continue  # containers are never called, so their hooks would never fire
        if any(path != leaf and _in_subtree(path, leaf) for leaf in leaves):
            continue  # inside a leaf module: the leaf is gathered as a whole
        mine = [p for p in unclaimed if _in_subtree(owner[p], path)]
        leaf = getattr(modules[path], "_zero_unit", False)
        if mine and (path == "" or leaf or sum(size[p] for p in mine) >= unit_threshold):
            mine.sort(key=rank_of.__getitem__)
            units.append((path, mine))
            unclaimed -= set(mine)
    units.sort(key=lambda u: order[u[0]])
    return units, persistent


def describe_shard(p: nn.Parameter, world_size: int) -> ShardedParam:
    """`p._zero`, created for a parameter that is still whole (see [Note: parameter shards])."""
    if getattr(p, "_zero", None) is None:  # a tensor slice: its local piece (see [Note: sliced parameters])
        local = local_tensor(p)
        p._zero = ShardedParam(local.shape, local.numel(), shard_numel(local.numel(), world_size))
    return p._zero


@torch.no_grad()
def reshard_init(p: nn.Parameter, comm: Comm) -> None:
    """A parameter `zero.Init` sharded over the world, for an engine that shards over fewer ranks
    (hybrid sharding's shard group): cut again for `comm` from its full value, gathered over the
    world (one parameter's full value at a time; every rank calls it in the same order)."""
    info = getattr(p, "_zero", None)
    world = Comm()
    if info is None or info.local is None or info.unit is not None or comm.world_size == world.world_size:
        return
    full = gather_param(info.local, info.numel, world)
    info.local = take_shard(full, comm.rank, comm.world_size).to(info.local.device)
    info.shard_numel = shard_numel(info.numel, comm.world_size)
    mark_ds(p, info, info.local)


@torch.no_grad()
def take_local_shard(p: nn.Parameter, comm: Comm, broadcast=None) -> torch.Tensor:
    """This rank's shard of `p`, in `p`'s own dtype and on its own device (the exact values the
    fp32 master starts from). `broadcast(t)` gives every rank the first rank's `t` (default: over
    `comm`; with replicas, over them too: Placement.broadcast_initial).

    A whole parameter takes rank 0's values where it is (under NCCL a host parameter goes through
    the GPU on its own, see [Note: host tensors and NCCL]) and is cut; its full tensor is dropped
    (`p.data` becomes empty). A parameter sharded by `zero.Init` already holds rank 0's values in
    its local shard, which is handed over.
    """
    info = describe_shard(p, comm.world_size)
    local, info.local = info.local, None
    if local is None:
        full = local_tensor(p).detach()
        (broadcast or (lambda t: comm.broadcast(t, src=0)))(full)  # every rank starts from rank 0's values
        local = take_shard(full, comm.rank, comm.world_size)
        local_tensor(p).data = local[:0]
    return local


@dataclass
class DiskPlan:
    """Which units keep their shards on disk (see [Note: parameters on NVMe] in
    zero/offload/param_swap.py).

    Args:
        on_disk: module path of each unit -> its shard is on disk.
        disk_bytes: bytes of the shards on disk in this rank's swap file.
        largest: elements of the largest shard on disk (what a buffer holds).
        too_big: (unit, elements) of the first shard on disk larger than `buffer_size`, or None.
    """

    on_disk: dict[str, bool]
    disk_bytes: int
    largest: int
    too_big: tuple[str, int] | None = None


def plan_disk(module: nn.Module, options, world_size: int, dtype: torch.dtype) -> DiskPlan:
    """Plan the units of `module` as stage 3 will (`plan_units`) and decide which shards go to disk
    (build_optimizer refuses a shard larger than `buffer_size` from it, before anything is built).

    Args:
        module: the model.
        options: the Stage3Options (its `param_nvme` policy, unit and persistence settings).
        world_size: ranks the shards divide over.
        dtype: the parameters' training dtype.
    """
    from zero.offload.nvme import region_bytes

    policy = options.param_nvme
    planned, _ = plan_units(module, options.persistence_threshold, options.unit_elements, options.persistence_budget)
    size = lambda p: p._zero.numel if getattr(p, "_zero", None) is not None else local_tensor(p).numel()  # noqa: E731
    in_cpu, on_disk, disk_bytes, largest, too_big = 0, {}, 0, 0, None
    item = torch.empty((), dtype=dtype).element_size()
    for path, params in planned:
        numel = sum(shard_numel(size(p), world_size) for p in params)
        on_disk[path] = in_cpu + numel > policy.max_in_cpu
        if not on_disk[path]:
            in_cpu += numel
            continue
        if numel > policy.buffer_size and too_big is None:
            too_big = (path or "<root>", numel)
        disk_bytes += region_bytes(numel * item)
        largest = max(largest, numel)
    return DiskPlan(on_disk, disk_bytes, largest, too_big)

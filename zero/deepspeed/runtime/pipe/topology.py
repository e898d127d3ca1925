"""`deepspeed.runtime.pipe.topology`: named Cartesian layouts of ranks and the process groups of a
pipeline x data x model grid, which Megatron-style scripts build their groups (their `mpu`) from.

[Note: topology and zero's mesh]
A ProcessTopology numbers its coordinates row-major in the order the axes are given: the last
axis varies fastest. PipeModelDataParallelTopology's axes are (pipe, data, model), so
rank = (pipe * D + data) * T + model: exactly the layout of zero's own (pp, dp, tp) mesh
(zero/parallel/mesh.py, [Note: the parallel mesh] in zero/config/parallel.py), where a tensor-parallel
group is the closest ranks and a pipeline stage's ranks are contiguous. PipeDataParallelTopology
(pipe, data) is the same with T = 1. So a script's grid and the engine's mesh agree on which
rank is which stage, replica and slice whenever their sizes agree (pipeline.stages = P,
tensor_parallel.size = T). Note the argument order of PipeModelDataParallelTopology:
(num_pp, num_mp, num_dp), while its axes are (pipe, data, model).

zero's engine takes its layout from the config, not from these objects (PipelineModule refuses
`topology=`); PipelineParallelGrid is the `mpu` a script hands to its own code (and to helpers
such as deepspeed.runtime.utils.clip_grad_norm_).
"""
from __future__ import annotations

import logging
from collections import namedtuple
from itertools import product
from typing import Any

import torch.distributed as dist

from zero.deepspeed._missing import missing

logger = logging.getLogger("zero.deepspeed")


class ProcessTopology:
    """Ranks laid out on a grid of named axes, row-major (the last axis varies fastest).

    Args:
        axes: the axis names, outermost first (`["x", "y"]`: (x, y) and (x, y + 1) are neighbours).
        dims: the length of each axis.

    Coordinates are `ProcessCoord` namedtuples with a field per axis; `mapping` is
    {ProcessCoord: rank}.
    """

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        # product() runs row-major, so the i-th coordinate it yields is rank i
        self.mapping = {self.ProcessCoord(*c): rank for rank, c in enumerate(product(*(range(d) for d in dims)))}
        self._coords = list(self.mapping)

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate: `ProcessTopology(["x", "y"], [2, 3]).get_rank(x=0, y=1) == 1`.

        Raises:
            ValueError: an axis is missing (use `filter_match` for a slice) or out of range.
        """
        if len(coord_kwargs) != len(self.axes):
            raise ValueError(f"get_rank() needs a coordinate on every axis {self.axes}, got {coord_kwargs} "
                             f"(for a slice use filter_match())")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: list[str] = ["data", "pipe"],  # noqa: B006 (DeepSpeed's default)
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """The rank's coordinate as text for file names: axes not omitted as `<axis><inner_sep><two
        digits>` joined by `outer_sep` (`model_01`; `a_01-b_01`)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in frozenset(omit_axes))

    def get_dim(self, axis: str) -> int:
        """The length of `axis`, 0 if the topology has no such axis."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """The ProcessCoord of `rank` (`.x`, `.y`, ... are its coordinates).

        Raises:
            ValueError: the rank is not in the topology.
        """
        if not (isinstance(rank, int) and 0 <= rank < len(self._coords)):
            raise ValueError(f"rank {rank} not found in topology (ranks 0..{len(self._coords) - 1}).")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups along `axis`: for every coordinate of the other axes (row-major), the ranks that
        differ only in `axis`, in its order. [] if there is no such axis.

        `ProcessTopology(["pipe", "data", "model"], [2, 2, 2]).get_axis_comm_lists("pipe")` is
        [[0, 4], [1, 5], [2, 6], [3, 7]].
        """
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        return [[self.get_rank(**dict(zip(others, fixed)), **{axis: i}) for i in range(self.get_dim(axis))]
                for fixed in product(*(range(self.get_dim(a)) for a in others))]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks (ascending) whose coordinates match every given axis value:
        `filter_match(pipe=0, data=1)`."""
        return [rank for rank, c in enumerate(self._coords)
                if all(getattr(c, axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks (ascending) whose coordinate on `axis` is `idx`."""
        position = self.axes.index(axis)
        return [rank for rank, c in enumerate(self._coords) if c[position] == idx]

    def world_size(self) -> int:
        """The number of ranks, the product of the dims."""
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Axes (pipe, data): a data-parallel group is consecutive ranks (one node's fast links carry
    the gradient reductions), a pipeline spans nodes."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes (pipe, data, model), zero's (pp, dp, tp) layout (see [Note: topology and zero's mesh]).
    The arguments are in DeepSpeed's order: pipeline, model (tensor), data sizes."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """The prime factors of n, ascending with repeats (12 -> [2, 2, 3])."""
    if n <= 0:
        raise ValueError(f"prime factors need a positive integer, got {n}")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def _new_group(ranks: list[int]) -> Any:
    """A process group over `ranks`, made by its members only (see zero.parallel.groups.group_of)."""
    from zero.parallel.groups import group_of

    return group_of(ranks)


class PipelineParallelGrid:
    """The process groups of a topology with a `pipe` axis (and optionally `data` and `model`), and
    the Megatron `mpu` queries over them.

    Groups this rank belongs to: the data-parallel group (same stage and slice, `get_data_parallel_group`),
    the pipeline (same replica and slice, `get_pipe_parallel_group`), the model-parallel group (every
    pipeline and tensor rank of this data replica, `get_model_parallel_group`, what DeepSpeed reduces
    norms and overflow over) and the tensor slice group (same stage and replica,
    `get_slice_parallel_group`; this rank alone without a `model` axis). Each is a torch.distributed
    group made with new_group by its members (zero.parallel.groups.group_of: made once per process per set of
    ranks, with zero's collective timeout).

    Args:
        topology: the layout; None splits the world into pipe x data by alternating its prime
            factors (DeepSpeed's default: 8 ranks -> pipe 4, data 2).
        process_group: None or the world group (DeepSpeed does not use it either; the grid always
            covers the world).

    Raises:
        ValueError: the topology's size is not the world size, or another process group is given.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        if process_group is not None and process_group is not dist.group.WORLD:
            raise ValueError("PipelineParallelGrid covers the world; a process_group other than the world is not "
                             "supported (DeepSpeed ignores the argument)")
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            factors = _prime_factors(self.world_size)
            num_pp, num_dp = 1, 1
            for i, f in enumerate(factors):
                num_pp, num_dp = (num_pp * f, num_dp) if i % 2 == 0 else (num_pp, num_dp * f)
            topology = PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
        elif self.global_rank == 0:
            logger.info("Using topology: %s", topology)
        self._topo = topology
        if not self._is_grid_valid():
            raise ValueError(f"the topology {dict(zip(topology.axes, topology.dims))} has {topology.world_size()} "
                             f"ranks but the world has {self.world_size}")
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        # model parallel: every rank of this data replica (all stages, all slices)
        model_ranks = topology.get_axis_list("data", self.data_parallel_id) if "data" in topology.axes \
            else list(range(self.world_size))
        self.ds_model_proc_group = _new_group(model_ranks)
        self.ds_model_world_size = len(model_ranks)
        self.ds_model_rank = model_ranks.index(self.global_rank)

        self.dp_groups = topology.get_axis_comm_lists("data")
        self.dp_group = self._mine(self.dp_groups) or [self.global_rank]
        self.dp_proc_group = _new_group(self.dp_group)

        self.p2p_groups = self._build_p2p_groups()

        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        self.pp_group = self._mine(self.pipe_groups)
        self.pp_proc_group = _new_group(self.pp_group)

        if self.model_parallel_size == 1:
            self.slice_group = [self.global_rank]
        else:
            self.model_groups = topology.get_axis_comm_lists("model")
            self.mp_group = []
            self.slice_group = self._mine(self.model_groups)
        self.slice_proc_group = _new_group(self.slice_group)

    def _mine(self, lists: list[list[int]]) -> list[int]:
        return next((ranks for ranks in lists if self.global_rank in ranks), [])

    def _build_p2p_groups(self) -> list[list[int]]:
        """For every rank, [rank, the rank of the next stage of its pipeline] (the last stage's next
        is the first)."""
        pairs = []
        for rank in range(self.world_size):
            pipe = next(ranks for ranks in self._topo.get_axis_comm_lists("pipe") if rank in ranks)
            pairs.append([rank, pipe[(pipe.index(rank) + 1) % len(pipe)]])
        return pairs

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == dist.get_world_size()

    def get_stage_id(self) -> int:
        return self._topo.get_coord(self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(self.global_rank).data

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in this rank's pipeline (other coordinates as given in kwargs)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    # the mpu queries
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.get_stage_id()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.get_pipe_parallel_rank()

    def get_pipe_parallel_world_size(self) -> int:
        """The number of stages."""
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.get_pipe_parallel_world_size()

    def get_pipe_parallel_group(self) -> Any:
        """The ranks of this rank's pipeline (one per stage)."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """Which pipeline (data replica) this rank is in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines (data replicas)."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        """The ranks of this stage and slice in every pipeline."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the ranks of its data replica."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        """Every rank of this data replica (all stages and slices)."""
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's tensor slice (0 without a `model` axis)."""
        return self._topo.get_coord(self.global_rank).model if "model" in self._topo.axes else 0

    def get_tensor_model_parallel_rank(self) -> int:
        return self.get_slice_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.get_slice_parallel_world_size()

    def get_slice_parallel_group(self) -> Any:
        """The ranks holding the other slices of this rank's tensors (this rank alone without a
        `model` axis)."""
        return self.slice_proc_group

    def get_tensor_model_parallel_group(self) -> Any:
        """Megatron's name for `get_slice_parallel_group` (DeepSpeed's grid lacks it)."""
        return self.get_slice_parallel_group()


def __getattr__(name: str):
    return missing(__name__, name)

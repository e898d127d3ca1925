"""The engine of a model sliced by `zero.tp.parallelize`, without pipeline stages: ZeRO over the
mesh's "dp" group on each rank's pieces, the gradient norm over the whole model."""
from __future__ import annotations

import torch.distributed as dist

from zero.comm import Comm
from zero.config import ZeroConfig
from zero.engine import Engine
from zero.mesh import MeshReports, ModelParallelNorm, ParallelMesh, WholeModelSaveRefusal, replica_counts


class TensorParallelEngine(WholeModelSaveRefusal, MeshReports, Engine):
    """A tensor-parallel (and data-parallel) model; see zero/tp/__init__.py. Built by
    `zero.initialize` when tensor_parallel.size > 1. The ranks of one tensor-parallel group must
    be fed the same batches (the data loader of `initialize(training_data=...)` is split over the
    data-parallel ranks only)."""

    def __init__(self, module, config: ZeroConfig, mesh: ParallelMesh, model_parameters=None, optimizer=None,
                 lr_scheduler=None):
        self.mesh = mesh
        super().__init__(module, config, model_parameters, optimizer, lr_scheduler,
                         comm=Comm(mesh.group("dp")) if dist.is_initialized() else Comm())
        self.optimizer.model_parallel = ModelParallelNorm(Comm(), replica_counts(module, mesh))
        self._init_mesh_reports([])

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        super().step()
        if boundary:
            self._close_traffic_window()

"""`deepspeed.module_inject.layers`: `LinearLayer` (column-parallel) and `LinearAllreduce`
(row-parallel), the two tensor-parallel Linear layers, on torch's DTensor as zero.tp slices.

[Note: DeepSpeed's TP layers on DTensor]
Each layer takes a whole nn.Linear (the same weights on every rank of `mp_group`) and keeps this
rank's slice as DTensor parameters on the one-dimensional mesh of `mp_group`: LinearLayer keeps its
weight's rows and the bias's matching entries (Shard(0), what ColwiseParallel does), LinearAllreduce
its weight's columns (Shard(1), RowwiseParallel) and the whole bias. So they are what
zero.tp.parallelize makes of a Linear, and zero's engine trains them like any sliced parameter
([Note: sliced parameters] in zero/parallel/sliced.py): build them before zero.initialize, with
the config's tensor_parallel.size equal to the group's size. Their inputs and outputs are plain
tensors, as DeepSpeed's: LinearLayer takes the whole input and returns its slice of the outputs
(all of them with gather_output=True); LinearAllreduce takes the slice of the input that matches
its columns and returns the whole output, summed over the group. Slices are torch.chunk's (sizes
that the group size does not divide give the last ranks less, where DeepSpeed's own layers
spread the remainder otherwise). Without a group, or a group of one, the layer is the Linear.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zero.deepspeed._missing import missing
from zero.deepspeed.module_inject._absent import unavailable

# DeepSpeed names of this module with no counterpart here (see _absent.REASON)
_KNOWN = frozenset({
    "AUTOTP_MODE", "AsyncColumnParallel", "AutoTPMeta", "ColumnParallel", "Conv_LinearALlreduce", "EmbeddingLayer",
    "FusedModuleWrapper", "GateUpPack_LinearLayer", "GatherFromTensorParallelRegion", "GatherReplacedLayerParams",
    "HiddenParallelEmbedding", "LinearAllreduceWithReplicatedInput", "LmHeadLinearAllreduce", "Normalize",
    "OPTEmbedding", "RMSNormalize", "RowParallel", "ScatterToTensorParallelRegion", "SubParamColumnParallel",
    "SubParamLinearAllreduce", "SubParamLinearLayer", "TensorParallelConv2d", "TensorParallelIcShardConv2d",
    "TensorParallelOcShardConv2d", "TensorParallel_Layer", "VocabParallelEmbedding", "VocabParallelLinear",
    "Yuan_LinearAllreduce", "Yuan_LinearLayer", "add_bias", "collect_autotp_universal_checkpoint_info",
    "configure_tensor_parallel_runtime", "conv_LinearLayer", "fused_LinearLayer", "fused_qkv_subparam_sizes",
    "get_auto_tp_mode", "get_shard_size_list", "is_autotp_training_mode", "prepare_tp_fused_qkvw",
    "set_autotp_mode", "set_fused_qkv_shard_state", "shard_value_with_share_qk",
})


class _SlicedLinear(nn.Module):
    """What the two layers share: the group, this rank's place in it and the mesh of the group."""

    def __init__(self, module: nn.Linear, mp_group: Any, **kwargs: Any) -> None:
        super().__init__()
        if not isinstance(getattr(module, "weight", None), torch.Tensor) or module.weight.dim() != 2:
            raise TypeError(f"{type(self).__name__} slices a Linear layer (a module with a 2-D weight), "
                            f"got {type(module).__name__}")
        self.mp_group = mp_group
        parallel = mp_group is not None and dist.get_world_size(mp_group) > 1
        self.tp_world_size = dist.get_world_size(mp_group) if parallel else 1
        self.tp_index = dist.get_rank(mp_group) if parallel else 0
        self.world_size, self.rank = self.tp_world_size, self.tp_index  # DeepSpeed's older names
        self.name = kwargs.get("name")
        self.support_training = True
        self._mesh = None
        if parallel:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(mp_group, module.weight.device.type)

    def _param(self, t: torch.Tensor | None, placement: Any, local: bool = False) -> nn.Parameter | None:
        """`t` as this rank's parameter: the slice `placement` makes of it (or `t` itself as the
        slice when `local`), a DTensor on the group's mesh; `t` unchanged without a group."""
        if t is None:
            return None
        requires_grad = t.requires_grad
        if self._mesh is not None:
            from torch.distributed.tensor import DTensor, distribute_tensor

            t = (DTensor.from_local(t.detach(), self._mesh, [placement], run_check=False) if local
                 else distribute_tensor(t.detach(), self._mesh, [placement]))
        return nn.Parameter(t.detach() if self._mesh is None else t, requires_grad=requires_grad)

    def _as_dtensor(self, x: torch.Tensor, placement: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(x, self._mesh, [placement], run_check=False)


class LinearLayer(_SlicedLinear):
    """A column-parallel Linear: this rank computes its share of the output features.

    Args:
        module: the whole nn.Linear (alike on every rank of the group).
        mp_group: the tensor-parallel process group (None: no slicing).
        skip_partition: the module's weight and bias are already this rank's slices.
        gather_output: return every output feature (gathered over the group) instead of this
            rank's share.
        **kwargs: `name` (the layer's name, kept as `.name`).

    See [Note: DeepSpeed's TP layers on DTensor].
    """

    def __init__(self, module: nn.Linear, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, **kwargs: Any) -> None:
        super().__init__(module, mp_group, **kwargs)
        from torch.distributed.tensor import Shard

        self.gather_output = gather_output
        self.weight = self._param(module.weight, Shard(0), local=skip_partition)
        self.bias = self._param(module.bias, Shard(0), local=skip_partition)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        if self._mesh is None:
            return F.linear(input, self.weight, self.bias)
        from torch.distributed.tensor import Replicate

        out = F.linear(self._as_dtensor(input, Replicate()), self.weight, self.bias)
        if self.gather_output:
            out = out.redistribute(self._mesh, [Replicate()])
        return out.to_local()


class LinearAllreduce(_SlicedLinear):
    """A row-parallel Linear: this rank multiplies its share of the input features, and the partial
    outputs are summed over the group (the bias added once).

    Args:
        module: the whole nn.Linear (alike on every rank of the group).
        mp_group: the tensor-parallel process group (None: no slicing).
        **kwargs: `name` (the layer's name, kept as `.name`).

    See [Note: DeepSpeed's TP layers on DTensor].
    """

    def __init__(self, module: nn.Linear, mp_group: Any, **kwargs: Any) -> None:
        super().__init__(module, mp_group, **kwargs)
        from torch.distributed.tensor import Replicate, Shard

        self.weight = self._param(module.weight, Shard(1))
        self.bias = self._param(module.bias, Replicate())

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        if self._mesh is None:
            return F.linear(input, self.weight, self.bias)
        from torch.distributed.tensor import Replicate, Shard

        out = F.linear(self._as_dtensor(input, Shard(input.dim() - 1)), self.weight, self.bias)
        return out.redistribute(self._mesh, [Replicate()]).to_local()


def __getattr__(name: str):
    if name in _KNOWN:
        return unavailable(__name__, name)
    return missing(__name__, name)

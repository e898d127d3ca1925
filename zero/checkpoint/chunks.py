"""Chunked tensors through torch.distributed.checkpoint (DCP), stored as safetensors only.

[Note: checkpoint chunks]
Every saved tensor is a global 1-D tensor of its parameter's full length: `model/<name>` (the
parameter in the training dtype), `master/<name>`, `exp_avg/<name>` and `exp_avg_sq/<name>` (in
the optimizer's state format: fp32 or bf16; 8-bit moments as bf16 tensors of their exact values,
see [Note: 8-bit moments in checkpoints] in zero/stages/storage.py).
Each rank says which pieces of them it holds (`Chunk`: a name, an offset into the global tensor, and
a local 1-D view), whatever the stage: a stage-1/2 bucket slice, a stage-3 shard, or (stage 0,
frozen parameters, rank 0 only) the whole tensor. DCP's planner does the rest: on save it records
every chunk's offset, on load it finds, for every chunk a rank wants now, the overlapping pieces of
the chunks that were saved, whatever world size and stage saved them. So a checkpoint loads at any
world size and stage with no conversion step.

Storage is DCP's HuggingFace writer and reader in distributed mode: each rank writes one safetensors
file whose header records its chunks' offsets, and no metadata pickle is written or read (DCP's
default `.metadata` is a pickle). The planners here only list chunks; DCP plans, writes, reads and
reshards.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass
class Chunk:
    """A piece of a global 1-D tensor that this rank holds.

    Args:
        name: the global tensor's key (`master/blocks.0.fc.weight`).
        offset: where the piece starts in the global tensor.
        tensor: the piece, a 1-D view (written from on save, into on load).
        numel: the global tensor's length.
    """

    name: str
    offset: int
    tensor: torch.Tensor
    numel: int


class _SaveChunks(DefaultSavePlanner):
    def __init__(self, chunks: list[Chunk]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)
        self.chunks = {MetadataIndex(c.name, torch.Size([c.offset])): c for c in chunks if c.tensor.numel()}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([c.offset]), sizes=torch.Size([c.tensor.numel()])),
            properties=TensorProperties(dtype=c.tensor.dtype), size=torch.Size([c.numel])))
            for index, c in self.chunks.items()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.chunks[dataclasses.replace(write_item.index, index=None)].tensor


class _LoadChunks(DefaultLoadPlanner):
    def __init__(self, chunks: list[Chunk]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {(c.name, c.offset): c for c in chunks if c.tensor.numel()}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items = []
        for (name, offset), c in self.chunks.items():
            want = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([c.tensor.numel()]))
            items += create_read_items_for_chunk_list(name, saved[name], [want])
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        c = self.chunks[(read_item.dest_index.fqn, read_item.dest_index.offset[0])]
        return c.tensor.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # the reader copied into the view `resolve_tensor` gave


def save_chunks(chunks: list[Chunk], path: str, process_group=None) -> None:
    """Write this rank's chunks into `path` (every rank calls it; one safetensors file per rank)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # a world of one: DCP says it saves in one process, which is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({}, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True), planner=_SaveChunks(chunks),
                 process_group=process_group, no_dist=not dist.is_initialized())


def saved_tensors(path: str) -> dict[str, int]:
    """The global tensors a checkpoint directory holds: name -> length (safetensors headers only)."""
    md = HuggingFaceStorageReader(path).read_metadata()
    return {name: int(m.size[0]) for name, m in md.state_dict_metadata.items()}


def load_chunks(chunks: list[Chunk], path: str, process_group=None) -> None:
    """Fill every chunk from the checkpoint in `path`, whatever layout saved it (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=HuggingFaceStorageReader(path), planner=_LoadChunks(chunks),
                 process_group=process_group, no_dist=not dist.is_initialized())

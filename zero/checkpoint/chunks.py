"""Chunked tensors through torch.distributed.checkpoint (DCP), stored as safetensors only.

[Note: checkpoint chunks]
Every saved tensor is a global 1-D tensor of its parameter's full length: `model/<name>` (the
parameter in the training dtype), `master/<name>`, and `<state>/<name>` for each state the
parameter's update rule declares (see [Note: declared state] in zero/optim/rules.py): Adam's
`exp_avg/<name>` and `exp_avg_sq/<name>` (in the optimizer's state format: fp32 or bf16; 8-bit
moments as bf16 tensors of their exact values, see [Note: 8-bit moments in checkpoints] in
zero/offload/store.py), Muon's or SGD's `momentum_buffer/<name>` (fp32), Adagrad's `sum/<name>`,
and so on. A per-slot scalar (a torch optimizer's `step`) is a global tensor of one element.
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
import itertools
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


def local_coverage(path: str) -> dict[str, list[tuple[int, int]]]:
    """The pieces of each global tensor that the files in `path` visible to this rank hold:
    name -> sorted [start, end) spans (safetensors headers only)."""
    md = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    return {name: sorted((int(c.offsets[0]), int(c.offsets[0]) + int(c.sizes[0])) for c in m.chunks)
            for name, m in md.items()}


def _missing(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that the sorted `spans` do not cover."""
    out, at = [], lo
    for a, b in spans:
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
        if at >= hi:
            break
    return out + ([(at, hi)] if at < hi else [])


def _pieces(coverage: list[dict[str, list[tuple[int, int]]]], wanted: list[tuple[str, int, int, str]]):
    """Who reads what of the `wanted` spans (every rank's, merged): (name, start, end, dtype,
    serving rank) for each piece, a piece read by the lowest rank whose files hold it."""
    merged: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for name, lo, hi, dtype in sorted(set(wanted)):
        spans = merged.setdefault((name, dtype), [])
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    pieces, unheld = [], []
    for (name, dtype), spans in sorted(merged.items()):
        for lo, hi in spans:
            left = [(lo, hi)]
            for rank, held in enumerate(coverage):
                for a, b in held.get(name, []):
                    still = []
                    for x, y in left:
                        s, e = max(x, a), min(y, b)
                        if s >= e:
                            still.append((x, y))
                            continue
                        pieces.append((name, s, e, dtype, rank))
                        still += [p for p in ((x, s), (e, y)) if p[0] < p[1]]
                    left = still
            unheld += [f"{name}[{x}:{y}]" for x, y in left]
    if unheld:
        raise FileNotFoundError(f"no rank's files hold {len(unheld)} piece(s) of the checkpoint: {unheld[:6]}"
                                f"{' ...' if len(unheld) > 6 else ''}")
    return sorted(pieces, key=lambda p: (p[4], p[3], p[0], p[1]))


def load_chunks_across_nodes(chunks: list[Chunk], path: str, io) -> None:
    """`load_chunks` where each rank sees only its own node's files (node-local storage, see [Note:
    node-local storage] in zero/checkpoint/nodes.py): each rank reads what its node holds; every
    other piece is read by a rank whose node holds it and broadcast, one flat buffer per rank and
    dtype. Every rank of the io group calls it."""
    from zero.checkpoint.nodes import gather_objects

    group = io.group if io.distributed else None
    mine = local_coverage(path)
    def end(c: Chunk) -> int:  # a staging span may reach past its tensor's end: that part is never read
        return min(c.offset + c.tensor.numel(), c.numel)

    here, away = [], []
    for c in (c for c in chunks if c.offset < end(c)):
        (away if _missing(mine.get(c.name, []), c.offset, end(c)) else here).append(c)
    load_chunks(here, path, process_group=group)
    coverage = gather_objects(io, mine)
    wanted = [w for ws in gather_objects(io, [(c.name, c.offset, end(c), str(c.tensor.dtype)) for c in away])
              for w in ws]
    pieces = _pieces(coverage, wanted)
    def dtype(name: str) -> torch.dtype:  # "torch.float32" -> torch.float32
        return getattr(torch, name.removeprefix("torch."))

    serve = [Chunk(n, lo, torch.empty(hi - lo, dtype=dtype(d)), hi) for n, lo, hi, d, r in pieces if r == io.rank]
    load_chunks(serve, path, process_group=group)
    served = {(c.name, c.offset): c.tensor for c in serve}
    for (rank, d), group_pieces in itertools.groupby(pieces, key=lambda p: (p[4], p[3])):
        group_pieces = list(group_pieces)
        flat = (torch.cat([served[(n, lo)] for n, lo, *_ in group_pieces]) if rank == io.rank else
                torch.empty(sum(hi - lo for _, lo, hi, *_ in group_pieces), dtype=dtype(d)))
        io.broadcast(flat, src=rank)
        at = 0
        for n, lo, hi, *_ in group_pieces:
            for c in away:
                s, e = max(lo, c.offset), min(hi, c.offset + c.tensor.numel())
                if c.name == n and s < e and str(c.tensor.dtype) == d:
                    c.tensor[s - c.offset:e - c.offset].copy_(flat[at + s - lo:at + e - lo])
            at += hi - lo

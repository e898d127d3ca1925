"""Node-local checkpoint storage: `checkpoint.use_node_local_storage` (DeepSpeed's key).

[Note: node-local storage]
On a cluster without a shared filesystem, `save_dir` names a directory on each node's own disk.
Every rank writes its files as always (its tensor file, its RNG state, its own optimizer state),
so they land on its node; the lowest rank of each node (its leader) makes the tag's directory there,
and once every rank has written, publishes it there: the state file (the same JSON on every node),
the rename into place and `latest`. The state file lists every file of the checkpoint with its
crc32 and, under "storages", which ranks wrote into which storage. Leaders find out whether their
storage is shared (each leaves a marker `.node<k>` in the temporary directory and looks for the
others'), so one leader per storage publishes and a node-local setting on shared storage still
works.

Loading on the same arrangement of ranks over nodes, each leader checks the files its storage
should hold against the state file; a node whose files are missing (or damaged) makes every rank
raise one error naming the node, its ranks and the files, before anything is read or changed. Each
rank reads its own pieces from its node's files; the values written once, by rank 0 (buffers,
frozen and stage-0 parameters), are read on rank 0 and broadcast to the ranks of other nodes. A
checkpoint whose node directories are copied into one directory every rank reads is an ordinary
checkpoint again (every file present everywhere), and loads at any world size and stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from zero.parallel.nodes import node_name


def gather_objects(io, value) -> list:
    """`value` of every rank of the io group, in rank order."""
    if io.world_size == 1:
        return [value]
    out = [None] * io.world_size
    dist.all_gather_object(out, value, group=io.group)
    return out


@dataclass(frozen=True)
class Nodes:
    """Which ranks (of the io group) share a node, nodes in the order of their lowest rank."""

    names: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, io) -> Nodes:
        """Collective: every rank of `io` says its node."""
        by_node: dict[str, list[int]] = {}
        for rank, name in enumerate(gather_objects(io, node_name())):
            by_node.setdefault(name, []).append(rank)
        return cls(tuple(by_node), tuple(tuple(r) for r in by_node.values()))

    def index_of(self, rank: int) -> int:
        return next(k for k, ranks in enumerate(self.ranks) if rank in ranks)

    def is_leader(self, rank: int) -> bool:
        return self.ranks[self.index_of(rank)][0] == rank

    def describe(self, k: int) -> str:
        return f"node {self.names[k]} (ranks {', '.join(map(str, self.ranks[k]))})"


def mark(tmp: Path, k: int) -> None:
    (tmp / f".node{k}").touch()


def publishes(tmp: Path, k: int) -> bool:
    """Whether node k's leader publishes the tag in its storage: the lowest node that sees its marker."""
    seen = sorted(int(p.name[len(".node"):]) for p in tmp.glob(".node*"))
    return not seen or seen[0] == k


def unmark(tmp: Path) -> None:
    for p in tmp.glob(".node*"):
        p.unlink(missing_ok=True)


def storage_ranks(tmp: Path, nodes: Nodes) -> list[int]:
    """The ranks whose files this storage holds (those of every node whose marker it shows)."""
    seen = sorted(int(p.name[len(".node"):]) for p in tmp.glob(".node*"))
    return sorted(r for k in seen for r in nodes.ranks[k])


def expected_here(state: dict, ranks: tuple[int, ...]) -> tuple[list[str], list[int]] | None:
    """The files a node holding `ranks` should find in its storage, and the ranks that wrote them:
    those of the saved storages holding exactly these ranks. None where the checkpoint's nodes
    were arranged otherwise (then every file is needed here)."""
    mine = [s for s in state["storages"] if set(s["ranks"]) & set(ranks)]
    if sorted(r for s in mine for r in s["ranks"]) != sorted(ranks):
        return None
    return sorted(f for s in mine for f in s["files"]), sorted(ranks)

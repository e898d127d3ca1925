"""Periodic checkpoints and automatic resume: the config's `checkpoint.dir`, `save_interval`,
`keep_last` and `auto_resume` (docs/checkpoint.md, "When a rank dies").

[Note: resuming after a crash]
A job that loses a process is restarted by its launcher (`torchrun --max-restarts N`) from the
start of the script. With `auto_resume`, `zero.initialize` then looks in `checkpoint.dir` for the
newest checkpoint that is complete: its state file reads as JSON of zero's format and every tensor
file it lists is there with the crc32 it recorded (`verify_files`), so a tag torn by the crash (a
truncated file, a missing or half-written state file, a file it does not list) is skipped for the
one before it, with a log line naming the tag and why. Rank 0 decides and every rank loads that
tag, with the data loader's position and the RNG states, so the restarted job continues the sample
sequence the dead one was on and loses only the steps since that checkpoint. Saves are the engine's
own (`save_checkpoint`, atomic by renames; asynchronous with `async_save`); after each, rank 0
removes the tags beyond the newest `keep_last` (one more while an asynchronous save is still being
written, so that `keep_last` complete ones always remain).
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from zero.checkpoint.nodes import Nodes, gather_objects
from zero.checkpoint.placement import Placement
from zero.checkpoint.tags import (
    NODE_LOCAL_HINT,
    STATE_FILE,
    CheckpointError,
    node_check,
    read_state,
    remember_verified,
    verify_files,
)
from zero.components import Component

log = logging.getLogger("zero")
_TAG = re.compile(r"global_step(\d+)")


def _tags(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the periodic tags under `root`, newest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _TAG.fullmatch(p.name))]
    return sorted(found, reverse=True)


def newest_complete(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete periodic tag under `root` (None: none) and why each newer one was skipped."""
    root, skipped = Path(root), []
    if not root.is_dir():
        return None, skipped
    for _, path in _tags(root):
        try:
            if not (path / STATE_FILE).is_file():
                raise CheckpointError(f"{path / STATE_FILE} is missing (the save did not finish)")
            verify_files(path, read_state(path))
        except (CheckpointError, OSError) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        remember_verified(path)  # the load that follows need not read every file again
        return path, skipped
    return None, skipped


def auto_resume(engine, root: str) -> str | None:
    """Load the newest complete checkpoint under `root` on every rank (rank 0 picks it; with
    node-local storage the newest complete on every node); returns its path, or None for a fresh
    start. Collective."""
    if engine.config.checkpoint.use_node_local_storage:
        tag = _newest_on_every_node(Placement(engine).io, Path(root))
    else:
        choice = [None]
        if engine.dp.rank == 0:
            path, skipped = newest_complete(root)
            for reason in skipped:
                log.warning("zero: auto_resume skips %s", reason)
            choice = [path.name if path is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0)
        tag = choice[0]
    if tag is None:
        if engine.dp.rank == 0:
            log.info("zero: auto_resume found no complete checkpoint in %s; starting fresh", root)
        return None
    path, _ = engine.load_checkpoint(root, tag=tag)
    if engine.dp.rank == 0:
        log.warning("zero: auto_resume resumed from %s (global step %d)", path, engine.global_steps)
    return str(path)


def _newest_on_every_node(io, root: Path) -> str | None:
    """The newest periodic tag complete on every node's storage (see [Note: node-local storage]):
    the tags every node has, newest first, each checked by every node's leader until one passes.
    Raises if nodes hold checkpoints but none that all of them hold complete: a node whose files
    are gone must not make the job start again from nothing."""
    nodes = Nodes.of(io)
    k, leader = nodes.index_of(io.rank), nodes.is_leader(io.rank)
    have = ([p.name for _, p in _tags(root) if (p / STATE_FILE).is_file()] if root.is_dir() else []) if leader else None
    by_node = {nodes.index_of(r): tags for r, tags in enumerate(gather_objects(io, have)) if tags is not None}
    common = [t for t in by_node[0] if all(t in tags for tags in by_node.values())]
    for tag in by_node[0]:
        if tag not in common and io.rank == 0:
            lacking = [nodes.describe(n) for n, tags in by_node.items() if tag not in tags]
            log.warning("zero: auto_resume skips %s: not on %s", tag, ", ".join(lacking))
    for tag in common:
        problem = None
        if leader:
            try:
                state = read_state(root / tag)
                if "storages" in state:
                    problem, whole = node_check(root / tag, state, nodes, io.rank)
                else:
                    verify_files(root / tag, state)
                    whole = True
                if problem is None:
                    remember_verified(root / tag, whole)
            except (CheckpointError, OSError) as exc:
                problem = f"{nodes.describe(k)}: {exc}"
        problems = [p for p in gather_objects(io, problem) if p]
        if not problems:
            return tag
        if io.rank == 0:
            log.warning("zero: auto_resume skips %s: %s", tag, "; ".join(problems))
    if any(by_node.values()):
        held = "; ".join(f"{nodes.describe(n)} holds {tags or 'none'}" for n, tags in sorted(by_node.items()))
        raise CheckpointError(f"auto_resume: no checkpoint in {root} is complete on every node ({held}). {NODE_LOCAL_HINT} "
                              f"Or point checkpoint.dir somewhere new to start afresh.")
    return None


class PeriodicSaves(Component):
    """Saves to `dir` after every `save_interval` optimizer steps and keeps the newest `keep_last`
    (the engine's "periodic_saves" component; see [Note: engine components])."""

    name = "periodic_saves"

    def __init__(self, directory: str, interval: int | None, keep_last: int | None):
        self.root, self.interval, self.keep_last = Path(directory), interval, keep_last
        self._nodes = None  # with node-local storage: which ranks share a node (asked at the first prune)

    def after_step(self, engine, applied: bool = True) -> None:
        if not self.interval or engine.global_steps % self.interval:
            return
        engine.save_checkpoint(self.root)  # waits for the previous (asynchronous) save first
        if self.keep_last:
            self._prune(engine, self.keep_last if not engine.config.checkpoint.async_save else self.keep_last + 1)

    def _prune(self, engine, keep: int) -> None:
        """Remove the periodic tags beyond the newest `keep` (rank 0, or each node's leader with
        node-local storage; the newest may still be being written asynchronously, so with async_save
        one more is kept until the next save)."""
        if engine.config.checkpoint.use_node_local_storage:
            world = Placement(engine).world  # not the io group: a background save may be using it now
            if self._nodes is None:
                self._nodes = Nodes.of(world)
            first = self._nodes.is_leader(world.rank)
        else:
            first = engine.dp.rank == 0
        if not first or not self.root.is_dir():
            return
        for _, path in _tags(self.root)[keep:]:
            shutil.rmtree(path, ignore_errors=True)

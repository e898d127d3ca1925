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

from zero.checkpoint.training import STATE_FILE, CheckpointError, read_state, verify_files

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
        except CheckpointError as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        return path, skipped
    return None, skipped


def auto_resume(engine, root: str) -> str | None:
    """Load the newest complete checkpoint under `root` on every rank (rank 0 picks it); returns its
    path, or None for a fresh start. Collective."""
    choice = [None]
    if engine.comm.rank == 0:
        path, skipped = newest_complete(root)
        for reason in skipped:
            log.warning("zero: auto_resume skips %s", reason)
        choice = [path.name if path is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    tag = choice[0]
    if tag is None:
        if engine.comm.rank == 0:
            log.info("zero: auto_resume found no complete checkpoint in %s; starting fresh", root)
        return None
    path, _ = engine.load_checkpoint(root, tag=tag)
    if engine.comm.rank == 0:
        log.warning("zero: auto_resume resumed from %s (global step %d)", path, engine.global_steps)
    return str(path)


class PeriodicSaves:
    """Saves to `dir` after every `save_interval` optimizer steps and keeps the newest `keep_last`."""

    def __init__(self, directory: str, interval: int | None, keep_last: int | None):
        self.root, self.interval, self.keep_last = Path(directory), interval, keep_last

    def after_step(self, engine) -> None:
        if not self.interval or engine.global_steps % self.interval:
            return
        engine.save_checkpoint(self.root)  # waits for the previous (asynchronous) save first
        if self.keep_last:
            self._prune(engine, self.keep_last if not engine.config.checkpoint.async_save else self.keep_last + 1)

    def _prune(self, engine, keep: int) -> None:
        """Remove the periodic tags beyond the newest `keep` (rank 0; the newest may still be being
        written asynchronously, so with async_save one more is kept until the next save)."""
        if engine.comm.rank != 0 or not self.root.is_dir():
            return
        for _, path in _tags(self.root)[keep:]:
            shutil.rmtree(path, ignore_errors=True)

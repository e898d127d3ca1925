"""Checkpoints: the consolidated 16-bit model (stage 3 gathers it one parameter at a time).

[Note: atomic checkpoint writes]
Files are written to a temporary name in the same directory and moved into place, so a crash
never leaves a half-written checkpoint under the final name, and a failed write (disk full, a
file-size limit) leaves the previous checkpoint as it was. The temporary name says who writes it,
`.<name>.<host>.<pid>.<random>.tmp`, so a later save to the same path can tell an orphan (its
writer was killed before the rename) from a file that a live writer is still filling: it removes
temporary files of its own target whose writer process on this host is gone, and those of other
hosts (or of the older `.<name>.<random>.tmp` form) untouched for STALE_TEMP_AGE_S.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path, PurePath

import torch
import torch.nn as nn

from zero.parallel.comm import Comm
from zero.parallel.tags import Tag

# An orphaned temporary file whose writer cannot be checked (another host, or no pid in its name)
# is removed once it has not been written to for this long. See [Note: atomic checkpoint writes].
STALE_TEMP_AGE_S = 3600.0


class CheckpointWriteError(OSError, RuntimeError):
    """Writing a checkpoint failed; the message names the file and the previous file is intact.

    An OSError (the usual cause is the disk or a file-size limit) that is also a RuntimeError,
    which is what torch.save raised for the same failure before it was wrapped."""


def checked_save_path(save_dir: str | os.PathLike, save_filename: str | os.PathLike) -> Path:
    """`save_dir/save_filename`, refusing a file name that would write outside `save_dir`.

    Args:
        save_dir: the directory to save into.
        save_filename: a file name, or a relative path below `save_dir` ("step100/model.bin").

    Raises:
        ValueError: `save_filename` is absolute, contains a `..` component, is empty or names a
            directory. Call this before anything collective or written, on every rank.
    """
    name = os.fspath(save_filename)
    parts = PurePath(name).parts
    if not name or name.endswith(("/", os.sep)) or PurePath(name).is_absolute() or ".." in parts \
            or PurePath(name).name in ("", "."):
        raise ValueError(
            f"save_filename must be a file name or a relative path inside save_dir (not absolute, no '..'), got {name!r} "
            f"(save_dir is {os.fspath(save_dir)!r}); put the directory in save_dir instead"
        )
    return Path(save_dir) / name


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove_stale_temps(path: Path) -> None:
    """Remove temporary files of `path` left by writers that died before their rename."""
    prefix, host = f".{path.name}.", _host_tag()
    ours = re.compile(r"(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[^.]+")
    legacy = re.compile(r"[^.]+")  # `.<name>.<random>.tmp`, written before the pid was recorded
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
            continue
        middle = entry.name[len(prefix):-len(".tmp")]
        found = ours.fullmatch(middle)
        try:
            if found is not None and found["host"] == host:
                stale = not _pid_alive(int(found["pid"]))
            elif found is not None or legacy.fullmatch(middle):
                stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_AGE_S
            else:
                continue  # another target's temporary file (e.g. of `<name>.1`)
            if stale and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
        except OSError:  # gone already, or not ours to remove: the save goes on
            continue


def _os_error_behind(exc: BaseException) -> OSError | None:
    """The OSError that `exc` is, or that it was raised while handling: torch.save reports a failed
    write as "unexpected pos" from its zip writer, raised while the OSError (EFBIG, ENOSPC) unwinds."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _write_failed(path: Path, tmp: str, exc: BaseException) -> CheckpointWriteError:
    try:
        written = f"{os.path.getsize(tmp):,} bytes"
    except OSError:
        written = "an unknown number of bytes"
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    previous = f"The previous {path} is intact" if path.exists() else f"Nothing was written to {path}"
    os_error = _os_error_behind(exc)
    if os_error is not None:
        cause, hint = str(os_error), ""
    else:
        cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        cut_short = any(mark in str(exc) for mark in ("inline_container", "PytorchStreamWriter"))  # torch's zip writer
        hint = " A write cut short usually means the disk is full or a file-size limit (ulimit -f) was hit." if cut_short else ""
    err = CheckpointWriteError(
        f"could not write checkpoint {path}: {cause} (after {written} of the temporary file; {free} "
        f"on {path.parent}).{hint} {previous}."
    )
    err.errno = os_error.errno if os_error is not None else None
    return err


def _write_state(obj, fh, path: Path) -> None:
    """safetensors for `*.safetensors` (tied tensors once, as HuggingFace saves them), else torch.save."""
    if path.suffix != ".safetensors":
        torch.save(obj, fh)
        return
    from safetensors.torch import save

    seen: set[int] = set()
    unique = {}
    for name, t in obj.items():
        if id(t) not in seen:
            seen.add(id(t))
            unique[name] = t.contiguous()
    fh.write(save(unique, metadata={"format": "pt"}))


def atomic_save(obj, path: str | os.PathLike) -> None:
    """Write `obj` (a state dict) to a temporary file beside `path`, then rename it into place:
    safetensors when `path` ends in `.safetensors`, torch.save otherwise.

    See [Note: atomic checkpoint writes].

    Raises:
        CheckpointWriteError: the write failed (names `path`; the previous file is intact).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_host_tag()}.{os.getpid()}.", suffix=".tmp")
    try:
        try:
            with os.fdopen(fd, "wb") as fh:
                _write_state(obj, fh, path)
                fh.flush()
                os.fsync(fh.fileno())
        except (OSError, RuntimeError) as exc:
            raise _write_failed(path, tmp, exc) from exc
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@torch.no_grad()
def consolidated_state_dict(module: nn.Module, comm: Comm, exclude_frozen_parameters: bool = False) -> dict | None:
    """The module's full state dict on rank 0 (None on other ranks); every rank must call it.

    Sharded parameters are gathered one at a time, so no rank ever holds more than one full
    parameter beyond rank 0's output. Tied parameters appear under every name, as in
    `module.state_dict()`, and are gathered once.
    """
    from zero.init import GatheredParameters

    comm.agree(Tag.SAVE_16BIT_MODEL, 0, 0, "saving the 16-bit model")  # every rank, or none (see [Note: rank-agreement tags])
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and exclude_frozen_parameters and not value.requires_grad:
            continue
        if id(value) in done:
            if comm.rank == 0:
                out[name] = done[id(value)]
            continue
        if getattr(value, "_zero", None) is not None:
            with GatheredParameters([value]):
                copy = value.detach().cpu().clone() if comm.rank == 0 else None
        else:
            copy = value.detach().cpu().clone() if comm.rank == 0 else None
        done[id(value)] = copy
        if comm.rank == 0:
            out[name] = copy
    return out if comm.rank == 0 else None

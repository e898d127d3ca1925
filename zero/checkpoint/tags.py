"""Finding, reading and verifying a saved tag, before anything is loaded from it (see [Note:
checkpoint layout] in zero/checkpoint/training.py): the tag `latest` names (or the one a save that
died between its renames left as `.<tag>.old`), its state file, its files against their checksums,
and the same answer on every rank (each rank looks in its own directory: with node-local storage,
its node's disk).
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from zero.checkpoint.nodes import Nodes, expected_here, gather_objects
from zero.errors import ZeroRuntimeError

FORMAT = "zero-checkpoint"
VERSION = 2  # 2: "progress" and "optimizer" are engine.progress's and engine.optimizer's state_dict() (1: their
# fields at the top level, still read)
STATE_FILE = "zero_checkpoint.json"


class CheckpointError(ZeroRuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the problem."""


_OURS = {STATE_FILE}


def check_tag_dir(path: Path) -> None:
    """Refuse a tag directory holding files zero did not write (a pickle could hide there)."""
    for p in sorted(path.rglob("*")):
        if p.is_dir():
            continue
        rel = p.relative_to(path)
        ok = rel.name in _OURS or (rel.parts[0] in ("tensors", "rng", "optimizer") and rel.suffix == ".safetensors")
        if not ok:
            raise CheckpointError(f"{p}: not a file of a zero checkpoint (zero checkpoints hold only JSON and "
                                  f"safetensors files; a pickle is never loaded). Remove it, or check that "
                                  f"{path} is a zero checkpoint.")


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> Path:
    """The tag's directory. A tag being replaced when a save died between its two renames is found
    under its previous name (`.<tag>.old`), complete."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise CheckpointError(f"{latest} does not exist: pass tag= or save with save_latest=True")
        tag = latest.read_text().strip()
    path = root / tag
    if not (path / STATE_FILE).is_file() and (root / f".{tag}.old" / STATE_FILE).is_file():
        return root / f".{tag}.old"
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"checkpoint tag {tag!r} not found: {path / STATE_FILE} does not exist")
    return path


def read_state(path: Path) -> dict:
    check_tag_dir(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / STATE_FILE} is not readable JSON: {exc}") from None
    if state.get("format") != FORMAT or state.get("version") not in (1, VERSION):
        raise CheckpointError(f"{path / STATE_FILE}: unknown format {state.get('format')!r} version "
                              f"{state.get('version')!r} (this zero reads {FORMAT!r} versions 1 and {VERSION})")
    if state["version"] == 1:  # the engine's and the optimizer's values were fields of their own
        state["progress"] = {k: state.pop(k) for k in ("global_steps", "skipped_steps", "global_samples")}
        state["optimizer"] = {"step": state.pop("optimizer_step"), "param_groups": state.pop("param_groups"),
                              "loss_scaler": state.pop("loss_scaler")}
        state.pop("micro_steps", None)
    return state


def file_checksums(path: Path) -> dict[str, int]:
    """crc32 of every tensor file under the tag, by relative path."""
    out = {}
    for p in sorted(path.rglob("*.safetensors")):
        crc = 0
        with open(p, "rb") as fh:
            while block := fh.read(1 << 24):
                crc = zlib.crc32(block, crc)
        out[str(p.relative_to(path))] = crc
    return out


def verify_files(path: Path, state: dict) -> None:
    """Every tensor file the checkpoint lists is there, whole and unchanged (crc32)."""
    listed = state.get("files", {})
    found = file_checksums(path)
    problems = [f"{name}: missing" for name in listed if name not in found]
    problems += [f"{name}: its contents changed (truncated or corrupt)" for name in listed
                 if name in found and found[name] != listed[name]]
    problems += [f"{name}: not written by this checkpoint" for name in found if name not in listed]
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}")


def resolve_everywhere(io, load_dir, tag: str | None) -> tuple[Path, dict]:
    """The tag's directory and state on every rank, or on every rank the same error: each rank
    looks in its own `load_dir` (with node-local storage, its node's disk), so a node that lacks
    the tag makes every rank raise, naming the node, instead of leaving the others waiting."""
    from zero.checkpoint.nodes import node_name

    path = state = None
    try:
        path = resolve_tag(load_dir, tag)
        state = read_state(path)
        found = (path.name.removeprefix(".").removesuffix(".old") if path.name.endswith(".old") else path.name, None)
    except CheckpointError as exc:
        found = (None, str(exc))
    everyone = gather_objects(io, (*found, node_name()))
    errors: dict[str, list[tuple[int, str]]] = {}
    for rank, (_, error, node) in enumerate(everyone):
        if error:
            errors.setdefault(error, []).append((rank, node))
    if len(errors) == 1 and sum(map(len, errors.values())) == io.world_size:
        raise CheckpointError(next(iter(errors)))
    if errors:
        raise CheckpointError("; ".join(f"{_where(where)}: {error}" for error, where in errors.items()))
    tags = {name for name, _, _ in everyone}
    if len(tags) > 1:
        by_rank = ", ".join(f"rank {r}: {name}" for r, (name, _, _) in enumerate(everyone))
        raise CheckpointError(f"the ranks found different checkpoints in {load_dir} ({by_rank}): a save was cut short "
                              f"on some node's storage; pass tag= to load one every node has")
    return path, state


def _where(ranks: list[tuple[int, str]]) -> str:
    nodes = sorted({node for _, node in ranks})
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r, _ in ranks)} (node {', '.join(nodes)})"


def verify_everywhere(io, path: Path, state: dict) -> bool:
    """Check the tag's files against their checksums before anything is read; every rank raises
    the same error if one is missing or damaged. A checkpoint on shared storage is checked once, by
    rank 0; a node-local one by each node's leader, for the files its storage should hold (see
    [Note: node-local storage]). Returns whether the files are split over the nodes' storages."""
    if "storages" not in state:
        error = None
        if io.rank == 0 and remembered(path) is None:  # one rank reads every file once and checks its checksum
            try:
                verify_files(path, state)
            except (CheckpointError, OSError) as exc:
                error = exc
        found = gather_objects(io, str(error) if error is not None else None)[0]
        if found is not None:  # every rank raises rank 0's error
            raise CheckpointError(found)
        return False
    nodes = Nodes.of(io)
    problem, whole = None, True
    if nodes.is_leader(io.rank):
        whole = remembered(path)
        if whole is None:
            problem, whole = node_check(path, state, nodes, io.rank)
    everyone = gather_objects(io, (problem, whole))
    problems = [p for p, _ in everyone if p]
    if problems:
        raise CheckpointError("; ".join(problems) + f". {NODE_LOCAL_HINT} Nothing was loaded.")
    return not all(w for _, w in everyone)


def node_check(path: Path, state: dict, nodes: Nodes, rank: int) -> tuple[str | None, bool]:
    """On a node's leader, for a checkpoint saved with node-local storage: what is wrong with the
    files this node's storage should hold (None: nothing), and whether it holds every file."""
    k = nodes.index_of(rank)
    try:
        found = file_checksums(path)
    except OSError as exc:  # unreadable: a problem to report on every rank, not an exception on this one
        return f"{nodes.describe(k)}: {path} cannot be read ({exc})", False
    listed = state["files"]
    expected = expected_here(state, nodes.ranks[k])
    want = listed if expected is None else {f: listed[f] for f in expected[0] if f in listed}
    missing = [f for f in want if f not in found]
    damaged = [f for f in want if f in found and found[f] != want[f]] + [f for f in found if f not in listed]
    whole = all(f in found for f in listed)
    if not missing and not damaged:
        return None, whole
    saved_by = [s["ranks"] for s in state["storages"]]
    whose = ("the files its ranks wrote" if expected is not None else
             f"files it needs: the checkpoint was saved by nodes holding ranks {saved_by}, and on another "
             f"arrangement every node needs every file")
    return (f"{nodes.describe(k)}: {path} lacks {whose}"
            + (f"; missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}" if missing else "")
            + (f"; damaged or unknown: {', '.join(damaged[:8])}" if damaged else "")), whole


# Tags whose files this process checked moments ago (auto_resume, before it loads one): path ->
# (the state file's mtime, whether this storage holds every file), so the load does not read them again.
_VERIFIED: dict[str, tuple[int, bool]] = {}


def remember_verified(path: Path, whole: bool = True) -> None:
    _VERIFIED[str(path)] = ((path / STATE_FILE).stat().st_mtime_ns, whole)


def remembered(path: Path) -> bool | None:
    """Whether the storage holds every file of a tag checked by `remember_verified` and unchanged
    since (None: not checked, or changed), once."""
    seen = _VERIFIED.pop(str(path), None)
    try:
        return seen[1] if seen is not None and (path / STATE_FILE).stat().st_mtime_ns == seen[0] else None
    except OSError:
        return None


NODE_LOCAL_HINT = ("With checkpoint.use_node_local_storage each node loads the files its own ranks saved on its own "
                   "disk: put them back on that node, or copy every node's tag directory into one directory that "
                   "every node reads (which then loads at any world size).")

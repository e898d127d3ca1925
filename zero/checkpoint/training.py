"""Training checkpoints: `engine.save_checkpoint` / `engine.load_checkpoint` (DeepSpeed's API).

[Note: checkpoint layout]
    save_dir/
      latest                      the last complete tag (written last, atomically)
      global_step100/             one tag
        zero_checkpoint.json      format, world size, stage, the engine's counters
                                  (engine.progress.state_dict()), the optimizer's step count, param
                                  groups and loss scale (engine.optimizer.state_dict()), the lr
                                  scheduler, every parameter's shape/dtype, client_state,
                                  the state of components that have one
        tensors/*.safetensors     model, master and the optimizer's declared state (Adam:
                                  exp_avg/exp_avg_sq; see [Note: declared state] in
                                  zero/optim/rules.py) as chunked global 1-D tensors, one file
                                  per saving rank (see [Note: checkpoint chunks])
        rng/rank<r>.safetensors   each rank's torch (CPU and CUDA), numpy and python RNG states
        optimizer/rank<r>.safetensors   each rank's own optimizer state, if any (1-bit Adam's error buffers)
Nothing is a pickle: tensors are safetensors, everything else JSON. A tag is written under a
temporary name (`.global_step100.tmp`) and renamed once every rank has finished; `latest` is
replaced after that. A crash at any moment leaves the previous tag and `latest` as they were.
Loading reads only the files above and refuses a tag directory holding anything else that could
be a pickle, without opening it.
"""
from __future__ import annotations

import atexit
import functools
import json
import math
import os
import random
import shutil
import sys
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from zero.checkpoint.chunks import Chunk, load_chunks, load_chunks_across_nodes, save_chunks, saved_tensors
from zero.checkpoint.nodes import Nodes, gather_objects, mark, publishes, storage_ranks, unmark
from zero.checkpoint.placement import Placement, from_whole, layout_of, piece_offset, to_whole
from zero.checkpoint.tags import (
    FORMAT,
    STATE_FILE,
    VERSION,
    CheckpointError,
    file_checksums,
    resolve_everywhere,
    verify_everywhere,
)
from zero.components import ENGINE_PARTS, stateful_parts
from zero.parallel.tags import Tag

MODEL = ("model",)  # the kinds `_chunks` lists: the model's,
OPTIMIZER = ("<every kind but the model's>",)  # or the optimizer's: its master and declared state


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every parameter (tied ones once) and persistent buffer."""
    out = [(n, p, True) for n, p in module.named_parameters()]
    names = set(module.state_dict().keys())
    out += [(n, b, False) for n, b in module.named_buffers() if n in names]
    return out


def _tied_aliases(module: nn.Module) -> dict[str, str]:
    """Other names of tied parameters (as `state_dict()` lists them) -> the name they are saved under."""
    first = {id(p): n for n, p in module.named_parameters()}
    return {n: first[id(v)] for n, v in module.state_dict(keep_vars=True).items()
            if id(v) in first and first[id(v)] != n}


def _shape(t: torch.Tensor) -> list[int]:
    """The global shape (a stage-3 shard's full shape; a tensor slice's whole shape)."""
    z = getattr(t, "_zero", None)
    return list(z.shape if z is not None and not hasattr(t, "_local_tensor") else t.shape)


def _chunks(engine, place: Placement, saving: bool, kinds: tuple[str, ...] | None = None,
            exclude_frozen: bool = False) -> list[Chunk]:
    """This rank's pieces of every global tensor: those it writes (`saving`) or reads into, of
    the `kinds` given (None: all; `OPTIMIZER`: every kind but the model's). The optimizer's kinds
    are its master and the state its rules declare (see [Note: declared state] in
    zero/optim/rules.py); a per-slot scalar is a global tensor of one element."""
    opt = engine.optimizer
    scalars = opt.scalar_state()
    opt.storage.store.begin_views()
    out: list[Chunk] = []
    for name, t, is_param in _named_tensors(engine.module):
        if saving and not place.writes(t):
            continue
        numel = math.prod(_shape(t))
        if is_param:
            if exclude_frozen and not t.requires_grad:
                continue
            pieces = opt.storage.param_chunks(t, saving)
        else:  # buffers are replicated: data rank 0 writes them, every rank reads them
            if not t.is_contiguous():
                raise CheckpointError(f"buffer {name!r} is not contiguous; zero checkpoints store buffers flat")
            pieces = [("model", 0, t.detach().view(-1))] if not saving or engine.dp.rank == 0 else []
        start = piece_offset(t)  # a tensor-parallel slice's place (see [Note: sliced tensors in checkpoints])
        out += [Chunk(f"{kind}/{name}", 0 if kind in scalars else start + off, view, 1 if kind in scalars else numel)
                for kind, off, view in pieces if _wanted(kind, kinds)]
    if saving:  # the chunks hold the decoded copies they write; the storage need not
        opt.storage.store.begin_views()
    return out


def _wanted(kind: str, kinds: tuple[str, ...] | None) -> bool:
    return kind != "model" if kinds is OPTIMIZER else kind in kinds if kinds is not None else True


def _tensor_entries(engine) -> dict[str, dict]:
    """What the checkpoint's JSON says of each of this rank's tensors."""
    trainable = _trainable(engine)
    out = {}
    for n, t, is_param in _named_tensors(engine.module):
        out[n] = {"shape": _shape(t), "dtype": str(t.dtype), "parameter": is_param, "trainable": id(t) in trainable}
        layout = layout_of(t)
        if layout is not None:
            out[n]["layout"] = layout
    return out


def _json_or_error(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} cannot be saved: zero checkpoints hold it as JSON (no pickle), and {exc}. "
                              f"Keep numbers, strings, lists and dicts in it (tensors as lists).") from None
    return value


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, state, py_gauss = random.getstate()
    meta = {"numpy": json.dumps([kind, int(pos), int(has_gauss), float(gauss)]),
            "python": json.dumps([version, list(state), py_gauss])}
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, gauss = json.loads(meta["numpy"])
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, py_gauss = json.loads(meta["python"])
    random.setstate((version, tuple(state), py_gauss))


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(value, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _agreed_tag(place: Placement, tag: str, validation: str) -> str:
    """The tag every rank saves under: rank 0's. Ranks that passed different tags are an error
    under `checkpoint.tag_validation: Fail`, a warning under `Warn` (DeepSpeed's default)."""
    tags = place.gather(tag)
    if len(set(tags)) == 1 or validation == "Ignore":
        return tags[0]
    by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags[:8])) + (" ..." if len(tags) > 8 else "")
    if validation == "Fail":
        raise CheckpointError(f"save_checkpoint: the ranks passed different tags ({by_rank}) and "
                              f"checkpoint.tag_validation is 'Fail'; nothing was saved. Give every rank the same tag.")
    if place.io.rank == 0:
        warnings.warn(f"save_checkpoint: the ranks passed different tags ({by_rank}); saving under rank 0's "
                      f"{tags[0]!r} (checkpoint.tag_validation: 'Warn'; 'Fail' raises instead)", stacklevel=4)
    return tags[0]


_WHAT = {"optimizer": "the optimizer's state (its param groups)", "lr_scheduler": "the lr scheduler's state_dict()"}


def save_checkpoint(engine, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False, async_save: bool = False):
    """See Engine.save_checkpoint. Returns the tag's path, or with `async_save` a PendingSave."""
    place = Placement(engine)
    comm = place.world
    if save_dir is None or not isinstance(save_dir, (str, os.PathLike)):
        raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): expected the checkpoint directory (a str or path)")
    tag = str(tag) if tag is not None else f"global_step{engine.progress.global_steps}"
    if not tag or "/" in tag or tag in (".", "..") or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name")
    root = Path(save_dir)
    parts = {name: _json_or_error(part.state_dict(), _WHAT.get(name, f"the {name}'s state_dict()"))
             if part is not None and hasattr(part, "state_dict") else None for name, part in stateful_parts(engine).items()}
    components = {name: state for name, state in parts.items() if name not in ENGINE_PARTS}
    state = {
        "format": FORMAT, "version": VERSION, "world_size": comm.world_size, "mesh": place.mesh_shape(),
        "stage": engine.config.zero_optimization.stage, "dtype": str(engine.config.dtype),
        # the engine's stateful parts, by name (see [Note: engine components] in zero/components.py)
        **{name: state for name, state in parts.items() if name in ENGINE_PARTS},
        "tensors": _tensor_entries(engine),
        "scalar_state": sorted(engine.optimizer.scalar_state()),
        "client_state": _json_or_error(dict(client_state or {}), "client_state"),
        "tied": _tied_aliases(engine.module),
        **({"components": components} if components else {}),
    }
    node_local = engine.config.checkpoint.use_node_local_storage  # each node's save_dir may differ (its own disk)
    # every rank, or none (see [Note: rank-agreement tags]), then one tag
    comm.agree(Tag.SAVE_CHECKPOINT, 0, 0 if node_local else zlib.crc32(str(root).encode()),
               f"save_checkpoint({str(root)!r})")
    tag = _agreed_tag(place, tag, engine.config.checkpoint.tag_validation)
    final = root / tag
    if place.mesh is not None:  # each pipeline stage knows its own tensors: the JSON lists all of them
        state["tensors"] = {n: e for entries in place.gather(state["tensors"]) for n, e in entries.items()}
        if place.mesh.pp > 1:  # and has param groups of its own
            stage = place.mesh.coordinate("pp")
            state["pipeline_param_groups"] = {str(s): g for s, g in place.gather((stage, state["optimizer"]["param_groups"]))}
    if engine.micro_steps % engine.config.gradient_accumulation_steps:
        warnings.warn(f"save_checkpoint at micro-step {engine.micro_steps}, inside a gradient accumulation window: "
                      f"the gradients of its micro-batches are not saved, and a resumed run starts the window "
                      f"again. Save right after the step that ends a window.", stacklevel=3)
    state_json = json.dumps(state)  # now: the caller may change client_state while an async save writes
    storage = engine.optimizer.storage
    with torch.no_grad():  # the snapshot: host copies, so training may go on while they are written
        chunks = [Chunk(c.name, c.offset, c.tensor.detach() if storage.in_files(c.tensor) else
                        c.tensor.detach().to("cpu", copy=True), c.numel)
                  for c in _chunks(engine, place, saving=True, exclude_frozen=exclude_frozen_parameters)]
    if async_save and any(storage.in_files(c.tensor) for c in chunks):
        # state on NVMe is written from its files' mapping, not copied into host memory it may not
        # fit: the next step must wait for it, so this save finishes before it returns
        if not getattr(engine, "_warned_sync_nvme_save", False):
            engine._warned_sync_nvme_save = True
            warnings.warn("zero: checkpoint.async_save with NVMe offload: the state on NVMe is written from its swap "
                          "files before save_checkpoint returns (a copy in host memory may not fit)", stacklevel=3)
        async_save = False
    rng = _rng_state()
    own = {k: v.detach().to("cpu", copy=True) for k, v in engine.optimizer.rank_state().items()}
    io = place.io
    nodes = Nodes.of(io) if node_local else None
    write = functools.partial(_write, io, root, tag, state_json, chunks, rng, save_latest, own, nodes)
    if not async_save:
        write()
        return str(final)
    pending = PendingSave(write, str(final))
    _PENDING.add(pending)
    return pending


class PendingSave(threading.Thread):
    """A checkpoint being written in the background (`checkpoint.async_save`)."""

    def __init__(self, write, path: str):
        super().__init__(name=f"zero-save {path}", daemon=True)
        self.write, self.path, self.error = write, path, None
        self.start()

    def run(self) -> None:
        try:
            self.write()
        except BaseException as exc:  # noqa: BLE001 - raised by `wait`
            self.error = exc

    def wait(self) -> str:
        """Block until the write is done; raise its error if it failed."""
        self.join()
        _PENDING.discard(self)
        if self.error is not None:
            raise self.error
        return self.path


_PENDING: set[PendingSave] = set()


@atexit.register
def _finish_pending_saves() -> None:
    for pending in list(_PENDING):
        pending.join()
        if pending.error is not None:  # nobody is left to raise it to
            print(f"zero: the background checkpoint save of {pending.path} failed: {pending.error}", file=sys.stderr)


def _write(io, root: Path, tag: str, state_json: str, chunks: list[Chunk], rng, save_latest: bool,
           own: dict[str, torch.Tensor], nodes: Nodes | None) -> None:
    """Write a snapshot under a temporary name, then (rank 0, or each node's leader with node-local
    storage: see [Note: node-local storage]) rename it into place and point `latest` at it; uses
    only the io group, so it may run in a background thread."""
    from safetensors.torch import save_file

    final, tmp = root / tag, root / f".{tag}.tmp"
    leader = io.rank == 0 if nodes is None else nodes.is_leader(io.rank)
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died before
    if nodes is not None:
        io.any_rank(False, f"clearing {tmp}")  # no leader removes what another (on the same storage) makes next
    error = None
    try:
        if leader:
            (tmp / "rng").mkdir(parents=True, exist_ok=True)
            (tmp / "optimizer").mkdir(exist_ok=True)
            if nodes is not None:
                mark(tmp, nodes.index_of(io.rank))
    except OSError as exc:
        error = exc
    if io.any_rank(error is not None):  # the directory exists before anyone writes into it
        raise CheckpointError(f"save_checkpoint: could not create {tmp} ({error or 'on another rank, see its log'})")
    try:
        save_chunks(chunks, str(tmp / "tensors"), process_group=io.group if io.distributed else None)
        tensors, meta = rng
        save_file(tensors, str(tmp / "rng" / f"rank{io.rank}.safetensors"), metadata=meta)
        if own:  # this rank's own optimizer state (see ShardedOptimizer.rank_state)
            save_file(own, str(tmp / "optimizer" / f"rank{io.rank}.safetensors"),
                      metadata={"world_size": str(io.world_size)})
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (DCP raises BaseExceptions)
        error = exc
    if io.any_rank(error is not None, f"writing checkpoint {tmp}"):  # all written, or a rank failed
        raise CheckpointError(f"save_checkpoint: writing {tmp} failed on "
                              f"{'this rank' if error else 'another rank'} ({error or 'see its log'}); the "
                              f"previous checkpoints and 'latest' are unchanged") from None
    publisher, files, mine = leader and (nodes is None or publishes(tmp, nodes.index_of(io.rank))), None, None
    try:
        if publisher:
            files = file_checksums(tmp)
            mine = {"ranks": storage_ranks(tmp, nodes), "files": sorted(files)} if nodes is not None else None
    except OSError as exc:
        error = exc
    storages = None
    if nodes is not None:  # every storage's files, for every storage's state file (every rank, even after an error)
        storages = [s for s in gather_objects(io, (mine, files)) if s[0] is not None]
        files = {name: crc for _, f in storages for name, crc in f.items()}
    try:
        if publisher and error is None:  # the state, with a checksum of every file, then the tag into place, latest
            state = json.loads(state_json)
            state["files"] = files
            if storages is not None:
                state["storages"] = [s for s, _ in storages]
                unmark(tmp)
            _write_json(tmp / STATE_FILE, state)
            old = root / f".{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                final.rename(old)  # a crash here leaves the previous tag as .<tag>.old, which load finds
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
            if save_latest:
                with open(root / ".latest.tmp", "w") as fh:
                    fh.write(tag)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(root / ".latest.tmp", root / "latest")
    except OSError as exc:
        error = exc
    if io.any_rank(error is not None, f"publishing checkpoint {final}"):
        raise CheckpointError(f"save_checkpoint: putting {final} in place failed "
                              f"({error or 'on another rank, see its log'})")


def _read_rank_state(engine, place: Placement, path: Path, state: dict) -> dict[str, torch.Tensor] | None:
    """This rank's saved own optimizer state, if it fits this engine (same world size and shapes);
    else None, with a warning when there was some (see [Note: 1-bit Adam in checkpoints])."""
    from safetensors import safe_open

    mine = engine.optimizer.rank_state()
    if not mine:
        return None
    file = path / "optimizer" / f"rank{place.world.rank}.safetensors"
    own = None
    same = state["world_size"] == place.world.world_size and state.get("mesh") == place.mesh_shape()
    if same and file.is_file():
        with safe_open(str(file), framework="pt") as f:
            own = {k: f.get_tensor(k) for k in f.keys()}
        if own.keys() != mine.keys() or any(own[k].shape != t.shape for k, t in mine.items()):
            own = None
    if own is None and place.world.rank == 0:
        warnings.warn(f"load_checkpoint: {path} was saved at world size {state['world_size']} (now "
                      f"{place.world.world_size}), on another mesh or with other buckets, so the optimizer's per-rank state (1-bit "
                      f"Adam's error buffers) starts from zero; training continues, not bitwise as the saved run "
                      f"would have", stacklevel=3)
    return own


def _saved_param_groups(state: dict, place: Placement) -> list[dict] | None:
    """The saved param groups of this rank's part of the model: the checkpoint's, or with pipeline
    stages its own stage's. None where the checkpoint's pipeline split differs from this run's
    (its stages' groups do not map onto this run's): this run's own groups stay."""
    saved_pp = (state.get("mesh") or {}).get("pp", 1)
    pp = place.mesh.pp if place.mesh is not None else 1
    if saved_pp != pp:
        warnings.warn(f"load_checkpoint: the checkpoint's model was split into {saved_pp} pipeline stage(s), this "
                      f"run's into {pp}: the param groups' hyperparameters stay this run's (the lr scheduler's "
                      f"state is loaded)", stacklevel=4)
        return None
    if pp == 1:
        return state["optimizer"]["param_groups"]
    return state.get("pipeline_param_groups", {}).get(str(place.mesh.coordinate("pp")))


def _trainable(engine) -> set:
    return {id(p) for p in engine.optimizer.params}


def load_checkpoint(engine, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str, dict]:
    """See Engine.load_checkpoint. Everything is read and checked into staging copies first; the
    engine changes only once all of it has arrived."""
    from safetensors import safe_open

    place = Placement(engine)
    io = place.io  # DCP's own collectives go over gloo, whatever the data group is
    path, state = resolve_everywhere(io, load_dir, tag)
    split = verify_everywhere(io, path, state)  # a node-local checkpoint whose nodes each hold their own files
    saved = state["tensors"]
    mine = {n: (_shape(t), is_param) for n, t, is_param in _named_tensors(engine.module)}
    problems = [f"{n}: shape {saved[n]['shape']} in the checkpoint, {s} in the model"
                for n, (s, _) in mine.items() if n in saved and saved[n]["shape"] != s]
    if load_module_strict:
        everywhere = set(mine) if place.mesh is None else {n for names in place.gather(sorted(mine)) for n in names}
        problems += [f"{n}: missing from the checkpoint" for n in mine if n not in saved]
        problems += [f"{n}: in the checkpoint, not in the model" for n in saved if n not in everywhere]
    if io.any_rank(bool(problems), f"checking checkpoint {path}"):  # ranks hold different tensors (stages, slices)
        raise CheckpointError(f"{path}: the checkpoint does not match the model ({len(problems)} problem(s)): "
                              + "; ".join(problems) if problems else
                              f"{path}: the checkpoint does not match another rank's part of the model (see its error)")
    stored, error = {}, None
    try:
        stored = saved_tensors(str(path / "tensors"))
    except BaseException as exc:  # noqa: BLE001 - safetensors and DCP raise many kinds on a damaged file
        error = exc
    if io.any_rank(error is not None, f"reading checkpoint {path}"):
        raise CheckpointError(f"{path / 'tensors'}: a tensor file is truncated or corrupt "
                              f"({error or 'on another rank, see its error'})") from None
    if split:  # each node sees its own files: the tensors of all of them
        for theirs in gather_objects(io, stored):
            stored.update({k: max(n, stored.get(k, 0)) for k, n in theirs.items()})
    scalar = set(state.get("scalar_state", ()))  # per-slot scalars (a torch optimizer's step): one element each
    short = [f"{k} ({stored[k]} of {n} elements)" for k, n in
             ((k, 1 if k.split("/", 1)[0] in scalar else math.prod(saved[k.split("/", 1)[1]]["shape"]))
              for k in stored if k.split("/", 1)[1] in saved)
             if stored[k] != n]
    if io.any_rank(bool(short), f"checking checkpoint {path}"):
        raise CheckpointError(f"{path / 'tensors'}: incomplete tensors {short[:4] or '(on another rank)'}: a rank's "
                              f"file is missing")
    with_optimizer = load_optimizer_states and not load_module_only
    if with_optimizer:
        wanted = dict.fromkeys(c.name for c in _chunks(engine, place, saving=False, kinds=OPTIMIZER))
        absent = [name for name in wanted if name not in stored]
        if io.any_rank(bool(absent), f"checking checkpoint {path}"):
            raise CheckpointError(f"{path}: the checkpoint lacks optimizer states ({absent[:4]}...); load with "
                                  f"load_optimizer_states=False to take the model only")
        groups = _saved_param_groups(state, place)
        wrong = groups is not None and len(groups) != len(engine.optimizer.param_groups)
        if io.any_rank(wrong, f"checking checkpoint {path}"):
            raise CheckpointError(f"{path}: the checkpoint's optimizer has {len(groups)} param group(s), this engine's "
                                  f"{len(engine.optimizer.param_groups)}: build the engine with the same param groups "
                                  f"(model_parameters), or load with load_optimizer_states=False" if wrong else
                                  f"{path}: another rank's param groups do not match the checkpoint's (see its error)")
    targets = [c for c in _chunks(engine, place, saving=False, kinds=None if with_optimizer else MODEL)
               if c.name in stored]
    if not with_optimizer:  # the master follows the loaded model
        targets += [Chunk(f"model/{c.name.split('/', 1)[1]}", c.offset, c.tensor, c.numel)
                    for c in _chunks(engine, place, saving=False, kinds=("master",))
                    if f"model/{c.name.split('/', 1)[1]}" in stored]
    # one staging span per tensor on this rank, covering all its targets: DCP tells the pieces a
    # rank reads apart by (name, offset) only, and two targets may share both (the model and, with
    # load_optimizer_states=False, the master that follows it). A tensor stored in another layout
    # than this engine's is read whole and re-sliced (see [Note: sliced tensors in checkpoints]).
    layouts = {n: layout_of(t) for n, t, _ in _named_tensors(engine.module)}
    moved = {c.name for c in targets if saved[c.name.split("/", 1)[1]].get("layout") != layouts[c.name.split("/", 1)[1]]}
    spans: dict[str, tuple[int, int, torch.dtype, int]] = {}  # name -> (lo, hi, dtype, global length)
    for c in targets:
        lo, hi, dtype, numel = spans.get(c.name, (c.numel, 0, c.tensor.dtype, c.numel))
        lo, hi = (0, numel) if c.name in moved else (min(lo, c.offset), max(hi, c.offset + c.tensor.numel()))
        spans[c.name] = (lo, hi, dtype, numel)
    staged = {n: Chunk(n, lo, torch.empty(hi - lo, dtype=dtype), numel) for n, (lo, hi, dtype, numel) in spans.items()}
    error = None
    try:
        if split:  # what this node's files do not hold comes from a rank whose node's files do
            load_chunks_across_nodes(list(staged.values()), str(path / "tensors"), io)
        else:
            load_chunks(list(staged.values()), str(path / "tensors"), process_group=io.group if io.distributed else None)
        for name in moved:
            n = name.split("/", 1)[1]
            staged[name].tensor = from_whole(to_whole(staged[name].tensor, saved[n]["shape"], saved[n].get("layout")),
                                             layouts[n])
    except BaseException as exc:  # noqa: BLE001 - DCP wraps errors in CheckpointException (a BaseException)
        error = exc
    if io.any_rank(error is not None, f"reading checkpoint {path}"):
        raise CheckpointError(f"{path / 'tensors'}: reading failed ({error or 'on another rank'}); the engine is "
                              f"unchanged") from None
    sources = [staged[c.name].tensor[c.offset - staged[c.name].offset :][: c.tensor.numel()] for c in targets]
    own = _read_rank_state(engine, place, path, state) if with_optimizer else None
    # everything arrived: now change the engine
    engine.zero_grad()  # gradients of the run before the load belong to no step of the loaded one
    with torch.no_grad():
        for target, source in zip(targets, sources):
            target.tensor.copy_(source)
        if engine.optimizer.rank_state():
            if own is None or not with_optimizer or load_module_only:
                engine.optimizer.reset_rank_state()  # it would not fit the loaded values
            else:  # this rank's own state, over what rank 0 saved for everyone (see ShardedOptimizer.rank_state)
                for key, t in engine.optimizer.rank_state().items():
                    t.copy_(own[key])
    engine.optimizer.storage.after_checkpoint_load()
    engine.optimizer.storage.edits_seen(engine.module.parameters())
    if load_module_only:
        return str(path), state["client_state"]
    if with_optimizer:
        own = engine.optimizer.state_dict()["param_groups"]  # kept where the pipeline was split otherwise
        engine.optimizer.load_state_dict({**state["optimizer"], "param_groups": own if groups is None else groups})

    # the other stateful parts, by name; a window of accumulated micro-batches is not in a checkpoint: the
    # progress counters start at the window's beginning
    for name, part in stateful_parts(engine).items():
        saved = state.get(name) if name in ENGINE_PARTS else state.get("components", {}).get(name)
        if name == "optimizer" or part is None or saved is None:
            continue
        if name == "lr_scheduler" and not load_lr_scheduler_states:
            continue
        part.load_state_dict(saved)
    rng = path / "rng" / f"rank{place.world.rank}.safetensors"
    if rng.is_file():
        with safe_open(str(rng), framework="pt") as f:
            _set_rng_state({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    return str(path), state["client_state"]


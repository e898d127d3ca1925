"""Checkpoints are safe to load: a pickle is refused without being run, a torn save leaves the
previous checkpoint and `latest` intact, and every bad checkpoint is refused with the file and the
problem named, before the engine changes."""
import json
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from zero.checkpoint.training import CheckpointError
from zero.testing.dist import run_once


def _engine(width: int = 16, stage: int = 2):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))
    engine, *_ = zero.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}})
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
    return engine


def _params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['ZERO_PAYLOAD_MARK']}",))


def test_bad_checkpoints_are_refused_naming_the_file_and_nothing_changes(tmp_path, monkeypatch):
    engine = _engine()
    engine.save_checkpoint(tmp_path, tag="good")
    before = _params(engine)

    def refused(match: str, **kwargs):
        with pytest.raises(CheckpointError, match=match):
            engine.load_checkpoint(kwargs.pop("dir", tmp_path), **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(before, _params(engine)))  # unchanged

    refused(r"checkpoint directory .*nowhere does not exist", dir=tmp_path / "nowhere")
    refused(r"checkpoint tag 'missing' not found", tag="missing")
    # a pickle where a checkpoint file should be: refused, never unpickled
    mark = tmp_path / "payload_ran"
    monkeypatch.setenv("ZERO_PAYLOAD_MARK", str(mark))
    (tmp_path / "good" / "tensors" / "optimizer.pt").write_bytes(pickle.dumps(_Payload()))
    refused(r"good/tensors/optimizer.pt: not a file of a zero checkpoint .* a pickle is never loaded", tag="good")
    assert not mark.exists()
    (tmp_path / "good" / "tensors" / "optimizer.pt").unlink()
    # an unknown format version
    state_file = tmp_path / "good" / "zero_checkpoint.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "version": 99}))
    refused(r"zero_checkpoint.json: unknown format 'zero-checkpoint' version 99", tag="good")
    state_file.write_text(json.dumps(state))
    # a truncated tensor file
    shard = next((tmp_path / "good" / "tensors").glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    refused(r"good: tensors/shard-00001-model-00001-of-00001.safetensors: its contents changed \(truncated or "
            r"corrupt\)", tag="good")
    flipped = bytearray(data)  # same size, damaged data
    flipped[-64:-32] = b"\xff" * 32
    shard.write_bytes(bytes(flipped))
    refused(r"its contents changed \(truncated or corrupt\)", tag="good")
    shard.write_bytes(data)
    rng = tmp_path / "good" / "rng" / "rank0.safetensors"
    kept = rng.read_bytes()
    rng.unlink()  # a rank's file missing
    refused(r"good: rng/rank0.safetensors: missing", tag="good")
    rng.write_bytes(kept)
    # a model that does not match: every difference listed
    other = _engine(width=12)
    other_before = _params(other)
    with pytest.raises(CheckpointError, match=r"does not match the model \(3 problem\(s\)\): 0.weight: shape "
                                              r"\[16, 8\] in the checkpoint, \[12, 8\] in the model; 0.bias"):
        other.load_checkpoint(tmp_path, tag="good")
    assert all(torch.equal(a, b) for a, b in zip(other_before, _params(other)))
    # optimizer states asked for but not in the checkpoint (the layer was frozen when it was saved)
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    frozen[0].requires_grad_(False)
    saver, *_ = zero.initialize(model=frozen, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}})
    saver.save_checkpoint(tmp_path, tag="frozen")
    refused(r"the checkpoint lacks optimizer states \(\['master/0.weight'", tag="frozen")
    engine.load_checkpoint(tmp_path, tag="frozen", load_optimizer_states=False)  # the model alone loads
    engine.load_checkpoint(tmp_path, tag="good")  # and the good one still loads
    assert all(torch.equal(a, b) for a, b in zip(before, _params(engine)))


def torn_save(path: str):
    """Save tag one, then die (rank 1) in the middle of writing tag two."""
    engine = _engine()
    engine.save_checkpoint(path, tag="one")
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
    if dist.get_rank() == 1:
        import safetensors.torch

        def die(*args, **kwargs):
            os._exit(17)  # killed inside DCP's write of its tensor file

        safetensors.torch.save = die
    start = time.monotonic()
    try:
        engine.save_checkpoint(path, tag="two")
        return "saved"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_and_latest(tmp_path):
    results, exit_s = run_once(2, torn_save, str(tmp_path), env={"ZERO_COLLECTIVE_TIMEOUT": "10"}, timeout=90)
    assert results[1] == "no result (killed)", results
    assert "CollectiveTimeout" in results[0] or "CheckpointError" in results[0], results[0]
    assert (tmp_path / "latest").read_text() == "one"
    assert not (tmp_path / "two").exists()
    engine = _engine()
    path, _ = engine.load_checkpoint(tmp_path)  # world of one: the previous checkpoint loads
    assert path.endswith("one") and engine.global_steps == 1


def test_a_version_1_checkpoint_loads_as_before_and_other_param_groups_are_refused(tmp_path):
    import shutil

    engine = _engine()
    engine.optimizer.param_groups[0]["lr"] = 0.0123
    engine.save_checkpoint(tmp_path, tag="v2")
    state = json.loads((tmp_path / "v2" / "zero_checkpoint.json").read_text())
    assert state["version"] == 2 and state["progress"] == engine.progress.state_dict()
    assert state["optimizer"] == json.loads(json.dumps(engine.optimizer.state_dict()))
    v1 = {k: v for k, v in state.items() if k not in ("progress", "optimizer")}  # as version 1 wrote it
    v1.update(state["progress"], version=1, micro_steps=1, optimizer_step=state["optimizer"]["step"],
              param_groups=state["optimizer"]["param_groups"], loss_scaler=state["optimizer"]["loss_scaler"])
    shutil.copytree(tmp_path / "v2", tmp_path / "v1")
    (tmp_path / "v1" / "zero_checkpoint.json").write_text(json.dumps(v1))
    loaded = []
    for tag in ("v2", "v1"):
        fresh = _engine()
        fresh.backward(fresh(torch.randn(4, 8)).square().mean())
        fresh.step()  # two steps in: the load must set everything back
        fresh.load_checkpoint(tmp_path, tag=tag)
        loaded.append((_params(fresh), fresh.global_steps, fresh.optimizer.step_count,
                       fresh.optimizer.param_groups[0]["lr"]))
    assert loaded[0][1:] == loaded[1][1:] == (1, 1, 0.0123)
    assert all(torch.equal(a, b) for a, b in zip(loaded[0][0], loaded[1][0]))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    two, *_ = zero.initialize(model=net, model_parameters=[{"params": net[0].parameters()},
                                                           {"params": net[2].parameters(), "lr": 1e-4}],
                              config={"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}})
    before = _params(two)
    with pytest.raises(CheckpointError, match=r"the checkpoint's optimizer has 1 param group\(s\), this engine's 2"):
        two.load_checkpoint(tmp_path, tag="v2")
    assert all(torch.equal(a, b) for a, b in zip(before, _params(two)))


def _component_state_round_trip(tmp) -> dict:
    from zero.components import Component

    class Counter(Component):
        name = "tensors"  # a name the checkpoint's own keys also use: components are kept apart

        def __init__(self):
            self.steps = 0

        def after_step(self, engine, applied):
            self.steps += 1

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    engine = _engine()
    engine.components["tensors"] = counter = Counter()
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    engine.save_checkpoint(tmp, tag="t")
    saved = json.loads((tmp / "t" / "zero_checkpoint.json").read_text())
    fresh = _engine()
    fresh.components["tensors"] = loaded = Counter()
    fresh.load_checkpoint(tmp, tag="t")
    return {"saved": saved["components"], "tensors_kept": isinstance(saved["tensors"], dict),
            "counted": counter.steps, "loaded": loaded.steps}


def test_a_components_state_is_saved_and_loaded_under_its_name(tmp_path):
    out = _component_state_round_trip(tmp_path)
    assert out == {"saved": {"tensors": {"steps": 3}}, "tensors_kept": True, "counted": 3, "loaded": 3}

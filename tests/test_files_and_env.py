"""Files and environment settings fail loudly and safely: a checkpoint name cannot escape its
directory, a killed save leaves no orphan behind for long, a failed write names the file and keeps
the previous one, a bad optimizer shard state is refused before it is loaded, an unusable op cache
falls back to torch and says which setting to fix, and a bad ZERO_COLLECTIVE_TIMEOUT stops
`zero.initialize` instead of a step."""
import math
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import zero
from zero import checkpoint
from zero.checkpoint import CheckpointWriteError, atomic_save, checked_save_path
from zero.ops import builder
from zero.parallel.comm import collective_timeout_s
from zero.testing.models import MLP
from zero.testing.state import load_shard_state, shard_state
from zero.testing.training import make_batch


def single_process_engine(stage: int = 1):
    """An engine over a world of one (no torch.distributed), enough for files and settings."""
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = zero.initialize(model=MLP(), config=cfg)
    return engine


# -- checkpoint file names --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escaped.bin", "/tmp/zero-absolute.bin", "sub/../../escaped.bin", "", "sub/"])
def test_a_save_filename_that_leaves_save_dir_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=f"save_filename must be a file name .* got {name!r}"):
        checked_save_path(tmp_path / "out", name)


def test_a_save_filename_inside_save_dir_is_joined(tmp_path):
    assert checked_save_path(tmp_path, "model.bin") == tmp_path / "model.bin"
    assert checked_save_path(tmp_path, "step100/model.bin") == tmp_path / "step100" / "model.bin"


def test_save_16bit_model_refuses_an_escaping_name_before_writing(tmp_path):
    engine = single_process_engine()
    for name in ("../escaped.bin", str(tmp_path / "absolute.bin")):
        with pytest.raises(ValueError, match="save_filename"):
            engine.save_16bit_model(tmp_path / "out", name)
    assert sorted(os.listdir(tmp_path)) == []  # not even save_dir was created


# -- atomic saves -----------------------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_removes_orphaned_temp_files_of_its_target_and_keeps_live_ones(tmp_path):
    """A save killed before its rename leaves `.<name>.<host>.<pid>.<random>.tmp`; the next save to
    the same path removes it when that pid is gone, and never a live writer's file."""
    host, old = checkpoint._host_tag(), time.time() - 2 * checkpoint.STALE_TEMP_AGE_S
    orphan = tmp_path / f".model.bin.{host}.{dead_pid()}.a1b2c3d4.tmp"
    live = tmp_path / f".model.bin.{host}.{os.getpid()}.e5f6g7h8.tmp"  # a concurrent writer in this process
    old_unowned = tmp_path / ".model.bin.k3j4h5g6.tmp"  # the pre-pid form; untouched for hours
    fresh_unowned = tmp_path / ".model.bin.zz99yy88.tmp"
    other_host = tmp_path / f".model.bin.elsewhere-{host}.{os.getpid()}.q1w2e3r4.tmp"  # pid means nothing here
    other_target = tmp_path / f".model.bin.1.{host}.{dead_pid()}.t5y6u7i8.tmp"
    for f in (orphan, live, old_unowned, fresh_unowned, other_host, other_target):
        f.write_bytes(b"partial")
    os.utime(old_unowned, (old, old))
    atomic_save({"w": torch.arange(3.0)}, tmp_path / "model.bin")
    assert torch.equal(torch.load(tmp_path / "model.bin")["w"], torch.arange(3.0))
    assert not orphan.exists() and not old_unowned.exists()
    assert live.exists() and fresh_unowned.exists() and other_host.exists() and other_target.exists()
    os.utime(other_host, (old, old))
    atomic_save({"w": torch.arange(3.0)}, tmp_path / "model.bin")
    left = {f.name for f in tmp_path.iterdir()}  # the saves' own temp files became model.bin
    assert left == {"model.bin", live.name, fresh_unowned.name, other_target.name}


def test_a_failed_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    """A file-size limit cuts the write short (EFBIG, as a full disk gives ENOSPC); torch reports
    it as "unexpected pos"; the error names the file and the cause, and the old file stays."""
    code = textwrap.dedent(f"""
        import os, resource, signal, torch
        from zero.checkpoint import atomic_save
        path = {str(tmp_path / "model.bin")!r}
        atomic_save({{"w": torch.ones(4)}}, path)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            atomic_save({{"w": torch.zeros(100_000)}}, path)
        except OSError as exc:
            print(type(exc).__name__, isinstance(exc, RuntimeError), exc.errno, type(exc.__cause__).__name__)
            print(exc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kind, message = r.stdout.split("\n", 1)
    assert kind == "CheckpointWriteError True 27 RuntimeError", r.stdout
    assert f"could not write checkpoint {tmp_path / 'model.bin'}: [Errno 27] File too large" in message
    assert "bytes free on" in message and f"The previous {tmp_path / 'model.bin'} is intact" in message
    assert torch.equal(torch.load(tmp_path / "model.bin")["w"], torch.ones(4))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["model.bin"]  # no temp file left


def test_a_write_error_without_a_previous_file_says_nothing_was_written(tmp_path, monkeypatch):
    def full_disk(obj, fh):
        fh.write(b"x" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"model\.bin: \[Errno 28\] No space left on device \(after 100 "
                                                   r"bytes.*Nothing was written to") as info:
        atomic_save({}, tmp_path / "model.bin")
    assert info.value.errno == 28 and isinstance(info.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []


# -- optimizer shard state --------------------------------------------------------------------


def test_load_shard_state_names_a_missing_key_or_a_non_finite_tensor_and_loads_nothing():
    engine = single_process_engine()
    opt = engine.optimizer
    before = [p.detach().clone() for p in engine.module.parameters()]
    masters = [s.master.clone() for s in opt.slots()]
    with pytest.raises(ValueError, match=r"slot 0 lacks 'group', 'step', 'master', 'exp_avg', 'exp_avg_sq'"):
        load_shard_state(opt, [{}] * len(opt.slots()))
    partial = shard_state(opt)
    del partial[-1]["exp_avg"]
    with pytest.raises(ValueError, match=f"slot {len(partial) - 1} lacks 'exp_avg';"):
        load_shard_state(opt, partial)
    for key, bad in (("master", math.nan), ("exp_avg_sq", math.inf)):
        state = shard_state(opt)
        state[0]["master"] += 1.0  # a change that must not be applied either
        state[-1][key][0] = bad
        with pytest.raises(ValueError, match=f"slot {len(state) - 1}: '{key}' holds non-finite values"):
            load_shard_state(opt, state)
    assert all(torch.equal(m, s.master) for m, s in zip(masters, opt.slots()))
    assert all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
    load_shard_state(opt, shard_state(opt))  # the real thing still loads


# -- the op cache -----------------------------------------------------------------------------


def test_an_unusable_op_cache_falls_back_to_torch_and_names_ZERO_CACHE_DIR(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "cache"  # cannot be created, even by root
    monkeypatch.setenv("ZERO_CACHE_DIR", str(cache))
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_failed", {})
    monkeypatch.setattr(builder, "_build", lambda name: pytest.fail("tried to build without a cache"))
    with pytest.raises(builder.OpUnavailable, match=f"build cache {cache} cannot be created or written .* "
                                                    f"ZERO_CACHE_DIR={cache}"):
        builder.load("cpu_adam")
    engine = single_process_engine()
    before = [p.detach().clone() for p in engine.module.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.backward(engine(*make_batch("mlp", 4, torch.Generator().manual_seed(1))))
        engine.step()
    messages = [str(w.message) for w in caught]
    assert any("uses its slower torch reference" in m and f"ZERO_CACHE_DIR={cache}" in m for m in messages), messages
    assert not all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))  # it trained


# -- ZERO_COLLECTIVE_TIMEOUT ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-inf", "-5", "0", "1e-7", "1e300", ""])
def test_a_bad_collective_timeout_is_refused_at_initialize(monkeypatch, value):
    message = f"ZERO_COLLECTIVE_TIMEOUT must be a finite number of seconds >= 0.001, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        collective_timeout_s(value)
    monkeypatch.setenv("ZERO_COLLECTIVE_TIMEOUT", value)
    with pytest.raises(ValueError, match="ZERO_COLLECTIVE_TIMEOUT"):
        single_process_engine()


def test_a_collective_timeout_is_read_as_seconds(monkeypatch):
    assert collective_timeout_s("2.5") == 2.5
    monkeypatch.delenv("ZERO_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout_s() == 1800.0
    monkeypatch.setenv("ZERO_COLLECTIVE_TIMEOUT", "45")
    assert single_process_engine().comm.timeout_s == 45.0

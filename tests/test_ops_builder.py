"""The JIT op builder: nothing at import, one build per source version, clear errors."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from zero.ops import builder

LOAD_PACK = "import zero.ops.builder as b; b.load('pack')"


def run_python(code: str, cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ZERO_CACHE_DIR=cache)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_import_zero_compiles_nothing(tmp_path):
    r = run_python("import zero, zero.ops, zero.env; print('ok')", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "cache").exists()


def test_concurrent_first_use_builds_once_and_later_loads_are_silent(tmp_path):
    cache = str(tmp_path / "cache")
    env = dict(os.environ, ZERO_CACHE_DIR=cache)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_PACK], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    lines = [line for e in errs for line in e.splitlines() if "compiling native op 'pack'" in line]
    assert len(lines) == 1, errs  # one process built, the other waited for it
    again = run_python(LOAD_PACK, cache)
    assert again.returncode == 0 and "compiling" not in again.stderr


def test_changing_a_source_or_flag_means_a_new_build_directory(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(builder.source_dir(), src)
    monkeypatch.setattr(builder, "source_dir", lambda: src)
    first = builder.build_dir("pack")
    assert builder.build_dir("pack") == first  # stable
    (src / "comm" / "pack.c").write_text((src / "comm" / "pack.c").read_text() + "\n/* edited */\n")
    second = builder.build_dir("pack")
    assert second != first
    (src / "common" / "dtypes.h").write_text((src / "common" / "dtypes.h").read_text() + "\n")
    assert builder.build_dir("pack") != second  # shared headers count too
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert builder.build_dir("pack") not in (first, second)


def test_missing_compiler_is_a_clear_error_at_first_use(monkeypatch):
    monkeypatch.setattr(builder, "c_compiler", lambda: None)
    monkeypatch.setattr(builder, "_loaded", {})
    assert "no C compiler" in builder.missing("pack")
    with pytest.raises(builder.OpUnavailable, match=r"op 'pack' .* unavailable: no C compiler found"):
        builder.load("pack")


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the message of a CPU-only torch build")
def test_cuda_op_on_a_cpu_only_torch_names_the_missing_piece():
    with pytest.raises(builder.OpUnavailable, match=r"op 'fused_adam' .* built without CUDA"):
        builder.load("fused_adam")


def test_unknown_op_names_the_known_ones():
    with pytest.raises(KeyError, match="known ops: cpu_adam, pack"):
        builder.load("no_such_op")


def test_env_report_lists_every_op_and_the_simd_level():
    r = subprocess.run([sys.executable, "-m", "zero.env"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in builder.OPS:
        assert name in r.stdout
    for key in ("torch", "nvcc", "C compiler", "CPU SIMD"):
        assert key in r.stdout

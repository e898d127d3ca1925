"""The JIT op builder: nothing at import, one build per source version, toolkit and GPU, one attempt
per process for an op that fails, and clear errors."""
import ctypes
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from zero.ops import builder

LOAD_CPU_ADAM = "import zero.ops.builder as b; b.load('cpu_adam')"


def run_python(code: str, cache: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ZERO_CACHE_DIR=cache, **env_vars)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_import_zero_compiles_nothing(tmp_path):
    r = run_python("import zero, zero.ops, zero.env; print('ok')", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "cache").exists()


def test_concurrent_first_use_builds_once_and_later_loads_are_silent(tmp_path):
    cache = str(tmp_path / "cache")
    env = dict(os.environ, ZERO_CACHE_DIR=cache)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_CPU_ADAM], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    lines = [line for e in errs for line in e.splitlines() if "compiling native op 'cpu_adam'" in line]
    assert len(lines) == 1, errs  # one process built, the other waited for it
    again = run_python(LOAD_CPU_ADAM, cache)
    assert again.returncode == 0 and "compiling" not in again.stderr


def test_changing_a_source_or_flag_means_a_new_build_directory(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(builder.source_dir(), src)
    monkeypatch.setattr(builder, "source_dir", lambda: src)
    first = builder.build_dir("cpu_adam")
    assert builder.build_dir("cpu_adam") == first  # stable
    (src / "adam" / "cpu_adam.c").write_text((src / "adam" / "cpu_adam.c").read_text() + "\n/* edited */\n")
    second = builder.build_dir("cpu_adam")
    assert second != first
    (src / "common" / "dtypes.h").write_text((src / "common" / "dtypes.h").read_text() + "\n")
    third = builder.build_dir("cpu_adam")
    assert third != second  # shared headers count too
    monkeypatch.setattr(builder, "_c_flags", lambda: ("-std=c11", "-O2", "-fPIC"))
    assert builder.build_dir("cpu_adam") not in (first, second, third)


def test_a_cpu_op_is_plain_c_and_survives_a_torch_upgrade(monkeypatch):
    """A CPU op links no torch (no C++ binding to compile), so its build fits every torch and every
    CUDA toolkit; the structs its entry points take have the same size in C and in ctypes."""
    from zero.ops import native

    cpu_ops = [name for name, spec in builder.OPS.items() if spec.c_sources]
    assert all(builder.OPS[name].is_c_library for name in cpu_ops)
    before = {name: builder.build_dir(name) for name in cpu_ops}
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert {name: builder.build_dir(name) for name in cpu_ops} == before
    lib = builder.load("cpu_adam")
    for struct, twin in native.STRUCTS.items():
        assert lib.sizeof(struct) == ctypes.sizeof(twin), struct
        for field, _ in twin._fields_:
            assert lib.offsetof(struct, field) == getattr(twin, field).offset, (struct, field)
    assert lib.sizeof("no_such_struct") == 0 and lib.offsetof("adam_config", "no_such_field") == -1


def test_each_cpu_op_compiles_its_own_kernel_and_the_shared_simd_detection_only():
    """The 1-bit and sparse-attention ops once compiled all of the Adam kernel to reach its SIMD
    detection; now every CPU op links common/simd.c and no kernel of another op."""
    cpu_ops = {name: spec for name, spec in builder.OPS.items() if spec.c_sources}
    assert set(cpu_ops) == {"cpu_adam", "cpu_optim", "onebit", "quant", "aio", "sparse_attention"}
    owners: dict[str, list[str]] = {}
    for name, spec in cpu_ops.items():
        assert "common/simd.c" in spec.c_sources, name
        for source in spec.c_sources:
            if not source.startswith("common/"):
                owners.setdefault(source, []).append(name)
    assert all(len(names) == 1 for names in owners.values()), owners


def test_editing_the_shared_simd_code_rebuilds_every_cpu_op_and_a_kernel_body_only_its_op(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(builder.source_dir(), src)
    monkeypatch.setattr(builder, "source_dir", lambda: src)
    cpu_ops = ("cpu_adam", "onebit", "sparse_attention")
    first = {name: builder.build_dir(name) for name in cpu_ops}
    for edited in ("common/simd.c", "common/simd_width.h"):
        (src / edited).write_text((src / edited).read_text() + "\n/* edited */\n")
        now = {name: builder.build_dir(name) for name in cpu_ops}
        assert all(now[name] != first[name] for name in cpu_ops), edited
        first = now
    (src / "adam" / "cpu_adam_body.h").write_text((src / "adam" / "cpu_adam_body.h").read_text() + "\n")
    now = {name: builder.build_dir(name) for name in cpu_ops}
    assert now["cpu_adam"] != first["cpu_adam"]
    assert now["onebit"] == first["onebit"] and now["sparse_attention"] == first["sparse_attention"]


def test_a_cuda_op_is_rebuilt_for_another_gpu_or_another_nvcc(monkeypatch):
    """A binary holds code for the GPUs it was built on, so a cache shared with an older GPU (or
    built by another toolkit) must not be reused."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)  # unset: the build targets the visible GPUs
    monkeypatch.setattr(builder, "nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(builder, "nvcc_version", lambda path: "Cuda compilation tools, release 12.8, V12.8.93")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    h100 = builder.build_dir("fused_adam")
    cpu_op = builder.build_dir("cpu_adam")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0) if i == 1 else (9, 0))
    mixed = builder.build_dir("fused_adam")
    assert mixed != h100
    assert builder.build_dir("cpu_adam") == cpu_op  # a CPU op does not depend on the GPUs
    monkeypatch.setattr(builder, "nvcc_version", lambda path: "Cuda compilation tools, release 12.9, V12.9.41")
    assert builder.build_dir("fused_adam") not in (h100, mixed)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # named archs: the visible GPUs no longer matter
    named = builder.build_dir("fused_adam")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    assert builder.build_dir("fused_adam") == named


def test_an_nvcc_of_another_cuda_major_than_torch_is_named_up_front(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(builder, "nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(builder, "_ninja_ok", lambda: True)
    monkeypatch.setattr(builder, "nvcc_version", lambda path: "Cuda compilation tools, release 13.0, V13.0.88")
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_failed", {})
    monkeypatch.setattr(builder, "_build", lambda name: pytest.fail("built despite the version mismatch"))
    with pytest.raises(builder.OpUnavailable, match=r"nvcc at /opt/cuda/bin/nvcc is CUDA 13\.0 but this torch was "
                                                    r"built with CUDA 12\.8"):
        builder.load("fused_adam")
    monkeypatch.setattr(builder, "nvcc_version", lambda path: "Cuda compilation tools, release 12.4, V12.4.131")
    assert builder.missing("fused_adam") is None  # same major: fine


def test_a_failed_build_is_tried_once_per_process(tmp_path):
    """With a C compiler that always fails (CC=false), the first load() compiles and fails; later
    ones raise the same error at once, so a fallback that retries every step costs nothing."""
    code = textwrap.dedent("""
        import zero.ops.builder as b
        for _ in range(4):
            try:
                b.load("cpu_adam")
            except b.OpUnavailable as exc:
                print("unavailable:", str(exc).splitlines()[0])
    """)
    env = dict(os.environ, ZERO_CACHE_DIR=str(tmp_path / "cache"), CC="false")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    attempts = [line for line in r.stderr.splitlines() if "compiling native op 'cpu_adam'" in line]
    assert len(attempts) == 1, r.stderr
    reports = r.stdout.splitlines()
    assert len(reports) == 4 and len(set(reports)) == 1, r.stdout
    assert "compiling adam/cpu_adam.c failed" in reports[0]


def test_a_killed_build_keeps_what_it_compiled_and_the_next_compiles_the_rest(tmp_path):
    """A first use killed mid-build (Ctrl-C, a timeout) must not cost the next run the whole build:
    every C file compiles into an object of its own, renamed into the cache when complete."""
    real = builder.c_compiler()
    cc = tmp_path / "cc"  # the real compiler, except that it hangs on the AVX-512 unit when asked to
    cc.write_text(f'#!/bin/sh\ncase "$*" in *cpu_adam_avx512.c*) [ -n "$HANG" ] && sleep 600;; esac\n'
                  f'exec {real} "$@"\n')
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    env = dict(os.environ, ZERO_CACHE_DIR=str(cache), CC=str(cc), ZERO_BUILD_JOBS="2")
    first = subprocess.Popen([sys.executable, "-c", LOAD_CPU_ADAM], env=dict(env, HANG="1"),
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(600):  # the four other files compile while the AVX-512 one hangs
            if len(list((cache / "objects").glob("*.o"))) == 4:
                break
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    done = sorted(o.name.rsplit("-", 1)[0] for o in (cache / "objects").glob("*.o"))
    assert done == ["adam_cpu_adam", "adam_cpu_adam_avx2", "common_abi", "common_simd"], done
    again = run_python(LOAD_CPU_ADAM, str(cache), CC=str(cc))
    assert again.returncode == 0, again.stderr
    assert "compiling native op 'cpu_adam'" in again.stderr and ": 1 of 5 C files" in again.stderr, again.stderr


def test_a_process_waiting_for_anothers_build_says_so(tmp_path):
    """Ranks that wait on one build print which op they wait for and for how long."""
    cache = tmp_path / "cache"
    lock = builder.build_dir("cpu_optim").name + ".lock"
    (cache).mkdir()
    code = ("import zero.ops.builder as b; b.WAIT_REPORT_S = 0.2; b.load('cpu_optim')")
    with open(cache / lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a building process holds it
        waiter = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, ZERO_CACHE_DIR=str(cache)),
                                  stderr=subprocess.PIPE, text=True)
        said = waiter.stderr.readline()  # blocks until the waiter reports (or exits)
        fcntl.flock(held, fcntl.LOCK_UN)
    rest = waiter.communicate(timeout=600)[1]
    assert waiter.returncode == 0, said + rest
    assert re.search(r"waiting for native op 'cpu_optim', which another process is compiling \(\d+ s so far", said), said
    assert "compiling native op 'cpu_optim'" in rest  # then it builds, the lock being free


def test_missing_compiler_is_a_clear_error_at_first_use(monkeypatch):
    monkeypatch.setattr(builder, "c_compiler", lambda: None)
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_failed", {})
    assert "no C compiler" in builder.missing("cpu_adam")
    with pytest.raises(builder.OpUnavailable, match=r"op 'cpu_adam' .* unavailable: no C compiler found"):
        builder.load("cpu_adam")


def test_cuda_op_on_a_cpu_only_torch_names_the_missing_piece(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_failed", {})
    with pytest.raises(builder.OpUnavailable, match=r"op 'fused_adam' .* built without CUDA"):
        builder.load("fused_adam")


def test_unknown_op_names_the_known_ones():
    with pytest.raises(KeyError, match="known ops: cpu_adam, cpu_optim, onebit, onebit_cuda, quant, quant_cuda, fused_adam"):
        builder.load("no_such_op")


def test_env_report_lists_every_op_and_the_simd_level():
    r = subprocess.run([sys.executable, "-m", "zero.env"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in builder.OPS:
        assert name in r.stdout
    for key in ("torch", "nvcc", "C compiler", "CPU SIMD"):
        assert key in r.stdout

"""The CUDA sources build for the GPUs we ship for, even on a machine without a GPU.

Every csrc/**/*.cu compiles with nvcc for sm_80 (A100) and sm_90 (H100/H200) with the flags and
the C++ standard torch's JIT build gives it, and every C++ binding of a CUDA op parses against
torch's headers and the CUDA toolkit's. Running the kernels needs a GPU: see
tests/test_fused_adam_gpu.py and csrc/dev/adam_check.cu.
"""
import inspect
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from zero.ops import builder

CSRC = Path(__file__).resolve().parent.parent / "csrc"
CUDA_SOURCES = sorted(CSRC.rglob("*.cu"))
DEV_DIR = CSRC / "dev"  # standalone programs for a GPU machine, not part of any op
ARCHS = ("sm_80", "sm_90")
NVCC = builder.nvcc()

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME to a CUDA toolkit to run this check)")


def _torch_std_flag() -> str:
    """The -std flag torch.utils.cpp_extension gives the C++ compiler and nvcc (c++20 in torch 2.13).

    torch exposes no constant for it, so read it from cpp_extension's source: the newest standard
    it names."""
    from torch.utils import cpp_extension

    versions = re.findall(r"-std=c\+\+(\d\d)\b", inspect.getsource(cpp_extension))
    return f"-std=c++{max(versions, key=int)}" if versions else "-std=c++17"


def _torch_nvcc_flags() -> list[str]:
    """The defines torch.utils.cpp_extension gives nvcc (no implicit half/bf16 conversions...)."""
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

        return list(COMMON_NVCC_FLAGS)
    except ImportError:  # pragma: no cover - torch without cpp_extension
        return []


def _rel(path: Path) -> str:
    return str(path.relative_to(CSRC))


def test_every_cuda_source_belongs_to_an_op():
    listed = {s for spec in builder.OPS.values() for s in spec.cuda_sources}
    assert {_rel(p) for p in CUDA_SOURCES if DEV_DIR not in p.parents} <= listed
    assert all((CSRC / s).is_file() for s in listed), listed


def test_cuda_ops_are_built_without_fast_math():
    # fused Adam gives the CPU kernel's bits: IEEE arithmetic and fp16 subnormals kept.
    for spec in builder.OPS.values():
        if spec.needs_cuda:
            assert "--use_fast_math" not in spec.extra_cuda_cflags, spec.name


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=_rel)
def test_cuda_source_compiles(source, arch, tmp_path):
    cmd = [NVCC, "-c", f"-arch={arch}", _torch_std_flag(), "-O3", *_torch_nvcc_flags(), "-I", str(CSRC), str(source),
           "-o", str(tmp_path / "kernel.o")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "kernel.o").stat().st_size > 0


# ----------------------------------------------------------------------------- bindings

CUDA_BINDINGS = sorted({s for spec in builder.OPS.values() if spec.needs_cuda for s in spec.cpp_sources})


def _cuda_include_dir() -> Path | None:
    """The toolkit's include directory; nvcc may be a wrapper script outside the toolkit."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        homes.append(CUDA_HOME)
    except ImportError:  # pragma: no cover
        pass
    homes += [str(Path(NVCC).resolve().parent.parent) if NVCC else None, "/usr/local/cuda"]
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return Path(home) / "include"
    return None


def _binding_syntax_command(source: str) -> tuple[list[str] | None, str]:
    """g++ -fsyntax-only over one binding, or (None, why it cannot run here)."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return None, "no C++ compiler on PATH"
    if NVCC is None:
        return None, "nvcc not found, so no CUDA toolkit headers (set CUDA_HOME)"
    cuda_include = _cuda_include_dir()
    if cuda_include is None:
        return None, "cuda_runtime_api.h not found (looked in $CUDA_HOME, next to nvcc and in /usr/local/cuda)"
    from torch.utils.cpp_extension import include_paths

    torch_includes = [Path(p) for p in include_paths()]
    needed = ("torch/extension.h", "c10/cuda/CUDAGuard.h", "c10/cuda/CUDAStream.h")
    for header in needed:
        if not any((d / header).is_file() for d in torch_includes):
            return None, f"this torch install ships no {header}"
    # torch's CPU wheels ship the c10/cuda headers but not the file CMake generates for them;
    # that file only sets export macros, which a syntax check does not need.
    generated = any((d / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for d in torch_includes)
    name = "zero_" + Path(source).stem
    cmd = [cxx, _torch_std_flag(), "-fsyntax-only", f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *([] if generated else ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]),
           "-I", str(CSRC), *(f"-I{d}" for d in torch_includes), f"-I{cuda_include}",
           f"-I{sysconfig.get_paths()['include']}", str(CSRC / source)]  # fmt: skip
    return cmd, ""


@pytest.mark.parametrize("source", CUDA_BINDINGS)
def test_cuda_binding_parses_against_torch_and_cuda_headers(source):
    cmd, why = _binding_syntax_command(source)
    if cmd is None:
        pytest.skip(why)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"$ {' '.join(cmd)}\n{r.stderr[-20000:]}"

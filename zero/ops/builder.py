"""Find a compiler, JIT-build each native op once, and cache it on disk.

[Note: op builds]
Kernels live in csrc/ as C11 (CPU) and CUDA C (GPU) files with a C ABI. An op is built at its
first use, never at `import zero` and never at `pip install` (so installing needs no torch and no
compiler), or ahead of time by `python -m zero.ops build` (what `make demo` and `make test` run).

1. A CPU op is a plain C shared library, `libzero_<op>.so`: its C files are compiled by the
   system C compiler as real C11 (`cc -std=c11 -O3 -fopenmp`) and linked with `cc -shared`. No
   C++ and no torch headers: Python calls its entry points through ctypes (zero/ops/native.py,
   [Note: CPU ops without C++]). No `-march=native`: SIMD paths carry their own `target`
   attributes and are picked at run time by the one detection in csrc/common/simd.c, which every
   CPU op links (see [Note: SIMD levels] in csrc/common/simd.h), so one build runs on any x86-64
   host (and on ARM, where only the portable path is compiled). A CPU op never compiles another
   op's kernel.
2. The C files are compiled in parallel ($ZERO_BUILD_JOBS, default: the CPUs this process may
   use), each into an object of its own under `<cache>/objects/`, named by a hash of the file, the
   headers it includes, the flags and the compiler. An object is written to a temporary name and
   renamed when complete, so a build that fails in one file or is killed (Ctrl-C, a timeout, a
   scheduler) keeps every object it finished: the next build compiles only what is missing. The
   heavy kernels are split by vector width into translation units of their own
   (adam/cpu_adam_avx2.c, adam/cpu_adam_avx512.c), so that they compile side by side.
3. A CUDA op's bindings (C++) and .cu files are compiled and linked by
   `torch.utils.cpp_extension.load`, which uses ninja and nvcc; the bindings use torch's own C++
   standard (c++20 in torch 2.13).
4. The result lands in `<cache>/<op>-<hash>/`, where the hash covers every source and every header
   it includes, the flags and the compiler; for a CUDA op also the torch/Python/CUDA versions, the
   `nvcc --version` output and, unless TORCH_CUDA_ARCH_LIST names the archs, the compute capability
   of every visible GPU (the binary holds code for those only). A CPU op links no torch, so it
   survives a torch upgrade. A changed source, flag, toolkit or GPU therefore means a new directory
   and a rebuild; an unchanged one is imported directly, without compiling anything (the compiler
   is asked only its version and whether it takes -fopenmp, once per process).

The cache lives in `$ZERO_CACHE_DIR` (default `~/.cache/zero/ops`). Concurrent ranks that
need the same op take a file lock: one builds (one line when it starts, one with its time when it
is done), the others wait, saying every 15 s which op they wait for and for how long, and import
the result.

An op that cannot be built (no compiler, a compile error, an nvcc whose major version differs
from torch's CUDA, a cache directory that cannot be created or written) raises OpUnavailable,
and the failure is remembered: later `load()` calls in the same process raise the same error at
once instead of compiling again.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

import torch


class OpUnavailable(RuntimeError):
    """A native op cannot be built or loaded on this machine; the message says why."""


@dataclass(frozen=True)
class OpSpec:
    """What one native op is made of.

    Args:
        name: short name used by `load()` and the env report (`cpu_adam`, `fused_adam`).
        what: one line for people: what the op does.
        c_sources: C11 kernel files, relative to csrc/; compiled by the C compiler. An op with
            C sources only is a C library called through ctypes (zero/ops/native.py).
        cpp_sources: C++ binding files (torch extension entry points), relative to csrc/.
        cuda_sources: CUDA C kernel files, relative to csrc/; compiled by nvcc.
    """

    name: str
    what: str
    c_sources: tuple[str, ...] = ()
    cpp_sources: tuple[str, ...] = ()
    cuda_sources: tuple[str, ...] = ()
    # never --use_fast_math: the kernels rely on IEEE arithmetic (adam/adam_math.h) and on fp16
    # subnormals (common/dtypes.h)
    extra_cuda_cflags: tuple[str, ...] = field(default=("-O3",))

    @property
    def needs_cuda(self) -> bool:
        return bool(self.cuda_sources)

    @property
    def is_c_library(self) -> bool:
        """Plain C, no torch extension: built by the C compiler alone, called through ctypes."""
        return not (self.cpp_sources or self.cuda_sources)


_CPU_COMMON = ("common/simd.c", "common/abi.c")  # every CPU op: the SIMD detection, the struct sizes


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "cpu_adam",
            "CPU Adam/AdamW (AVX-512 / AVX2 / portable C, OpenMP)",
            c_sources=("adam/cpu_adam.c", "adam/cpu_adam_avx2.c", "adam/cpu_adam_avx512.c", *_CPU_COMMON),
        ),
        OpSpec(
            "cpu_optim",
            "CPU Lion and Adagrad, the host update of their optimizer offload (C, OpenMP)",
            c_sources=("optim/cpu_optim.c", *_CPU_COMMON),
        ),
        OpSpec(
            "onebit",
            "1-bit pack with error feedback and unpack-mean (AVX-512 / AVX2 / portable C, OpenMP)",
            c_sources=("onebit/onebit.c", *_CPU_COMMON),
        ),
        OpSpec(
            "onebit_cuda",
            "1-bit pack with error feedback and unpack-mean on the GPU",
            cpp_sources=("bindings/onebit_cuda.cpp",),
            cuda_sources=("onebit/onebit.cu",),
        ),
        OpSpec(
            "quant",
            "ZeRO++ qwZ: int8 weight blocks, quantize and dequantize (C, OpenMP)",
            c_sources=("quant/quant.c", *_CPU_COMMON),
        ),
        OpSpec(
            "quant_cuda",
            "ZeRO++ qwZ: int8 weight blocks, quantize and dequantize on the GPU",
            cpp_sources=("bindings/quant_cuda.cpp",),
            cuda_sources=("quant/quant.cu",),
        ),
        OpSpec(
            "fused_adam",
            "fused multi-tensor GPU Adam/AdamW",
            cpp_sources=("bindings/fused_adam.cpp",),
            cuda_sources=("adam/fused_adam.cu",),
        ),
        OpSpec(
            "aio",
            "asynchronous file reads and writes for NVMe offload (pread/pwrite threads, O_DIRECT)",
            c_sources=("aio/aio.c", *_CPU_COMMON),
        ),
        OpSpec(
            "sparse_attention",
            "block-sparse attention forward/backward (AVX-512 / AVX2 / portable C, OpenMP)",
            c_sources=("sparse_attention/sparse_attention.c", *_CPU_COMMON),
        ),
        OpSpec(
            "sparse_attention_cuda",
            "block-sparse attention forward/backward on the GPU",
            cpp_sources=("bindings/sparse_attention_cuda.cpp",),
            cuda_sources=("sparse_attention/sparse_attention.cu",),
        ),
    )
}


# ----------------------------------------------------------------------------- locations


def source_dir() -> Path:
    """Where the C/CUDA sources are: shipped as zero/_csrc, or csrc/ in a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if candidate.is_dir():
            return candidate
    raise OpUnavailable(f"zero's C/CUDA sources were not found (looked in {here / '_csrc'} and {here.parent / 'csrc'})")


def cache_dir() -> Path:
    """Root of the on-disk op cache: $ZERO_CACHE_DIR, or ~/.cache/zero/ops."""
    env = os.environ.get("ZERO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zero" / "ops"


# ----------------------------------------------------------------------------- toolchain


def c_compiler() -> str | None:
    """The C compiler used for csrc/*.c: $CC, else cc, gcc or clang on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"]) or os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def nvcc() -> str | None:
    """nvcc from $CUDA_HOME/bin, torch's idea of CUDA_HOME, or PATH."""
    candidates = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidates.append(Path(home) / "bin" / "nvcc")
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME:
            candidates.append(Path(CUDA_HOME) / "bin" / "nvcc")
    except Exception:  # pragma: no cover - torch builds without cpp_extension support
        pass
    for c in candidates:
        if c.is_file():
            return str(c)
    return shutil.which("nvcc")


@cache
def nvcc_version(path: str) -> str:
    """The output of `<path> --version` (empty when it does not run)."""
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cuda_major_mismatch(nvcc_path: str) -> str | None:
    """Why nvcc cannot build for this torch (its CUDA major version differs), or None."""
    found = re.search(r"release (\d+)\.(\d+)", nvcc_version(nvcc_path))
    if found is None:
        return f"`{nvcc_path} --version` did not report a CUDA release"
    nvcc_cuda = f"{found[1]}.{found[2]}"
    if found[1] != torch.version.cuda.split(".")[0]:
        return (
            f"nvcc at {nvcc_path} is CUDA {nvcc_cuda} but this torch was built with CUDA {torch.version.cuda}; "
            f"their major versions must match (set CUDA_HOME to a CUDA {torch.version.cuda.split('.')[0]}.x toolkit)"
        )
    return None


def _visible_gpu_capabilities() -> list[tuple[int, int]]:
    """(major, minor) compute capability of each visible GPU; empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def _ninja_ok() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return is_ninja_available()
    except Exception:
        return shutil.which("ninja") is not None


@cache
def _c_flags() -> tuple[str, ...]:
    """C11, optimised, position independent; OpenMP when the compiler has it."""
    # -fno-math-errno: sqrtf need not set errno, so it is the bare sqrt instruction; results are
    # the same IEEE values.
    flags = ["-std=c11", "-O3", "-fPIC", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas"]
    cc = c_compiler()
    if cc and _compiler_accepts(cc, "-fopenmp"):
        flags.append("-fopenmp")
    return tuple(flags)


def _compiler_accepts(cc: str, flag: str) -> bool:
    probe = "int main(void){return 0;}\n"
    try:
        r = subprocess.run([cc, flag, "-x", "c", "-", "-o", os.devnull], input=probe, text=True, capture_output=True, timeout=60)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def missing(name: str) -> str | None:
    """Why op `name` cannot be built here, or None if it can."""
    spec = OPS[name]
    try:
        src = source_dir()
    except OpUnavailable as exc:
        return str(exc)
    absent = [s for s in spec.c_sources + spec.cpp_sources + spec.cuda_sources if not (src / s).is_file()]
    if absent:
        return f"source file(s) missing from {src}: {', '.join(absent)}"
    if spec.c_sources and c_compiler() is None:
        return "no C compiler found (install gcc or clang, or set CC)"
    if not spec.is_c_library and not _ninja_ok():
        return "ninja is not installed (pip install ninja)"
    if spec.needs_cuda:
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) was built without CUDA"
        found = nvcc()
        if found is None:
            return "nvcc not found (set CUDA_HOME to a CUDA toolkit)"
        return _cuda_major_mismatch(found)
    return None


# ----------------------------------------------------------------------------- build

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _included(src: Path, rel: str, seen: set[str] | None = None) -> set[str]:
    """`rel` and every csrc/ header it includes, directly or not (paths relative to csrc/)."""
    seen = set() if seen is None else seen
    if rel in seen:
        return seen
    seen.add(rel)
    path = src / rel
    if path.is_file():
        for inc in _INCLUDE.findall(path.read_text(errors="replace")):
            beside = (path.parent / inc).relative_to(src).as_posix() if (path.parent / inc).is_file() else None
            if (src / inc).is_file():  # csrc-relative, as every include in csrc/ is written
                _included(src, inc, seen)
            elif beside is not None:  # relative to the including file
                _included(src, beside, seen)
    return seen


def _hash_files(h, src: Path, files) -> None:
    for rel in sorted(files):
        h.update(rel.encode())
        h.update((src / rel).read_bytes())


@cache
def _cc_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _c_identity() -> tuple:
    cc = c_compiler()
    return _c_flags(), cc, _cc_version(cc) if cc else "", sysconfig.get_platform()


def _object_path(rel: str) -> Path:
    """Where the object of C file `rel` goes: named by the file, what it includes, flags, compiler."""
    src = source_dir()
    h = hashlib.sha256()
    _hash_files(h, src, _included(src, rel))
    h.update(repr(_c_identity()).encode())
    return cache_dir() / "objects" / f"{rel.replace('/', '_').rsplit('.', 1)[0]}-{h.hexdigest()[:16]}.o"


def _fingerprint(spec: OpSpec) -> str:
    h = hashlib.sha256()
    src = source_dir()
    if spec.is_c_library:
        for rel in spec.c_sources:
            h.update(_object_path(rel).name.encode())
        h.update(repr(_c_identity()).encode())
        return h.hexdigest()[:16]
    sources = [src / s for s in spec.c_sources + spec.cpp_sources + spec.cuda_sources]
    # Headers an op can include: the shared ones and those beside its own sources.
    header_dirs = {src / "common", src / "bindings", *(f.parent for f in sources)}
    headers = [h for d in header_dirs if d.is_dir() for pat in ("*.h", "*.cuh") for h in d.glob(pat)]
    _hash_files(h, src, {str(f.relative_to(src)) for f in {*sources, *headers}})
    h.update(repr((_c_flags(), c_compiler(), spec.extra_cuda_cflags, os.environ.get("TORCH_CUDA_ARCH_LIST"))).encode())
    h.update(repr((torch.__version__, torch.version.cuda, sys.version_info[:2], sysconfig.get_platform())).encode())
    if spec.needs_cuda:
        found = nvcc()
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or _visible_gpu_capabilities()  # what the binary targets
        h.update(repr((found, nvcc_version(found) if found else None, archs)).encode())
    return h.hexdigest()[:16]


def build_dir(name: str) -> Path:
    return cache_dir() / f"{name}-{_fingerprint(OPS[name])}"


def _module_name(name: str) -> str:
    return f"zero_{name}"


def _built_library(name: str) -> Path:
    if OPS[name].is_c_library:
        return build_dir(name) / f"lib{_module_name(name)}.so"
    return build_dir(name) / f"{_module_name(name)}{'.so' if os.name != 'nt' else '.pyd'}"


def is_built(name: str) -> bool:
    """True when op `name` is already compiled for this exact source, flags and torch."""
    if missing(name) is not None:
        return False
    return _built_library(name).is_file()


def _cache_unusable(name: str, path: Path, exc: OSError) -> OpUnavailable:
    setting = os.environ.get("ZERO_CACHE_DIR")
    where = f"ZERO_CACHE_DIR={setting}" if setting else "the default ~/.cache/zero/ops (ZERO_CACHE_DIR is not set)"
    return OpUnavailable(f"op '{name}' ({OPS[name].what}) is unavailable: its build cache {path} cannot be "
                         f"created or written ({exc}); the cache comes from {where}. Point ZERO_CACHE_DIR at a "
                         f"writable directory.")


def _say(message: str) -> None:
    print(f"zero: {message}", file=sys.stderr, flush=True)


WAIT_REPORT_S = 15.0  # how often a process waiting for another's build says so


@contextmanager
def _locked(path: Path, name: str):
    """An exclusive lock on `path` for building op `name` (OpUnavailable if the cache is unusable).

    While another process holds it, say every WAIT_REPORT_S seconds which op we wait for and for
    how long, so that ranks waiting on one build do not look hung."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "w")
    except OSError as exc:
        raise _cache_unusable(name, path.parent, exc) from exc
    with fh:
        start = last = time.monotonic()
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - last >= WAIT_REPORT_S:
                    _say(f"waiting for native op '{name}', which another process is compiling "
                         f"({now - start:.0f} s so far; lock {path})")
                    last = now
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_jobs() -> int:
    """How many C files compile at once: $ZERO_BUILD_JOBS, else the CPUs this process may use.

    Raises:
        ValueError: ZERO_BUILD_JOBS is set to something other than a positive integer.
    """
    env = os.environ.get("ZERO_BUILD_JOBS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"ZERO_BUILD_JOBS must be a positive integer, got {env!r}")
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _compile_object(rel: str, obj: Path) -> str | None:
    """Compile C file `rel` into `obj` (complete or not at all); the failure's text, or None."""
    src = source_dir()
    obj.parent.mkdir(parents=True, exist_ok=True)
    tmp = obj.with_name(f"{obj.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [c_compiler(), *_c_flags(), "-I", str(src), "-c", str(src / rel), "-o", str(tmp)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return f"$ {' '.join(cmd)}\n{exc}"
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"$ {' '.join(cmd)}\n{r.stderr}"
    os.replace(tmp, obj)  # atomic: an object is there whole or not at all
    return None


def _compile_c(spec: OpSpec) -> list[Path]:
    """The objects of `spec`'s C files, compiling in parallel those not in the cache yet.

    Every file is attempted even when one fails, and what compiled is kept."""
    objects = {rel: _object_path(rel) for rel in spec.c_sources}
    todo = [rel for rel, obj in objects.items() if not obj.is_file()]
    if todo:
        with ThreadPoolExecutor(max_workers=min(build_jobs(), len(todo))) as pool:
            errors = dict(zip(todo, pool.map(lambda rel: _compile_object(rel, objects[rel]), todo)))
        failed = [rel for rel in todo if errors[rel] is not None]
        if failed:
            kept = len(todo) - len(failed)
            raise OpUnavailable(f"op '{spec.name}': compiling {failed[0]} failed"
                                f"{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}; the {kept} "
                                f"file(s) that compiled are kept for the next try:\n{errors[failed[0]]}")
    return list(objects.values())


def _link(name: str, objects: list[Path], library: Path) -> None:
    cmd = [c_compiler(), "-shared", *map(str, objects), "-o", str(library.with_suffix(".so.tmp"))]
    if "-fopenmp" in _c_flags():
        cmd.append("-fopenmp")
    cmd.append("-pthread")  # the aio op's workers (glibc before 2.34 keeps pthreads apart)
    cmd.append("-lm")  # pow, fmaf, sqrtf: linked here, not borrowed from the process that loads the library
    if sys.platform.startswith("linux"):
        cmd.append("-Wl,-z,defs")  # an undefined symbol fails the link, with the linker's message
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise OpUnavailable(f"op '{name}': linking failed:\n$ {' '.join(cmd)}\n{r.stderr}")
    os.replace(library.with_suffix(".so.tmp"), library)


def _import_library(name: str, path: Path) -> object:
    if OPS[name].is_c_library:
        from zero.ops.native import BINDINGS

        try:
            return BINDINGS[name](path)
        except (OSError, AttributeError) as exc:  # a missing symbol: the cached build does not fit
            raise OpUnavailable(f"op '{name}' was built in {path.parent} but does not load: {exc}") from exc
    modname = _module_name(name)
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # e.g. an undefined symbol: the cached build does not fit this process
        raise OpUnavailable(f"op '{name}' was built in {path.parent} but does not import: {exc}") from exc
    return module


def _build(name: str) -> object:
    spec = OPS[name]
    out = build_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if spec.is_c_library:
        todo = sum(not _object_path(rel).is_file() for rel in spec.c_sources)
        _say(f"compiling native op '{name}' ({spec.what}): {todo} of {len(spec.c_sources)} C files, "
             f"{min(build_jobs(), max(todo, 1))} at a time, into {out} (once per source version; "
             f"ZERO_CACHE_DIR moves the cache)")
        objects = _compile_c(spec)
        _link(name, objects, _built_library(name))
        module = _import_library(name, _built_library(name))
    else:
        _say(f"compiling native op '{name}' ({spec.what}) into {out}; this happens once per source/torch "
             f"version (set ZERO_CACHE_DIR to move the cache)")
        module = _build_extension(spec, out)
    _say(f"native op '{name}' built in {time.monotonic() - start:.1f} s")
    return module


def _build_extension(spec: OpSpec, out: Path) -> ModuleType:
    from torch.utils import cpp_extension

    src = source_dir()
    ldflags = [str(o) for o in _compile_c(spec)] if spec.c_sources else []
    if spec.c_sources and "-fopenmp" in _c_flags():
        ldflags.append("-fopenmp")
    try:
        return cpp_extension.load(
            name=_module_name(spec.name),
            sources=[str(src / s) for s in spec.cpp_sources + spec.cuda_sources],
            extra_cflags=["-O3"],  # and torch's own -std
            extra_cuda_cflags=list(spec.extra_cuda_cflags),
            extra_ldflags=ldflags,
            extra_include_paths=[str(src)],
            build_directory=str(out),
            with_cuda=spec.needs_cuda,
            verbose=os.environ.get("ZERO_VERBOSE_BUILD", "0") not in ("", "0"),
        )
    except Exception as exc:  # the compiler's own message is the useful part
        raise OpUnavailable(f"op '{spec.name}' failed to build in {out}: {exc}") from exc


_loaded: dict[str, object] = {}
_failed: dict[str, OpUnavailable] = {}  # tried once in this process, and why it failed


def load(name: str) -> object:
    """Return op `name`, building it first if needed: a CPU op's ctypes binding
    (zero/ops/native.py) or a CUDA op's torch extension module.

    A failure is remembered: once an op was found unavailable in this process, every later call
    raises the same OpUnavailable at once, without looking for a compiler or compiling again.

    Raises:
        OpUnavailable: the op cannot be built here (the message names the missing piece).
    """
    if name in _loaded:
        return _loaded[name]
    if name in _failed:
        raise _failed[name].with_traceback(None)
    if name not in OPS:
        raise KeyError(f"unknown op '{name}'; known ops: {', '.join(OPS)}")
    try:
        _loaded[name] = _load_once(name)
    except OpUnavailable as exc:
        _failed[name] = exc
        raise
    return _loaded[name]


def _load_once(name: str) -> object:
    reason = missing(name)
    if reason is not None:
        raise OpUnavailable(f"op '{name}' ({OPS[name].what}) is unavailable: {reason}")
    library = _built_library(name)
    if not library.is_file():
        with _locked(library.parent.with_suffix(".lock"), name):
            if not library.is_file():  # another process may have built it while we waited
                return _build(name)
    return _import_library(name, library)

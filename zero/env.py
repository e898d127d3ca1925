"""`python -m zero.env`: what this machine offers zero (like DeepSpeed's ds_report).

Prints torch and CUDA versions, the compilers found, the CPU's SIMD level, and for every native
op whether it is built, buildable, or unavailable and why. Builds nothing.
"""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

from zero.ops import builder


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return "not runnable"
    return out[-1] if "nvcc" in cmd[0] and out else (out[0] if out else "?")


def cpu_simd_level() -> str:
    """The widest SIMD level zero's CPU kernels can use here: avx512, avx2, or scalar."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"scalar ({machine}: portable C path)"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    if not flags:  # no /proc/cpuinfo: ask torch
        return torch.backends.cpu.get_cpu_capability().lower()
    return "scalar"


def op_status(name: str) -> str:
    """'built', 'buildable', or 'unavailable: <reason>' for op `name`."""
    if builder.is_built(name):
        return "built"
    reason = builder.missing(name)
    return "buildable (compiled on first use)" if reason is None else f"unavailable: {reason}"


def _build_jobs() -> str:
    try:
        return f"{builder.build_jobs()} (ZERO_BUILD_JOBS)"
    except ValueError as exc:
        return str(exc)


def report() -> str:
    cc = builder.c_compiler()
    nvcc = builder.nvcc()
    rows = [
        ("zero", __import__("zero").__version__),
        ("python", sys.version.split()[0]),
        ("torch", f"{torch.__version__} ({torch.__file__.rsplit('/', 2)[0]})"),
        ("torch CUDA", torch.version.cuda or "none (CPU build)"),
        ("GPUs visible", str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"),
        ("nvcc", f"{nvcc}: {_version([nvcc, '--version'])}" if nvcc else "not found"),
        ("C compiler", f"{cc}: {_version([cc, '--version'])}" if cc else "not found"),
        ("OpenMP", "yes" if "-fopenmp" in builder._c_flags() else "no (kernels run single-threaded)"),
        ("ninja", "yes" if builder._ninja_ok() else "no (pip install ninja; the CUDA ops need it)"),
        ("compiler jobs", _build_jobs()),
        ("CPU SIMD", cpu_simd_level()),
        ("op cache", str(builder.cache_dir())),
    ]
    width = max(len(k) for k, _ in rows + [(n, "") for n in builder.OPS])
    lines = ["zero environment", "-" * 16]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", "native ops", "-" * 10]
    for name, spec in builder.OPS.items():
        lines.append(f"{name:<{width}}  {op_status(name)}  [{spec.what}]")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())

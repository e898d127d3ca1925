"""Adam step throughput: zero's CPUAdam against torch's AdamW modes and DeepSpeed, measured
against this machine's memory-bandwidth ceiling.

An Adam step over fp32 state is memory bound: per parameter it reads param, grad, exp_avg and
exp_avg_sq and writes param, exp_avg and exp_avg_sq (28 bytes), plus 2 bytes when it also writes
a bf16 copy of the updated parameter (30 bytes). The ceiling is measured in the same run by a
stream pass (benchmarks/stream_pass.c, built here with zero's C compiler and flags and called
through ctypes; not part of zero's ops), a kernel with exactly the fp32 traffic of Adam (same
bytes per element, same threads and tiling) and almost no arithmetic. For each optimizer the
table prints:

    ms/step    best of --reps timed samples (after warm-up steps that allocate state and fault pages
               in); on the GPU each sample is --gpu-steps back-to-back steps between two
               synchronisations, divided by their number, so launch overhead overlaps the kernels
               as it does in training
    Mparam/s   parameters updated per second
    GB/s       useful bytes per second: 28 (fp32) or 30 (bf16 copy-out) bytes per parameter
    ceiling    the optimizer's GB/s as a fraction of the stream pass's, median over --reps pairs:
               each timed step is paired with a stream pass run just before it, because on a
               shared machine memory bandwidth drifts and only a pair sees the same conditions
    vs torch   speed-up over torch.optim.AdamW's default mode at the same size (single-tensor on
               the CPU, foreach on CUDA)

"bf16 copy-out" means the step also leaves a bf16 copy of the updated parameters (what ZeRO-Offload
ships back to the GPU): CPUAdam writes it in the same pass (`step(out16=...)`); the torch variants
need a second pass, `p16.copy_(p)`, which is timed with them.

DeepSpeed's DeepSpeedCPUAdam is measured when `import deepspeed` works. It is never a dependency;
to compare, install it next to (not over) your torch, e.g. into a separate directory:

    pip install --dry-run deepspeed            # check that it would not replace your torch
    pip install --no-deps --no-build-isolation --target /tmp/ds_pkgs deepspeed hjson einops msgpack
    PYTHONPATH=/tmp/ds_pkgs python benchmarks/bench_adam.py

(its CPU Adam op is JIT-compiled on first use, which needs ninja and a C++ compiler).

`--gpu` runs the same comparison on CUDA for zero.ops.FusedAdam against torch.optim.AdamW
(fused=True and foreach), with a device-to-device copy as the ceiling (bytes counted both ways);
without a GPU it says so and exits 0.

Usage:
    python benchmarks/bench_adam.py                     # 10M and 100M parameters
    python benchmarks/bench_adam.py --sizes 1M,10M --reps 5
    python benchmarks/bench_adam.py --gpu
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

FP32_BYTES = 28  # read p, g, m, v; write p, m, v
COPY_OUT_BYTES = 2  # + write the bf16 copy


@dataclass
class Row:
    name: str
    n: int
    copy_out: bool
    seconds: float | None  # None: not available here
    note: str = ""
    ceiling_gbps: float = 0.0  # the best ceiling measured in the same rounds as this row
    fraction: float = 0.0  # median over pairs of this row's GB/s over the ceiling run just before it

    @property
    def bytes(self) -> int:
        return self.n * (FP32_BYTES + (COPY_OUT_BYTES if self.copy_out else 0))

    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def paired_samples(steps: dict[str, Callable[[], None]], ceiling: Callable[[], None], reps: int, warmup: int,
                   sync: Callable[[], None] = lambda: None,
                   calls: int = 1) -> dict[str, list[tuple[float, float]]]:  # fmt: skip
    """`reps` pairs (seconds of the step, seconds of the ceiling run just before it) per step function.

    Each round times every function once, in a rotated order, each right after its own run of the
    ceiling kernel. On a shared machine both load and memory bandwidth drift from second to second;
    a pair sees the same conditions, so the ratio within a pair is far steadier than either time.
    A timed sample is `calls` back-to-back calls between two `sync()`s, divided by `calls`.
    """
    for step in [ceiling, *steps.values()]:
        for _ in range(warmup):
            step()
    sync()

    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls

    names = list(steps)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            ceiling_s = timed(ceiling)
            samples[name].append((timed(steps[name]), ceiling_s))
    return samples


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def optimizer_step_fn(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], n: int, grad: torch.Tensor,
                      copy_out: str | None) -> Callable[[], None]:  # fmt: skip
    """A closure doing one opt.step() on its own flat parameter of n elements (grad shared, read only).

    copy_out: None; "fused" (pass out16= to step); or "copy" (a separate p16.copy_(p) after the step).
    """
    gen = torch.Generator(device=grad.device).manual_seed(0)
    p = torch.randn(n, device=grad.device, generator=gen).requires_grad_()
    p.grad = grad  # every optimizer here only reads the gradient
    opt = make([p])
    if copy_out is None:
        return opt.step
    p16 = torch.empty(n, dtype=torch.bfloat16, device=grad.device)
    if copy_out == "fused":
        return lambda: opt.step(out16=[p16])

    def step_then_copy() -> None:
        opt.step()
        with torch.no_grad():
            p16.copy_(p)

    return step_then_copy


def measure(candidates: list[tuple[str, Callable | None, str | None, str]], n: int, device: str,
            ceiling: tuple[str, Callable[[], None]], reps: int, warmup: int, calls: int = 1) -> list[Row]:  # fmt: skip
    """Time every available candidate (name, factory, copy-out mode, note), each paired with a run
    of the ceiling kernel just before it (see `paired_samples`). Returns one row per candidate."""
    grad = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(1)) * 1e-2
    steps: dict[str, Callable[[], None]] = {ceiling[0]: ceiling[1]}
    notes: dict[str, str] = {}
    for name, make, mode, note in candidates:
        label = name + (" +copy" if mode == "copy" else "")
        if make is None:
            notes[label] = note
            continue
        try:
            steps[label] = optimizer_step_fn(make, n, grad, mode)
        except Exception as exc:  # an optimizer that cannot run here is reported, not fatal
            notes[label] = f"failed: {str(exc).splitlines()[0][:80]}"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples = paired_samples(steps, ceiling[1], reps, warmup, sync, calls)
    copy_out = any(mode is not None for _, _, mode, _ in candidates)  # the bf16 copy-out round
    all_ceiling_s = [c for pairs in samples.values() for _, c in pairs]
    ceiling_gbps = n * FP32_BYTES / min(all_ceiling_s) / 1e9 if all_ceiling_s else float("nan")
    rows = []
    for name, _, mode, _ in candidates:
        label = name + (" +copy" if mode == "copy" else "")
        pairs = samples.get(label)
        row = Row(label, n, copy_out, min(t for t, _ in pairs) if pairs else None, notes.get(label, ""), ceiling_gbps)
        if pairs:  # (bytes / t) / (28 n / t_ceiling), the median over the pairs
            row.fraction = statistics.median(row.bytes * c / (n * FP32_BYTES * t) for t, c in pairs)
        rows.append(row)
    del steps, grad, samples
    free_memory()
    return rows


# ----------------------------------------------------------------------------- CPU


def stream_pass(num_threads: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """Build benchmarks/stream_pass.c with zero's C compiler and flags; return a function that runs
    it over four contiguous float32 CPU tensors of one size."""
    from zero.ops.builder import _c_flags, c_compiler

    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC): the stream-pass ceiling needs one")
    source = Path(__file__).resolve().parent / "stream_pass.c"
    library = Path(tempfile.mkdtemp(prefix="zero_bench_")) / "stream_pass.so"
    subprocess.run([cc, *_c_flags(), "-shared", str(source), "-o", str(library)], check=True)
    fn = ctypes.CDLL(str(library)).zero_stream_pass
    fn.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int]
    fn.restype = ctypes.c_int

    def run(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        assert all(t.is_contiguous() and t.dtype == torch.float32 and t.numel() == param.numel()
                   for t in (param, grad, exp_avg, exp_avg_sq))  # fmt: skip
        fn(param.numel(), param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), num_threads)

    return run


def deepspeed_cpu_adam() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam if it imports and its op builds here, else (None, why not)."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or deepspeed failing its own import checks
        return None, f"not importable ({type(exc).__name__}); see this script's docstring"
    try:
        DeepSpeedCPUAdam([torch.zeros(16, requires_grad=True)])  # builds/loads its op
    except Exception as exc:
        return None, f"its CPU Adam op did not build: {str(exc).splitlines()[0][:80]}"
    return DeepSpeedCPUAdam, ""


def cpu_rows(n: int, reps: int, warmup: int, num_threads: int, with_deepspeed: bool) -> list[Row]:
    from zero.ops.cpu_adam import CPUAdam, simd_levels

    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    best = simd_levels()[0]
    torch_fused_ok = True
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        torch_fused_ok = False
    ds_cls, ds_note = deepspeed_cpu_adam() if with_deepspeed else (None, "skipped (--no-deepspeed)")
    factories = [
        (f"zero CPUAdam ({best})", lambda ps: CPUAdam(ps, num_threads=num_threads, **kw), "fused", ""),
        ("torch AdamW (default)", lambda ps: torch.optim.AdamW(ps, **kw), "copy", ""),
        ("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **kw), "copy", ""),
        ("torch AdamW fused", (lambda ps: torch.optim.AdamW(ps, fused=True, **kw)) if torch_fused_ok else None,
         "copy", "" if torch_fused_ok else "fused=True unsupported on CPU in this torch"),
        ("DeepSpeedCPUAdam", (lambda ps: ds_cls(ps, adamw_mode=True, **kw)) if ds_cls else None, "copy", ds_note),
    ]
    # the ceiling: the stream pass over its own four buffers, timed in the same rounds
    bufs = [torch.rand(n) for _ in range(4)]
    run_stream_pass = stream_pass(num_threads)
    ceiling = ("stream pass", lambda: run_stream_pass(*bufs))
    rows = []
    for copy_out in (False, True):
        candidates = [(name, make, mode if copy_out else None, note) for name, make, mode, note in factories]
        rows += measure(candidates, n, "cpu", ceiling, reps, warmup)
    ceiling = bufs = None
    free_memory()
    return rows


# ----------------------------------------------------------------------------- GPU


def gpu_rows(n: int, reps: int, warmup: int, calls: int) -> list[Row]:
    try:
        from zero.ops import FusedAdam
    except ImportError as exc:
        FusedAdam, fused_note = None, f"zero.ops.FusedAdam not importable: {exc}"
    else:
        fused_note = ""
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    factories = [
        ("zero FusedAdam", (lambda ps: FusedAdam(ps, **kw)) if FusedAdam else None, "fused", fused_note),
        ("torch AdamW (default)", lambda ps: torch.optim.AdamW(ps, **kw), "copy", ""),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **kw), "copy", ""),
    ]
    # the ceiling: a device-to-device copy moving the same 28 bytes per parameter (14 read + 14 written)
    src = torch.empty(n * FP32_BYTES // 8, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ceiling = ("device copy", lambda: dst.copy_(src))
    rows = []
    for copy_out in (False, True):
        candidates = [(name, make, mode if copy_out else None, note) for name, make, mode, note in factories]
        rows += measure(candidates, n, "cuda", ceiling, reps, warmup, calls)
    ceiling = src = dst = None  # free the device buffers before the next round
    free_memory()
    return rows


# ----------------------------------------------------------------------------- report


def print_table(title: str, rows: list[Row], ceiling_name: str) -> None:
    print(f"\n{title}")
    header = f"{'optimizer':32s} {'params':>7s} {'copy-out':>8s} {'ms/step':>9s} {'Mparam/s':>9s} {'GB/s':>7s} " \
             f"{'ceiling':>8s} {'vs torch':>8s}"  # fmt: skip
    print(header)
    print("-" * len(header))
    baseline = {(r.n, r.copy_out): r.seconds for r in rows if r.name.startswith("torch AdamW (default)")}
    last_round = None
    for r in rows:
        if (r.n, r.copy_out) != last_round:
            last_round = (r.n, r.copy_out)
            what = "with bf16 copy-out" if r.copy_out else "fp32 only"
            print(f"  [{what}] ceiling, {ceiling_name}: best {r.ceiling_gbps:.1f} GB/s in these rounds")
        size = f"{r.n / 1e6:g}M"
        out = "bf16" if r.copy_out else "-"
        if r.seconds is None:
            print(f"{r.name:32s} {size:>7s} {out:>8s} {'n/a':>9s}   {r.note}")
            continue
        base = baseline.get((r.n, r.copy_out))
        vs = f"{base / r.seconds:7.2f}x" if base else "     n/a"
        print(f"{r.name:32s} {size:>7s} {out:>8s} {r.seconds * 1e3:9.2f} {r.n / r.seconds / 1e6:9.1f} "
              f"{r.gbps():7.1f} {r.fraction:7.1%} {vs:>8s}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M", help="comma-separated parameter counts, e.g. 1M,10M,100M")
    parser.add_argument("--reps", type=int, default=10, help="timed samples per measurement (the best is kept)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch.get_num_threads())")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    parser.add_argument("--gpu", action="store_true", help="benchmark zero.ops.FusedAdam on CUDA instead")
    parser.add_argument("--gpu-steps", type=int, default=20,
                        help="--gpu: back-to-back steps per timed sample (launch overhead overlaps the kernels)")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu: no CUDA device is available here (torch.cuda.is_available() is False); nothing to measure.")
            return 0
        name = torch.cuda.get_device_name()
        for n in sizes:
            print_table(f"GPU Adam step, {name}, torch {torch.__version__}, {args.gpu_steps} steps per sample",
                        gpu_rows(n, args.reps, args.warmup, args.gpu_steps),
                        "device-to-device copy (read + write bytes)")  # fmt: skip
        return 0

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    from zero.ops.cpu_adam import simd_levels

    print(f"CPU Adam step: {threads} threads, torch {torch.__version__}, SIMD levels here: {simd_levels()}, "
          f"{os.cpu_count()} logical CPUs")  # fmt: skip
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5:
        print(f"note: load average {load:.1f} before starting; other processes on this machine make every number "
              f"below noisier and lower (best-of-{args.reps} timings soften this)")  # fmt: skip
    for n in sizes:
        rows = cpu_rows(n, args.reps, args.warmup, threads, not args.no_deepspeed)
        print_table(f"{n / 1e6:g}M parameters", rows, "stream pass (28 B/param, same threads and tiles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

`--formats` measures zero's CPU step (`zero.ops.adam.adam_step`) in each state format instead (see
[Note: state formats] in csrc/adam/adam_formats.h), in the offload case: a bf16 gradient and a bf16
copy-out. Fewer bytes per element should make a faster step. Bytes per element, reading param,
grad, exp_avg, exp_avg_sq (+ the 8-bit scales) and writing param, exp_avg, exp_avg_sq, out16
(+ the scales); an 8-bit moment has one fp32 scale per 256 elements, so m and v add 2 x 4 / 256
bytes per element each way:

    master  moments              read                   written                bytes/element
    fp32    fp32                 4 + 2 + 4 + 4          4 + 4 + 4 + 2          28
    fp32    bf16                 4 + 2 + 2 + 2          4 + 2 + 2 + 2          20
    bf16    bf16 (SR / nearest)  2 + 2 + 2 + 2          2 + 2 + 2 + 2          16
    fp32    int8                 4 + 2 + 1 + 1 + 8/256  4 + 1 + 1 + 2 + 8/256  16.0625
    bf16    int8                 2 + 2 + 1 + 1 + 8/256  2 + 1 + 1 + 2 + 8/256  12.0625

Each format has its own ceiling: the stream pass with exactly its traffic (the same element size
per stream, the same threads and tiles, the copy-out streamed past the caches as the fp32 step
writes it), paired with each timed step as above. The table prints bytes/element, ms/step (best of
--reps), Gelem/s, GB/s, the best ceiling GB/s, the step's share of its own ceiling (median over
pairs), and elements/s against the fp32-state step in the same rounds, beside the most the bytes
allow (28 / bytes per element). It is also written to benchmarks/results/cpu_adam_formats.md.
The targets, checked under the table: each low-precision format at least 1.5x the
fp32-state elements/s (out of reach by bytes alone for fp32 master + bf16 moments: 28/20 = 1.4x),
and the 8-bit formats at least 80% of their own ceiling.

Usage:
    python benchmarks/bench_adam.py                     # 10M and 100M parameters
    python benchmarks/bench_adam.py --sizes 1M,10M --reps 5
    python benchmarks/bench_adam.py --gpu
    python benchmarks/bench_adam.py --formats --sizes 100M
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import itertools
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


def paired_samples(steps: dict[str, Callable[[], None]],
                   ceiling: Callable[[], None] | dict[str, Callable[[], None]], reps: int, warmup: int,
                   sync: Callable[[], None] = lambda: None,
                   calls: int = 1) -> dict[str, list[tuple[float, float]]]:  # fmt: skip
    """`reps` pairs (seconds of the step, seconds of the ceiling run just before it) per step function.

    Each round times every function once, in a rotated order, each right after its own run of the
    ceiling kernel. On a shared machine both load and memory bandwidth drift from second to second;
    a pair sees the same conditions, so the ratio within a pair is far steadier than either time.
    A timed sample is `calls` back-to-back calls between two `sync()`s, divided by `calls`.
    `ceiling`: one kernel for every step, or one per step (a dict with the keys of `steps`).
    """
    ceilings = ceiling if isinstance(ceiling, dict) else dict.fromkeys(steps, ceiling)
    for step in [*(ceiling.values() if isinstance(ceiling, dict) else [ceiling]), *steps.values()]:
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
            ceiling_s = timed(ceilings[name])
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


@functools.cache
def stream_pass_library() -> ctypes.CDLL:
    """benchmarks/stream_pass.c, built (once per process) with zero's C compiler and flags."""
    from zero.ops.builder import _c_flags, c_compiler

    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC): the stream-pass ceiling needs one")
    source = Path(__file__).resolve().parent / "stream_pass.c"
    library = Path(tempfile.mkdtemp(prefix="zero_bench_")) / "stream_pass.so"
    subprocess.run([cc, *_c_flags(), "-shared", str(source), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.zero_stream_pass.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int]
    lib.zero_stream_pass.restype = ctypes.c_int
    # n, param, param_size, grad, grad_size, exp_avg, exp_avg_sq, state_size, m_scale, v_scale, out16, threads
    lib.zero_stream_pass_sized.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    lib.zero_stream_pass_sized.restype = ctypes.c_int
    return lib


def stream_pass(num_threads: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """A function that runs benchmarks/stream_pass.c's fp32 pass (28 bytes per element) over four
    contiguous float32 CPU tensors of one size."""
    fn = stream_pass_library().zero_stream_pass

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


# ----------------------------------------------------------------------------- CPU, state formats


def state_formats() -> list:
    """The formats --formats measures, the fp32-state baseline first (zero.ops.adam_formats.AdamFormat)."""
    from zero.ops.adam_formats import AdamFormat

    return [AdamFormat("fp32", "fp32"), AdamFormat("fp32", "bf16"), AdamFormat("bf16", "bf16"),
            AdamFormat("bf16", "bf16", stochastic=False), AdamFormat("fp32", "int8"),
            AdamFormat("bf16", "int8")]  # fmt: skip


def format_label(fmt) -> str:
    """"master / moments", and how bf16 values are rounded where there are any: "bf16 / int8 (stochastic)"."""
    rounding = " (stochastic)" if fmt.stochastic else " (nearest)"
    return f"{fmt.master} / {fmt.state}" + (rounding if "bf16" in (fmt.master, fmt.state) else "")


@dataclass(frozen=True)
class Traffic:
    """The memory traffic of one Adam step, by stream: stream_pass.c's zero_stream_pass_sized arguments."""

    param: int  # bytes per element of the master, read and written
    grad: int  # bytes per element of the gradient, read
    state: int  # bytes per element of exp_avg and of exp_avg_sq, each read and written
    scale_block: int = 0  # 8-bit moments: elements per fp32 scale of m and of v (read and written); 0: none
    out16: bool = True  # a 16-bit copy of the updated master is written

    def blocks(self, n: int) -> int:
        """Scales per moment over n elements (one per started block)."""
        return -(-n // self.scale_block) if self.scale_block else 0

    def bytes(self, n: int) -> int:
        """Bytes one step over n elements moves: param, m, v both ways, grad in, out16 out, the scales both ways."""
        return n * (2 * self.param + self.grad + 4 * self.state + 2 * self.out16) + 2 * 2 * 4 * self.blocks(n)

    def per_element(self) -> float:
        scales = 2 * 2 * 4 / self.scale_block if self.scale_block else 0.0
        return 2 * self.param + self.grad + 4 * self.state + 2 * self.out16 + scales


def format_traffic(fmt) -> Traffic:
    """The traffic of a step in `fmt` with a bf16 gradient and a bf16 copy-out (the offload case)."""
    from zero.ops.adam_formats import Q8_BLOCK

    return Traffic(fmt.master_dtype.itemsize, 2, fmt.state_dtype.itemsize, Q8_BLOCK if fmt.quantized else 0)


@dataclass
class FormatRow:
    name: str
    n: int
    traffic: Traffic
    seconds: float  # best of the timed samples
    ceiling_gbps: float  # the best stream pass with this format's traffic, in the same rounds
    fraction: float  # median over pairs of the stream pass's time over the step's (the same bytes)

    def gbps(self) -> float:
        return self.traffic.bytes(self.n) / self.seconds / 1e9


def format_step_fn(fmt, grad: torch.Tensor, out16: torch.Tensor, num_threads: int) -> Callable[[], None]:
    """A closure doing one CPU adam_step on its own master and moments in `fmt` (grad shared, read
    only; out16 shared, written only). The first step runs here, with the argument checks."""
    from zero.ops.adam import AdamArgs, adam_step
    from zero.ops.adam_formats import new_moment, new_scales

    n = grad.numel()
    param = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(fmt.master_dtype)
    m, v = new_moment(n, fmt, device="cpu"), new_moment(n, fmt, device="cpu")
    kw = dict(out16=out16, num_threads=num_threads, m_scale=new_scales(n, fmt, device="cpu"),
              v_scale=new_scales(n, fmt, device="cpu"))  # fmt: skip
    steps = itertools.count(1)

    def args() -> AdamArgs:
        return AdamArgs(step=next(steps), lr=1e-3, weight_decay=0.01, fmt=fmt)

    adam_step(param, grad, m, v, args(), **kw)
    return lambda: adam_step(param, grad, m, v, args(), checked=False, **kw)


def format_stream_pass(traffic: Traffic, n: int, scratch: dict[str, torch.Tensor],
                       num_threads: int) -> Callable[[], None]:  # fmt: skip
    """A closure running the stream pass with `traffic` over n elements of the byte buffers `scratch`
    (shared by every format's pass: one runs at a time)."""
    fn = stream_pass_library().zero_stream_pass_sized
    need = {"param": n * traffic.param, "grad": n * traffic.grad, "exp_avg": n * traffic.state,
            "exp_avg_sq": n * traffic.state, "m_scale": 4 * traffic.blocks(n), "v_scale": 4 * traffic.blocks(n),
            "out16": 2 * n}  # fmt: skip
    assert all(scratch[k].numel() >= size for k, size in need.items())
    ptr = {k: t.data_ptr() for k, t in scratch.items()}
    args = (n, ptr["param"], traffic.param, ptr["grad"], traffic.grad, ptr["exp_avg"], ptr["exp_avg_sq"], traffic.state,
            ptr["m_scale"] if traffic.scale_block else None, ptr["v_scale"] if traffic.scale_block else None,
            ptr["out16"] if traffic.out16 else None, num_threads)  # fmt: skip

    def run() -> None:
        if fn(*args) != 0:
            raise RuntimeError(f"zero_stream_pass_sized rejected {traffic}")

    return run


def format_rows(n: int, reps: int, warmup: int, num_threads: int) -> list[FormatRow]:
    """Every state format's step over n elements, each paired with the stream pass of its own traffic."""
    from zero.ops.adam_formats import q8_blocks

    formats = state_formats()
    traffics = {format_label(fmt): format_traffic(fmt) for fmt in formats}
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2).to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    # the stream passes' buffers, as bytes, sized for the widest format; filled, so that their pages exist
    widest = {"param": 4 * n, "grad": 2 * n, "exp_avg": 4 * n, "exp_avg_sq": 4 * n, "m_scale": 4 * q8_blocks(n),
              "v_scale": 4 * q8_blocks(n), "out16": 2 * n}  # fmt: skip
    scratch = {k: torch.full((size,), 1, dtype=torch.uint8) for k, size in widest.items()}
    steps = {format_label(fmt): format_step_fn(fmt, grad, out16, num_threads) for fmt in formats}
    ceilings = {name: format_stream_pass(t, n, scratch, num_threads) for name, t in traffics.items()}
    samples = paired_samples(steps, ceilings, reps, warmup)
    rows = []
    for name, pairs in samples.items():
        t = traffics[name]
        rows.append(FormatRow(name, n, t, min(s for s, _ in pairs), t.bytes(n) / min(c for _, c in pairs) / 1e9,
                              statistics.median(c / s for s, c in pairs)))  # fmt: skip
    del steps, ceilings, scratch, grad, out16, samples
    free_memory()
    return rows


FORMAT_COLUMNS = ["master / moments", "B/elem", "ms/step", "Gelem/s", "GB/s", "ceiling GB/s", "of ceiling",
                  "vs fp32 states", "bytes allow"]  # fmt: skip


def format_table_cells(rows: list[FormatRow]) -> list[list[str]]:
    """The table's cells, one list per row; "vs fp32 states" compares elements/s with the first
    (fp32-state) row of the same rounds, "bytes allow" is the most its bytes permit (28 / B)."""
    base = rows[0]
    return [[r.name, f"{r.traffic.per_element():g}", f"{r.seconds * 1e3:.2f}", f"{r.n / r.seconds / 1e9:.3f}",
             f"{r.gbps():.1f}", f"{r.ceiling_gbps:.1f}", f"{r.fraction:.0%}", f"{base.seconds / r.seconds:.2f}x",
             f"{base.traffic.per_element() / r.traffic.per_element():.2f}x"] for r in rows]  # fmt: skip


def format_checks(rows: list[FormatRow]) -> list[str]:
    """The targets, one line per low-precision format: >= 1.5x the fp32-state elements/s,
    and for 8-bit moments >= 80% of the format's own ceiling."""
    base, lines = rows[0], []
    for r in rows[1:]:
        speedup, bound = base.seconds / r.seconds, base.traffic.per_element() / r.traffic.per_element()
        verdict = "met" if speedup >= 1.5 else "missed"
        verdict += f"; its bytes allow at most {bound:.2f}x" if speedup < 1.5 and bound < 1.5 else ""
        line = f"{r.name}: {speedup:.2f}x the fp32-state elements/s (target 1.5x: {verdict})"
        if r.traffic.scale_block:
            line += f"; {r.fraction:.0%} of its ceiling (target 80%: {'met' if r.fraction >= 0.8 else 'missed'})"
        lines.append(line)
    return lines


def print_format_table(title: str, rows: list[FormatRow]) -> None:
    print(f"\n{title}")
    cells = [FORMAT_COLUMNS, *format_table_cells(rows)]
    widths = [max(len(line[j]) for line in cells) for j in range(len(FORMAT_COLUMNS))]
    for i, line in enumerate(cells):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for line in format_checks(rows):
        print(f"  {line}")


def write_format_results(results: list[tuple[str, list[FormatRow]]]) -> None:
    """benchmarks/results/cpu_adam_formats.md: one table per size, stamped as report.py stamps its results."""
    import report

    sections = []
    for title, rows in results:
        checks = "\n".join(f"- {line}" for line in format_checks(rows))
        sections.append(f"## {title}\n\n{report._table(FORMAT_COLUMNS, format_table_cells(rows))}\n\n{checks}")
    body = "\n\n".join(sections) + (
        "\n\nEvery step reads a bf16 gradient and writes a bf16 copy of the updated master (the offload case). "
        "B/elem counts param, grad, exp_avg, exp_avg_sq read and param, exp_avg, exp_avg_sq, out16 written, plus two "
        "fp32 scales per 256 elements each way for 8-bit moments. Each format's ceiling is a stream pass with exactly "
        "its traffic, threads and tiles (benchmarks/stream_pass.c), run beside each timed step; \"of ceiling\" is the "
        "median over those pairs. \"vs fp32 states\" compares elements/s with the fp32-state step of the same rounds; "
        "\"bytes allow\" is 28 / B/elem, what it would be were both at their ceilings. Produced by "
        "`python benchmarks/bench_adam.py --formats`.")  # fmt: skip
    report._write("cpu_adam_formats", "CPU Adam throughput in each state format against its bandwidth ceiling", body,
                  None)  # fmt: skip


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
    parser.add_argument("--formats", action="store_true",
                        help="measure zero's CPU step in each state format against its own stream pass instead, and "
                             "write benchmarks/results/cpu_adam_formats.md")  # fmt: skip
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
    if args.formats:
        results = []
        for n in sizes:
            title = f"{n / 1e6:g}M elements, {threads} thread{'s' if threads > 1 else ''}, {simd_levels()[0]}"
            results.append((title, format_rows(n, args.reps, args.warmup, threads)))
            print_format_table(title, results[-1][1])
        write_format_results(results)
        return 0
    for n in sizes:
        rows = cpu_rows(n, args.reps, args.warmup, threads, not args.no_deepspeed)
        print_table(f"{n / 1e6:g}M parameters", rows, "stream pass (28 B/param, same threads and tiles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""1-bit Adam: bytes sent per step and per phase against Adam at stages 0-2, the pack/unpack
kernels against the memory-bandwidth ceiling, and step time over a simulated slow link.

    python benchmarks/bench_onebit.py [--layers 4] [--embd 256] [--gbit 1.0] [--write]

- Bytes: `engine.comm_report()` of the step before the freeze and of one after it, turned into
  the bytes a rank puts on the wire with ring algorithms (an all-reduce sends 2 (N-1)/N of its
  size, a reduce-scatter, all-gather or all-to-all (N-1)/N), bf16 training so that the exact
  exchange is 16-bit, at stages 1-2 also with `compress_param_gather`; and whole runs that
  freeze at 15% of their steps, every step's bytes summed, in bf16 and fp32, against Adam's.
- Kernels: `pack` (reads x and the error, writes the error, the bits and the scales: 12.125 bytes
  per element) and `unpack_mean` of 4 messages (0.5 + 4 bytes per element) on 10M elements,
  against a ceiling measured in the same run: an in-place err.add_(x), the same 12 bytes per
  element without a separate output, with the same threads.
- Slow link: gloo on one machine has no network to speak of, so the link is simulated. Every
  collective of the data group sleeps, before it starts, for its wire bytes at `--gbit` Gbit/s
  (one link, nothing else on it, no latency term). That charges Adam and 1-bit Adam by the same
  rule, so the step-time ratio shows where compression wins.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero.testing.dist import DistPool  # noqa: E402
from zero.testing.models import GPT, GPTConfig  # noqa: E402

GRAD_KEYS = ("all_reduce_sum", "reduce_scatter")


def wire_factor(name: str, world: int) -> float:
    """Bytes a rank puts on the wire per logical byte of a collective, with ring algorithms: an
    all-reduce is a reduce-scatter and an all-gather; each moves (N-1)/N of its size."""
    return (2.0 if name.startswith("all_reduce") else 1.0) * (world - 1) / world


def _slow_link(gbit: float) -> None:
    """Charge every data-group collective its wire bytes at `gbit` Gbit/s (see the docstring)."""
    from zero.parallel import comm

    original = comm.Comm._count

    def count(self, name, t):
        original(self, name, t)
        if self.data is None and self.world_size > 1:  # not the control/io side groups
            time.sleep(t.numel() * t.element_size() * wire_factor(name, self.world_size) * 8 / (gbit * 1e9))

    comm.Comm._count = count


def run(stage: int, optimizer: str, layers: int, embd: int, steps: int, freeze: int, gbit: float | None,
        gather: bool = False, dtype: str = "bf16"):
    """One rank's run: (comm report per step, median step seconds after the freeze, Psi).
    `gather`: OneBitAdam's compress_param_gather; `dtype`: "bf16" or "fp32" training."""
    import zero

    if gbit:
        _slow_link(gbit)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=layers, n_head=max(1, embd // 64), n_embd=embd))
    psi = sum(p.numel() for p in model.parameters())
    params = {"lr": 1e-4, **({"freeze_step": freeze} if optimizer == "OneBitAdam" else {}),
              **({"compress_param_gather": True} if gather else {})}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}})
    g = torch.Generator().manual_seed(rank)
    reports, times = [], []
    for step in range(steps):
        x = torch.randint(0, 4096, (4, 65), generator=g)
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        if step > freeze:
            times.append(time.perf_counter() - start)
        reports.append(engine.comm_report())
    return reports, statistics.median(times) if times else 0.0, psi


def _bytes(report: dict, keys, world: int = 2) -> int:
    """Wire bytes per rank of the collectives whose name passes `keys`."""
    return int(sum(v["bytes"] * wire_factor(k, world) for k, v in report.items() if keys(k)))


def kernels(n: int = 10_000_000, reps: int = 10) -> list[tuple[str, float, float]]:
    """(name, seconds, GB/s) for pack, unpack_mean of 4, and the ceiling."""
    from zero.onebit.compress import BLOCK, packed_bytes, scale_count
    from zero.ops.onebit import pack_into, unpack_mean_into

    x, err = torch.randn(n), torch.zeros(n)
    bits, scales = torch.empty(packed_bytes(n), dtype=torch.uint8), torch.empty(scale_count(n))
    many, many_scales, out = bits.repeat(4, 1), scales.repeat(4, 1), torch.empty(n)
    cases = [("ceiling: err.add_(x) (12 B/element)", lambda: err.add_(x), 12.0),
             ("pack (12.125 B/element)", lambda: pack_into(x, err, bits, scales, BLOCK), 12.125),
             ("unpack_mean of 4 (4.5 B/element)", lambda: unpack_mean_into(many, many_scales, out, BLOCK), 4.5)]
    rows = []
    for name, fn, per in cases:
        fn()
        best = min(_timed(fn) for _ in range(reps))
        rows.append((name, best, n * per / best / 1e9))
    return rows


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--gbit", type=float, default=1.0, help="simulated link speed for the step-time table")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="also write benchmarks/results/onebit.md")
    args = parser.parse_args(argv)
    freeze = 2
    lines = [f"GPT {args.layers}x{args.embd}, 2 gloo ranks, bf16, torch {torch.__version__}", ""]

    lines += ["Bytes each rank sends per step (ring algorithms: an all-reduce sends 2 (N-1)/N of its size, the "
              "other collectives (N-1)/N), before and after the freeze:", "",
              "| stage | optimizer | gradient exchange | parameter exchange | total | gradient exchange vs Adam |",
              "| --- | --- | --- | --- | --- | --- |"]
    pool = DistPool(2)
    try:
        gather = "OneBitAdam + compress_param_gather, after the freeze"
        for stage in (0, 1, 2):
            adam = pool.run(run, stage, "Adam", args.layers, args.embd, freeze + 2, freeze, None, timeout=900)[0]
            onebit = pool.run(run, stage, "OneBitAdam", args.layers, args.embd, freeze + 2, freeze, None, timeout=900)[0]
            exact = adam[0][-1]
            rows = [("Adam", exact), ("OneBitAdam, after the freeze", onebit[0][-1])]
            if stage > 0:
                rows.append((gather, pool.run(run, stage, "OneBitAdam", args.layers, args.embd, freeze + 2, freeze,
                                              None, True, timeout=900)[0][0][-1]))
            g_exact = _bytes(exact, lambda k: k in GRAD_KEYS)
            for name, rep in rows:
                grad = _bytes(rep, lambda k: k in GRAD_KEYS or (k.startswith("onebit") and "param" not in k))
                params = _bytes(rep, lambda k: k == "all_gather" or k.startswith("onebit_param"))
                total = _bytes(rep, lambda k: True)
                ratio = f"{g_exact / grad:.1f}x less" if grad != g_exact else "1x"
                lines.append(f"| {stage} | {name} | {grad:,} | {params:,} | {total:,} | {ratio} |")
        psi = adam[2]

        # whole runs, every step's bytes summed: 40 steps freezing after 6 (15%)
        steps, frozen_after = 40, 6
        lines += ["", f"Whole runs of {steps} steps, the variance frozen after {frozen_after} (15%), every training "
                  f"step's wire bytes summed ({psi:,} parameters; the broadcast of the initial weights, the same "
                  f"for both and once per run, is left out and shown apart):", "",
                  "| stage | training | Adam | OneBitAdam | less than Adam | initial broadcast |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for stage, dtype, with_gather in ((0, "bf16", False), (0, "fp32", False), (2, "bf16", True),
                                          (2, "fp32", True)):
            total = {}
            for optimizer in ("Adam", "OneBitAdam"):
                reports = pool.run(run, stage, optimizer, args.layers, args.embd, steps, frozen_after, None,
                                   with_gather and optimizer == "OneBitAdam", dtype, timeout=900)[0][0]
                total[optimizer] = sum(_bytes(r, lambda k: k != "broadcast") for r in reports)
                initial = sum(_bytes(r, lambda k: k == "broadcast") for r in reports)
            label = "OneBitAdam + compress_param_gather" if with_gather else "OneBitAdam"
            lines.append(f"| {stage} | {dtype} | {total['Adam']:,} | {total['OneBitAdam']:,} ({label}) | "
                         f"{total['Adam'] / total['OneBitAdam']:.2f}x | {initial:,} |")
    finally:
        pool.close()
    lines += ["", "With bf16 training Adam's exchange is 16-bit, and a run that spends 15% of its steps exact "
              "cannot send less than 1 / (0.15 + 0.85 / 15.5) = 4.9x less; with fp32 training (32-bit exchange) "
              "the bound is 1 / (0.15 + 0.85 / 31) = 5.6x.", ""]

    lines += ["Kernels on 10M elements (best of 10):", "", "| kernel | ms | GB/s |", "| --- | --- | --- |"]
    for name, seconds, gbps in kernels():
        lines.append(f"| {name} | {seconds * 1e3:.2f} | {gbps:.1f} |")

    lines += ["", f"Step time over a simulated {args.gbit:g} Gbit/s link (median after the freeze):", "",
              "| stage | Adam ms | OneBitAdam ms | speed-up |", "| --- | --- | --- | --- |"]
    pool = DistPool(2)
    try:
        for stage, with_gather in ((0, False), (1, False), (1, True), (2, False), (2, True)):
            a = statistics.median(r[1] for r in pool.run(run, stage, "Adam", args.layers, args.embd, args.steps, freeze,
                                                         args.gbit, timeout=900))
            b = statistics.median(r[1] for r in pool.run(run, stage, "OneBitAdam", args.layers, args.embd, args.steps,
                                                         freeze, args.gbit, with_gather, timeout=900))
            name = f"{stage}{' + compress_param_gather' if with_gather else ''}"
            lines.append(f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x |")
    finally:
        pool.close()
    text = "\n".join(lines)
    print(text)
    if args.write:
        from report import RESULTS, _write

        RESULTS.mkdir(exist_ok=True)
        _write("onebit", "1-bit Adam: bytes, kernels and step time over a slow link", text, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

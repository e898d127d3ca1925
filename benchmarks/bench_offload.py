"""ZeRO-Offload step breakdown: forward/backward, gradient copy-out, CPU Adam, parameter copy-in.

    python benchmarks/bench_offload.py                 # CPU: a small GPT, the breakdown
    python benchmarks/bench_offload.py --gpu           # one GPU: breakdown, TFLOPS, largest models

One process, one device (a world of one). For each configuration it trains a few warm-up steps,
then times `--steps` steps and prints per-step milliseconds for forward, backward, the optimizer
step, and inside the step the time spent waiting for gradient copies, in CPU Adam, and waiting
for parameter copies (gradient copies start during backward, and the copy-back is pipelined tile
by tile while later tiles are updated). A configuration that runs out of memory is reported as
such and the others go on.

On a CPU-only machine host and device are the same memory, so the copies are plain memcpy and
the numbers show the cost of the offload path itself, not PCIe. With `--gpu` it also reports
achieved TFLOPS (6 * params * tokens per step, plus attention) and searches for the largest GPT
that trains with (a) stage 2 + optimizer offload, (b) stage 3 + optimizer and parameter offload,
(c) no offload, at a fixed width: zero's estimator proposes the deepest fit, one step checks it,
and the depth is bisected below it if it fails (`--search` picks the configurations, so each
can be its own call on a machine whose commands are time-limited).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import zero  # noqa: E402
from zero.testing.models import GPT, GPTConfig  # noqa: E402

OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFFLOAD_BOTH = {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}}


def build(layers: int, embd: int, vocab: int, seq: int) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, embd // 64), n_embd=embd,
                         tie_weights=True))


def engine_for(model: GPT, stage: int, offload: dict, batch: int) -> zero.Engine:
    config = {"train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": True}, "wall_clock_breakdown": True,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_module_granularity_threshold": 1_000_000, **offload}}
    return zero.initialize(model=model, config=config)[0]


def timed_steps(engine, vocab, seq, batch, warmup, steps):
    device = engine.device
    g = torch.Generator().manual_seed(0)
    for i in range(warmup + steps):
        if i == warmup:
            engine.wall_clock_report(reset=True)
            start = time.perf_counter()
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = (time.perf_counter() - start) / steps
    return {"total": total, **{k: v / steps for k, v in engine.wall_clock_report().items()}}


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def _release_memory() -> None:
    """Free what a finished trial held, device and pinned host caches included."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


def breakdown(args) -> None:
    model_psi = sum(p.numel() for p in build(args.layers, args.embd, args.vocab, args.seq).parameters())
    tokens = args.batch * args.seq
    flops = 6 * model_psi * tokens + 12 * args.layers * args.embd * args.seq * tokens
    print(f"GPT {args.layers}x{args.embd}, {model_psi:,} params, bf16, batch {args.batch}x{args.seq}, "
          f"{'cuda' if args.gpu else 'cpu'}, torch {torch.__version__}\n")
    cols = ["total", "forward", "backward", "step", "grad_copy_wait", "cpu_adam", "param_copy_wait"]
    print(f"{'config':<28}" + "".join(f"{c:>16}" for c in cols) + f"{'TFLOPS':>9}")
    for name, stage, offload in [("stage 2, no offload", 2, {}), ("stage 2 + opt offload", 2, OFFLOAD_OPT),
                                 ("stage 3 + opt+param offload", 3, OFFLOAD_BOTH)]:
        torch.manual_seed(0)
        engine = None
        try:
            engine = engine_for(build(args.layers, args.embd, args.vocab, args.seq), stage, offload, args.batch)
            row = timed_steps(engine, args.vocab, args.seq, args.batch, args.warmup, args.steps)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            if not _out_of_memory(exc):
                raise
            print(f"{name:<28} out of memory")
            continue
        finally:
            engine = None
            _release_memory()
        tflops = flops / row["total"] / 1e12
        print(f"{name:<28}" + "".join(f"{row.get(c, 0.0) * 1e3:>13.1f} ms" for c in cols) + f"{tflops:>9.3f}")
    print("\nms per step; grad_copy_wait / cpu_adam / param_copy_wait are parts of `step`.")


def trains(layers: int, embd: int, stage: int, offload: dict, args) -> bool:
    """One step at batch 1 and a short sequence, so model states, not activations, run out."""
    engine = None
    try:
        engine = engine_for(build(layers, embd, args.vocab, args.search_seq), stage, offload, 1)
        timed_steps(engine, args.vocab, args.search_seq, 1, 0, 1)
        return True
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        return False
    finally:
        engine = None
        _release_memory()


SEARCHES = {"none": ("no offload (stage 2)", 2, {}, "none"),
            "opt": ("stage 2 + optimizer offload", 2, OFFLOAD_OPT, "optimizer"),
            "param": ("stage 3 + optimizer + param offload", 3, OFFLOAD_BOTH, "optimizer+param")}


def _psi(layers: int, args) -> int:
    """Parameters of the GPT with `layers` blocks, counted on the meta device (nothing built)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(layers, args.embd, args.vocab, args.search_seq).parameters())


def _host_available() -> int:
    """Bytes of host memory available now (/proc/meminfo's MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def largest_models(args) -> None:
    """For each configuration: the deepest GPT (at --embd) that trains one step. zero's estimator
    gives the deepest that should fit (host: its host bytes plus the fp32 model built on the host
    first, within 90% of what is available; device: its device bytes within 90% of the GPU), which
    is tried first; if it fails, the depth is bisected below it. Beside each result: the host
    bound of 12 bytes per parameter (fp32 master, m and v) of the host memory available at the
    start, and the share of it reached."""
    from zero.estimate import estimate_memory

    host, device = _host_available(), torch.cuda.get_device_properties(0).total_memory
    print(f"\nlargest GPT (width {args.embd}) that trains one step; host memory available "
          f"{host / 2**30:.0f} GiB (bound {host / 12 / 1e9:.1f} B params at 12 bytes each), GPU {device / 2**30:.0f} GiB:")
    for key in args.search.split(","):
        name, stage, offload, option = SEARCHES[key]

        def fits(layers: int, stage=stage, option=option) -> bool:
            psi = _psi(layers, args)
            row = estimate_memory(psi, 1, stage=stage, offload=option, dtype="bf16").row(stage, option)
            return row.host_bytes + 4 * psi <= 0.9 * host and row.device_bytes <= 0.9 * device

        cap = 1
        while fits(cap * 2):
            cap *= 2
        lo, hi = cap, cap * 2  # the estimator's deepest fit lies in [cap, 2 cap)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        cap = lo if fits(lo) else 0
        start = time.perf_counter()
        if cap and trains(cap, args.embd, stage, offload, args):
            best = cap
        else:  # the estimate was too optimistic: bisect below it
            lo, hi = 0, max(cap, 1)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if trains(mid, args.embd, stage, offload, args) else (lo, mid)
            best = lo
        psi = _psi(best, args) if best else 0
        share = f"{psi * 12 / host:6.1%} of the host bound" if offload else " " * 26
        print(f"  {name:<38} {best:>4} layers  {psi / 1e9:6.2f} B params  {share}  "
              f"(estimated deepest fit {cap} layers; {time.perf_counter() - start:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run on CUDA (and search for the largest models)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--embd", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-search", action="store_true", help="skip the largest-model search (--gpu)")
    parser.add_argument("--search-seq", type=int, default=128, help="sequence length of the search (batch 1)")
    parser.add_argument("--search", default="none,opt,param",
                        help="which largest-model searches (--gpu): comma-separated of none, opt, param")
    parser.add_argument("--no-breakdown", action="store_true", help="only the largest-model search (--gpu)")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        print("bench_offload: --gpu needs a CUDA GPU; none is available here")
        return
    # GPU: a 1.3B GPT whose activations fit beside every configuration on one 80 GB GPU
    defaults = dict(layers=24, embd=2048, vocab=32000, seq=1024, batch=4) if args.gpu else \
        dict(layers=4, embd=256, vocab=4096, seq=64, batch=4)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if bad := set(args.search.split(",")) - set(SEARCHES):
        parser.error(f"--search takes {', '.join(SEARCHES)}, not {', '.join(sorted(bad))}")
    if not args.no_breakdown:
        breakdown(args)
    if args.gpu and not args.no_search:
        largest_models(args)


if __name__ == "__main__":
    main()

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
(c) no offload, growing the number of layers at a fixed width until memory runs out.
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
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


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


def largest_models(args) -> None:
    print(f"\nlargest GPT (width {args.embd}) that trains one step, growing depth by doubling then bisecting:")
    for name, stage, offload in [("no offload (stage 2)", 2, {}), ("stage 2 + optimizer offload", 2, OFFLOAD_OPT),
                                 ("stage 3 + optimizer + param offload", 3, OFFLOAD_BOTH)]:
        lo, hi = 0, 1
        while trains(hi, args.embd, stage, offload, args):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if trains(mid, args.embd, stage, offload, args) else (lo, mid)
        psi = sum(p.numel() for p in build(max(lo, 1), args.embd, args.vocab, args.seq).parameters()) if lo else 0
        print(f"  {name:<38} {lo:>4} layers  {psi / 1e9:6.2f} B params")


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
    breakdown(args)
    if args.gpu and not args.no_search:
        largest_models(args)


if __name__ == "__main__":
    main()

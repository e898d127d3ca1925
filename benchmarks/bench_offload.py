"""ZeRO-Offload step breakdown: forward/backward, gradient copy-out, CPU Adam, parameter copy-in.

    python benchmarks/bench_offload.py                 # CPU: a small GPT, the breakdown
    python benchmarks/bench_offload.py --gpu           # one GPU: breakdown, TFLOPS, largest models

One process, one device (a world of one). For each configuration it trains a few warm-up steps,
then times `--steps` steps and prints per-step milliseconds for forward, backward, the optimizer
step, and inside the step the time spent waiting for gradient copies, in CPU Adam, and waiting
for parameter copies, with and without overlap (gradient copies started during backward, and
the copy-back pipelined tile by tile while later tiles are updated).

On a CPU-only machine host and device are the same memory, so the copies are plain memcpy and
the numbers show the cost of the offload path itself, not PCIe. With `--gpu` it also reports
achieved TFLOPS (6 * params * tokens per step, plus attention) and searches for the largest GPT
that trains with (a) stage 2 + optimizer offload, (b) stage 3 + optimizer and parameter offload,
(c) no offload, growing the number of layers at a fixed width until memory runs out.
"""
from __future__ import annotations

import argparse
import dataclasses
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
            engine._times = dict.fromkeys(engine._times, 0.0)
            if engine.optimizer._host is not None:
                engine.optimizer._host.times = dict.fromkeys(engine.optimizer._host.times, 0.0)
            start = time.perf_counter()
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = (time.perf_counter() - start) / steps
    row = {"total": total, **{k: v / steps for k, v in engine._times.items()}}
    host = engine.optimizer._host
    row.update({k: v / steps for k, v in (host.times.items() if host is not None else {})})
    return row


def breakdown(args) -> None:
    model_psi = sum(p.numel() for p in build(args.layers, args.embd, args.vocab, args.seq).parameters())
    tokens = args.batch * args.seq
    flops = 6 * model_psi * tokens + 12 * args.layers * args.embd * args.seq * tokens
    print(f"GPT {args.layers}x{args.embd}, {model_psi:,} params, bf16, batch {args.batch}x{args.seq}, "
          f"{'cuda' if args.gpu else 'cpu'}, torch {torch.__version__}\n")
    cols = ["total", "forward", "backward", "step", "grad_copy_wait", "cpu_adam", "param_copy_wait"]
    print(f"{'config':<28}" + "".join(f"{c:>16}" for c in cols) + f"{'TFLOPS':>9}")
    for name, stage, offload, overlap in [("stage 2, no offload", 2, {}, True),
                                          ("stage 2 + opt offload", 2, OFFLOAD_OPT, True),
                                          ("stage 2 + opt offload, serial", 2, OFFLOAD_OPT, False),
                                          ("stage 3 + opt+param offload", 3, OFFLOAD_BOTH, True)]:
        torch.manual_seed(0)
        engine = engine_for(build(args.layers, args.embd, args.vocab, args.seq), stage, offload, args.batch)
        if engine.optimizer.offload is not None:
            engine.optimizer.offload = dataclasses.replace(engine.optimizer.offload, overlap=overlap)
        row = timed_steps(engine, args.vocab, args.seq, args.batch, args.warmup, args.steps)
        tflops = flops / row["total"] / 1e12
        print(f"{name:<28}" + "".join(f"{row.get(c, 0.0) * 1e3:>13.1f} ms" for c in cols) + f"{tflops:>9.3f}")
        del engine
        gc.collect()
    print("\nms per step; grad_copy_wait / cpu_adam / param_copy_wait are parts of `step`. 'serial' copies "
          "everything inside the step and updates whole shards (no pipelining).")


def trains(layers: int, embd: int, stage: int, offload: dict, args) -> bool:
    try:
        engine = engine_for(build(layers, embd, args.vocab, args.seq), stage, offload, args.batch)
        timed_steps(engine, args.vocab, args.seq, args.batch, 0, 1)
        return True
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if "out of memory" not in str(exc).lower() and not isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


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
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        print("bench_offload: --gpu needs a CUDA GPU; none is available here")
        return
    defaults = dict(layers=32, embd=4096, vocab=32000, seq=4096, batch=8) if args.gpu else \
        dict(layers=4, embd=256, vocab=4096, seq=64, batch=4)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    breakdown(args)
    if args.gpu and not args.no_search:
        largest_models(args)


if __name__ == "__main__":
    main()

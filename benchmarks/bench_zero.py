"""Step time and per-rank memory: DDP vs zero stages 0-3 vs torch FSDP2, same GPT, same run.

    python benchmarks/bench_zero.py [--world 2] [--layers 6] [--embd 512] [--steps 6]

Every configuration runs in fresh gloo rank processes (one thread each), trains the same GPT for
a few warm-up steps and then `--steps` timed steps, and reports:
- step time (median over ranks' median step) and its ratio to DDP;
- model-state bytes per rank (parameters, gradients, fp32 master, optimizer states), measured
  from the storages each system holds, beside the ZeRO paper's formula for our stages;
- the measured peak: the most bytes torch's allocator held at once in a separate, untimed run of
  the same job (model construction, wrapping and two steps), read from the allocator's events
  (see [Note: measuring memory on the CPU] in zero/probes.py): parameters, gradients,
  optimizer states, gathered parameters, communication buffers and activations, all of it;
- the rank process's peak resident memory (also includes torch itself and the Python heap).

DDP and FSDP2 use torch.optim.AdamW with fused=True where torch has it on CPU (the fastest torch
Adam), so the comparison is against the best peer setup, not a straw man. Communication on gloo
is emulated with all-reduces (see zero/parallel/comm.py): the step-time ratio on CPU measures overheads,
not a network.
"""
from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero.probes import AllocatorPeak, distinct_storage_bytes  # noqa: E402
from zero.testing.dist import DistPool  # noqa: E402
from zero.testing.models import GPT, GPTConfig  # noqa: E402


def _torch_adamw(params, lr):
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr)


def _state_bytes(tensors) -> int:
    return distinct_storage_bytes(tensors)


def run_one(kind: str, layers: int, embd: int, vocab: int, seq: int, batch: int, warmup: int, steps: int,
            measure: bool = False):
    """Train `kind` on this rank; return (median step seconds, model-state bytes, peak RSS bytes, Psi).
    With `measure`, return instead the allocator peak of building the job and two steps: the median
    of three such runs (gloo's own temporary buffers, freed on its threads, make single runs vary)."""
    if measure:
        peaks = []
        for _ in range(3):
            gc.collect()  # the previous run's engine sits in reference cycles
            with AllocatorPeak() as mem:
                run_one(kind, layers, embd, vocab, seq, batch, 0, 2)
            peaks.append(mem.peak)
        return statistics.median(peaks)
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, embd // 64), n_embd=embd)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    lr = 1e-4
    if kind == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(model)
        opt = _torch_adamw(engine.parameters(), lr)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            engine(x, y).backward()
            opt.step()

        def states():
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            opt_states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
            return _state_bytes(model.parameters()) + _state_bytes(grads) + _state_bytes(opt_states)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        opt = _torch_adamw(model.parameters(), lr)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            model(x, y).backward()
            opt.step()

        def states():
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in model.parameters()) if g is not None]
            opt_states = [t.to_local() if hasattr(t, "to_local") else t
                          for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
            return _state_bytes(local) + _state_bytes(grads) + _state_bytes(opt_states)
    else:
        import zero

        stage = int(kind[4])
        zc = {"stage": stage, "reduce_bucket_size": 5_000_000, "overlap_comm": stage >= 2}
        if stage < 3:
            zc["allgather_bucket_size"] = 5_000_000
        if stage == 3:  # one unit per transformer block (below), like FSDP2's fully_shard per block;
            # released after forward and one unit prefetched ahead, as FSDP2 does
            zc.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                      stage3_prefetch_bucket_size=0 if kind.endswith("noprefetch") else 1)
            zero.set_z3_leaf_modules(model, [type(model.blocks[0])])
        config = {"train_micro_batch_size_per_gpu": batch, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
                  "zero_optimization": zc}
        engine, *_ = zero.initialize(model=model, config=config)

        def step(x, y):
            engine.backward(engine(x, y))
            engine.step()

        def states():
            return engine.memory_report()["model_states_total"]

    g = torch.Generator().manual_seed(100 + rank)
    times = []
    for i in range(max(warmup + steps, 1)):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        step(idx[:, :-1], idx[:, 1:])
        if i >= warmup or not steps:
            times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return statistics.median(times), states(), peak_rss, psi


def measure(kinds, world: int, layers: int, embd: int, vocab: int, seq: int, batch: int, warmup: int, steps: int,
            progress=None) -> tuple[dict, int | None]:
    """Run each of `kinds` ("ddp", "zero0".."zero3", "zero3_noprefetch", "fsdp2") on `world` fresh
    gloo ranks. Returns ({kind: (step seconds, model-state bytes, allocator peak, peak RSS) or the
    reason it could not run}, Psi)."""
    rows, psi = {}, None
    for kind in kinds:
        pool = DistPool(world)
        try:
            results = pool.run(run_one, kind, layers, embd, vocab, seq, batch, warmup, steps, timeout=1800)
            pool.close()
            pool = DistPool(world)  # a fresh process for the measured run
            peaks = pool.run(run_one, kind, layers, embd, vocab, seq, batch, warmup, steps, measure=True, timeout=1800)
            pool.close()
            t = statistics.median(r[0] for r in results)
            rows[kind] = (t, max(r[1] for r in results), max(peaks), max(r[2] for r in results))
            psi = results[0][3]
        except Exception as exc:  # report, keep going: a peer may not run on this torch/backend
            rows[kind] = f"n/a ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:100]})"
            pool.close(kill=True)
        if progress is not None:
            progress(kind)
    return rows, psi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="*", default=["ddp", "zero0", "zero1", "zero2", "zero3", "zero3_noprefetch", "fsdp2"])
    args = parser.parse_args()
    rows, psi = measure(args.only, args.world, args.layers, args.embd, args.vocab, args.seq, args.batch, args.warmup,
                        args.steps, progress=lambda kind: print(f"  done: {kind}", file=sys.stderr, flush=True))

    n = args.world
    formula = {"zero0": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n} if psi else {}
    fp32_formula = {"zero0": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n,
                    "zero3": 16 * psi / n, "zero3_noprefetch": 16 * psi / n} if psi else {}
    base = rows.get("ddp")
    print(f"\nGPT {args.layers}x{args.embd}, {psi:,} params, {n} gloo ranks x 1 thread, "
          f"batch {args.batch}x{args.seq} tokens per rank, fp32, torch {torch.__version__}\n")
    fsdp = rows.get("fsdp2")
    print(f"{'config':<17} {'step ms':>9} {'vs DDP':>7} {'model states MB':>16} {'fp32 formula MB':>16} "
          f"{'measured peak MB':>17} {'vs FSDP2':>9} {'peak RSS MB':>12}")
    for kind, row in rows.items():
        if isinstance(row, str):
            print(f"{kind:<17} {row}")
            continue
        t, states, peak, rss = row
        ratio = f"{t / base[0]:.2f}x" if isinstance(base, tuple) else "-"
        vs_fsdp = f"{peak / fsdp[2]:.2f}x" if isinstance(fsdp, tuple) else "-"
        f = f"{fp32_formula[kind] / 2**20:.1f}" if kind in fp32_formula else "-"
        print(f"{kind:<17} {t * 1e3:>9.1f} {ratio:>7} {states / 2**20:>16.1f} {f:>16} {peak / 2**20:>17.1f} "
              f"{vs_fsdp:>9} {rss / 2**20:>12.1f}")
    print("\nfp32 formula: stage 0: 16 Psi; 1: 8 Psi + 8 Psi/N; 2: 4 Psi + 12 Psi/N; 3: 16 Psi/N (fp32 params double as the master;")
    print("stage 3 also keeps small persistent params whole). FSDP2 and zero3 reshard after forward; zero3 prefetches.")
    if formula:
        print("(mixed precision, as in the ZeRO paper, would be stage 1: 4 Psi + 12 Psi/N, stage 2: 2 Psi + 14 Psi/N.)")


if __name__ == "__main__":
    main()

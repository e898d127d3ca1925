"""torch.compile under ZeRO-3: zero eager, zero + engine.compile(), FSDP2 eager, FSDP2 + per-block
compile (torchtitan's recipe), the same GPT on the same gloo ranks in the same run.

    python benchmarks/bench_compile.py [--world 2] [--layers 4] [--embd 256] [--backend inductor] [--write]
    python benchmarks/bench_compile.py --gpu [--write]      # one CUDA GPU, one rank (NCCL), bf16


Each configuration runs in fresh rank processes (one thread each): warm-up steps (the first
compiles), then `--steps` timed steps. Reported per configuration:
- step time (median over ranks of the median step), and its ratio to zero eager;
- graph breaks (dynamo's counter) and graphs compiled: after the warm-up and at the end, so a
  recompilation during the timed steps shows as a difference;
- the allocator peak of one untimed step after the warm-up (see [Note: measuring memory on the CPU]
  in zero/probes.py): compiled graphs must not keep gathered parameters alive.
Both systems shard per transformer block, release after forward and prefetch one block ahead.
FSDP2 compiles each block with `block.compile()` before `fully_shard` (torchtitan's order; dynamo
skips FSDP2's hooks); zero with `engine.compile()` (its hooks outside the graphs). On CPU the
backend is inductor's C++ code; gloo emulates the collectives, so the ratios measure compute and
overheads, not a network.

With --gpu each configuration runs in a fresh process as one NCCL rank on the GPU (a bigger GPT,
bf16 compute with fp32 master weights in both systems: zero's bf16 config, FSDP2's
MixedPrecisionPolicy), the peak is torch.cuda.max_memory_allocated of the untimed step, and the
table goes to results/compile_gpu.md with the card's name. With one rank zero's stage 3 gathers
nothing, while FSDP2 still copies its parameters in and out: the GPU run measures the compiled
compute, and favours zero on sharding overheads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero.probes import AllocatorPeak  # noqa: E402
from zero.testing.dist import DistPool  # noqa: E402
from zero.testing.models import GPT, GPTConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("zero3", "zero3_compiled", "fsdp2", "fsdp2_compiled")


def run_one(kind: str, layers: int, embd: int, vocab: int, seq: int, batch: int, warmup: int, steps: int,
            backend: str, gpu: bool = False) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, embd // 64), n_embd=embd))
    psi = sum(p.numel() for p in model.parameters())
    model.to(device)
    lr = 1e-4
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = {}
        if gpu:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        for block in model.blocks:
            if kind.endswith("compiled"):
                block.compile(backend=backend)
            fully_shard(block, mesh=mesh, reshard_after_forward=True, **policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=True, **policy)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            model(x, y).backward()
            opt.step()
    else:
        import zero

        zero.set_z3_leaf_modules(model, [type(model.blocks[0])])  # one unit per block, as fully_shard per block
        config = {"train_micro_batch_size_per_gpu": batch, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
                  **({"bf16": {"enabled": True}} if gpu else {}),
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1}}
        engine, *_ = zero.initialize(model=model, config=config)
        if kind.endswith("compiled"):
            engine.compile(backend=backend)

        def step(x, y):
            engine.backward(engine(x, y))
            engine.step()

    g = torch.Generator().manual_seed(100 + rank)

    def batch_():
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        return idx[:, :-1], idx[:, 1:]

    def sync():
        if gpu:
            torch.cuda.synchronize()

    times, after_warmup = [], None
    for i in range(warmup + steps):
        x, y = batch_()
        dist.barrier()
        sync()
        start = time.perf_counter()
        step(x, y)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if i == warmup - 1:
            after_warmup = counters["stats"]["unique_graphs"]
    x, y = batch_()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        step(x, y)
        sync()
        peak = torch.cuda.max_memory_allocated()
    else:
        with AllocatorPeak() as mem:
            step(x, y)
        peak = mem.peak
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"seconds": statistics.median(times), "spread": (q[0], q[2]), "breaks": sum(counters["graph_break"].values()),
            "graphs": (after_warmup, counters["stats"]["unique_graphs"]), "peak": peak,
            "params": psi}


def _one_on_the_gpu(args, kind: str) -> list[dict]:
    """`kind` in a fresh process, one NCCL rank on the GPU (see the docstring); its result."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    code = (f"import json, sys, torch, torch.distributed as dist; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import bench_compile as b; torch.cuda.set_device(0); dist.init_process_group('nccl'); "
            f"r = b.run_one({kind!r}, {args.layers}, {args.embd}, {args.vocab}, {args.seq}, {args.batch}, "
            f"{args.warmup}, {args.steps}, {args.backend!r}, gpu=True); print('RESULT', json.dumps(r)); "
            f"dist.destroy_process_group()")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    found = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not found:
        raise RuntimeError((run.stdout + run.stderr)[-2000:])
    return [json.loads(found[-1][len("RESULT "):])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--only", nargs="*", default=list(KINDS))
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, one rank, a bigger GPT in bf16")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/compile.md (compile_gpu.md)")
    args = parser.parse_args(argv)
    if args.gpu:  # the sizes a GPU measures compute at, unless given
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, value in (("--layers", 12), ("--embd", 1024), ("--vocab", 32768), ("--seq", 1024), ("--batch", 8)):
            if flag not in given:
                setattr(args, flag[2:], value)
        args.world = 1
    rows, psi = {}, None
    for kind in args.only:
        pool = None if args.gpu else DistPool(args.world)
        try:
            if args.gpu:
                out = _one_on_the_gpu(args, kind)
            else:
                out = pool.run(run_one, kind, args.layers, args.embd, args.vocab, args.seq, args.batch, args.warmup,
                               args.steps, args.backend, timeout=1800)
                pool.close()
            rows[kind] = {"seconds": statistics.median(r["seconds"] for r in out), "spread": out[0]["spread"],
                          "breaks": max(r["breaks"] for r in out), "graphs": out[0]["graphs"],
                          "peak": max(r["peak"] for r in out)}
            psi = out[0]["params"]
        except Exception as exc:  # a peer may not run on this torch or backend: say so, go on
            rows[kind] = f"n/a ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]})"
            if pool is not None:
                pool.close(kill=True)
        print(f"  done: {kind}", file=sys.stderr, flush=True)
    base = rows.get("zero3")
    where = (f"{torch.cuda.get_device_name()}, 1 NCCL rank, bf16" if args.gpu else
             f"{args.world} gloo ranks x 1 thread, fp32")
    lines = [f"# torch.compile under ZeRO-3: GPT {args.layers}x{args.embd} ({psi or 0:,} parameters), {where}, "
             f"batch {args.batch}x{args.seq}, backend {args.backend}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}",
             "", "Written by `python benchmarks/bench_compile.py --write` (method in its docstring).", "",
             "| configuration | step ms | rank 0's middle half, ms | vs zero eager | graph breaks | "
             "graphs after warm-up / at the end | peak MB (one step) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, r in rows.items():
        if isinstance(r, str):
            lines.append(f"| {kind} | {r} | | | | | |")
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}x" if isinstance(base, dict) else "-"
        lo, hi = r["spread"]
        lines.append(f"| {kind} | {r['seconds'] * 1e3:.1f} | {lo * 1e3:.0f}-{hi * 1e3:.0f} | {ratio} | {r['breaks']} | "
                     f"{r['graphs'][0]} / "
                     f"{r['graphs'][1]} | {r['peak'] / 2**20:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / ("compile_gpu.md" if args.gpu else "compile.md")).write_text(text)


if __name__ == "__main__":
    main()

"""Checkpoint save/load: time, bytes on disk, and how long a save blocks the training loop.

    python benchmarks/bench_checkpoint.py [--world 2] [--layers 12] [--embd 768] [--stage 2] [--dir /tmp/zero_bench_ckpt]

A GPT (~100M parameters at the defaults) trains on `--world` gloo ranks; then, on the same state:
- zero `save_checkpoint` synchronous (the loop is blocked for the whole save);
- zero `save_checkpoint(async_save=True)` (the loop is blocked only for the snapshot to host memory;
  the total is measured until `wait_for_checkpoint()` returns);
- zero `load_checkpoint` of it;
- beside them, each rank's same tensors (the chunks zero writes) through `torch.save` of a dict, and
  through DCP's default FileSystemWriter (whose `.metadata` is a pickle): the two usual ways.
Bytes on disk are compared with the formula: fp32 training keeps the parameters (4 Psi), master
(which is the parameters in fp32: 4 Psi more on disk, written separately so a checkpoint loads into
16-bit training too) and Adam's two moments (8 Psi): 16 Psi. Times are medians over ranks of one
run each; on CPU with gloo they measure file writing, not a network.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero.testing.dist import DistPool  # noqa: E402
from zero.testing.models import GPT, GPTConfig  # noqa: E402


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(root: str, layers: int, embd: int, stage: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import zero
    from zero.checkpoint.chunks import _SaveChunks
    from zero.checkpoint.training import _chunks

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32000, block_size=128, n_layer=layers, n_head=12, n_embd=embd))
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}})
    idx = torch.randint(0, 32000, (1, 33))
    engine.backward(engine(idx[:, :-1], idx[:, 1:]))
    engine.step()
    out: dict[str, float] = {"psi": psi}
    root = Path(root)

    def timed(name, fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - start
        dist.barrier()

    engine.save_checkpoint(root / "warmup")  # first use: process groups, imports
    shutil.rmtree(root / "warmup", ignore_errors=True) if rank == 0 else None
    timed("zero sync save", lambda: engine.save_checkpoint(root / "zero", tag="sync"))
    timed("zero async save (blocking)", lambda: engine.save_checkpoint(root / "zero", tag="async", async_save=True))
    start = time.perf_counter()
    engine.wait_for_checkpoint()
    out["zero async save (total)"] = out["zero async save (blocking)"] + time.perf_counter() - start
    dist.barrier()
    timed("zero load", lambda: engine.load_checkpoint(root / "zero", tag="sync"))
    chunks = _chunks(engine, saving=True)
    local = {f"{c.name}@{c.offset}": c.tensor.detach().clone() for c in chunks}
    (root / "torch_save").mkdir(parents=True, exist_ok=True)
    timed("torch.save (per rank)", lambda: torch.save(local, root / "torch_save" / f"rank{rank}.pt"))
    timed("DCP default writer", lambda: dcp.save({}, storage_writer=dcp.FileSystemWriter(str(root / "dcp")),
                                                 planner=_SaveChunks(chunks)))
    if rank == 0:
        out["bytes zero"] = _dir_bytes(root / "zero" / "sync")
        out["bytes torch.save"] = _dir_bytes(root / "torch_save")
        out["bytes DCP default"] = _dir_bytes(root / "dcp")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/zero_bench_ckpt")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    pool = DistPool(args.world, collective_timeout=1800)
    try:
        results = pool.run(run, args.dir, args.layers, args.embd, args.stage, timeout=3600)
    finally:
        pool.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    first = results[0]
    psi = first["psi"]
    print(f"GPT {args.layers}x{args.embd}, {psi / 1e6:.1f}M params, stage {args.stage}, {args.world} gloo ranks, "
          f"fp32, torch {torch.__version__}, disk: {os.path.realpath(args.dir)}\n")
    print(f"{'what':30s} {'seconds':>8s}")
    for key in ("zero sync save", "zero async save (blocking)", "zero async save (total)", "zero load",
                "torch.save (per rank)", "DCP default writer"):
        print(f"{key:30s} {statistics.median(r[key] for r in results):8.2f}")
    formula = 16 * psi
    print(f"\nbytes on disk: zero {first['bytes zero'] / 1e6:,.0f} MB (formula 16 Psi = {formula / 1e6:,.0f} MB, "
          f"{first['bytes zero'] / formula:.3f}x); torch.save {first['bytes torch.save'] / 1e6:,.0f} MB; "
          f"DCP default {first['bytes DCP default'] / 1e6:,.0f} MB")


if __name__ == "__main__":
    main()

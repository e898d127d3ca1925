"""Low-precision optimizer state: bytes per parameter, the largest model in a host-memory budget, and
what the formats do to the loss.

Formats (zero.ops.adam_formats, docs/config.md "State formats"): today's fp32 master + fp32 moments,
bf16 master + bf16 moments (stochastic rounding, and rounded to nearest as DeepSpeed does), fp32
master + 8-bit moments, bf16 master + 8-bit moments. Three parts, each a table in
benchmarks/results/state_formats_<part>.md:

    bytes      a GPT at stage 3 on 2 gloo ranks: model-state bytes per parameter summed over ranks
               as Engine.memory_report() measures the storages, and host bytes (master + moments +
               gradient staging) with optimizer offload, against today's layout; beside DeepSpeed's
               published figure for the same options
    largest    the deepest GPT (width fixed, layers searched as bench_offload does) that trains one
               step with optimizer offload in a child process whose private writable memory is
               capped with RLIMIT_DATA at --budget bytes above what an empty child holds
    converge   the demo GPT (examples/train_gpt.py: its model, data and config, stage 0, one rank)
               for --steps steps at the demo's lr and at a tenth of it, and the 3D U-Net example
               (examples/train_unet3d.py) for --unet-steps: final loss of each format against fp32
               states on the same data

Usage:
    python benchmarks/bench_formats.py                          # all three parts
    python benchmarks/bench_formats.py --parts bytes,largest --budget 3e9
    python benchmarks/bench_formats.py --parts converge --steps 1000
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

# (label, bf16_master_weights_and_grads, state_dtype, stochastic_rounding)
FORMATS = [
    ("fp32 master + fp32 moments (today)", False, "fp32", None),
    ("bf16 master + bf16 moments, stochastic", True, "bf16", True),
    ("bf16 master + bf16 moments, nearest", True, "bf16", False),
    ("fp32 master + 8-bit moments", False, "int8", None),
    ("bf16 master + 8-bit moments", True, "int8", None),
]
TODAY = FORMATS[0][0]

# DeepSpeed's published figure for bf16_master_weights_and_grads + bf16_optimizer_states (its blog,
# 2025-12): 25.7 -> 16.2 GB allocated on its example run (activations included), 0.63x. It has no
# 8-bit moments and rounds its bf16 master to nearest.
DEEPSPEED_NOTE = ("DeepSpeed's published figure for its two bf16 keys together: 25.7 -> 16.2 GB allocated on its "
                  "example (0.63x, activations included); it offers no 8-bit moments and rounds the bf16 master to "
                  "nearest.")


def format_config(base: dict, master: bool, state: str, stochastic: bool | None) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": True, "bf16_master_weights_and_grads": master}
    if stochastic is not None:
        cfg["bf16"]["stochastic_rounding"] = stochastic
    if state != "fp32":
        cfg["optimizer"]["params"]["state_dtype"] = state
    return cfg


# ----------------------------------------------------------------------------- bytes per parameter


def _gpt(layers: int, width: int):
    from zero.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=width))


def _bytes_on_rank(layers: int, width: int):
    import torch.distributed as dist

    import zero

    out = {}
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    for label, master, state, stochastic in FORMATS:
        for offload, accumulation in ((False, 1), (True, 1), (True, 2)):
            cfg = format_config({**base, "gradient_accumulation_steps": accumulation}, master, state, stochastic)
            if offload:  # small CPU Adam tiles: the two copy-back tiles stay a small part of the host bytes
                cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, sub_group_size=1_000_000)
            engine, *_ = zero.initialize(model=_gpt(layers, width), config=cfg)
            for _ in range(accumulation):  # DeepSpeed's loop: step() after every micro-batch
                x = torch.randint(0, 256, (2, 64))
                engine.backward(engine(x, x))
                engine.step()
            report = engine.memory_report()
            mine = torch.tensor([report["model_states_total"], report["host_bytes"], report["fp32_master"],
                                 report["optimizer_states"], report["grads"]], dtype=torch.float64)
            dist.all_reduce(mine)
            psi = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
            out[(label, offload, accumulation)] = (mine / psi).tolist()
            engine.destroy()
    return out


def part_bytes(args) -> str:
    from zero.testing.dist import run_once

    results, _ = run_once(2, _bytes_on_rank, args.layers, args.width, timeout=1200)
    if not isinstance(results[0], dict):
        raise RuntimeError(results[0])
    r = results[0]
    rows = ["| format | model states, bytes/param (2 ranks summed) | master | moments | grads "
            "| host bytes/param, offload, accumulation 1 | vs today | host bytes/param, offload, accumulation 2 "
            "| vs today |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    today1, today2 = r[(TODAY, True, 1)][1], r[(TODAY, True, 2)][1]
    for label, *_ in FORMATS:
        total, _, master, moments, grads = r[(label, False, 1)]
        host1, host2 = r[(label, True, 1)][1], r[(label, True, 2)][1]
        rows.append(f"| {label} | {total:.2f} | {master:.2f} | {moments:.2f} | {grads:.2f} | {host1:.2f} | "
                    f"{host1 / today1:.2f}x | {host2:.2f} | {host2 / today2:.2f}x |")
    return ("## Bytes per parameter (stage 3, 2 ranks)\n\n"
            f"GPT with {args.layers} layers of width {args.width}, bf16 training. Model states: no offload, "
            "gradient accumulation 1. Host bytes under optimizer offload (`host_bytes`) count master + moments + "
            "the host staging of the gradient shard and the two copy-back tiles (sub_group_size 1M): gradients "
            "are bf16 with accumulation 1 and fp32 with accumulation 2, except with a bf16 master, whose "
            "gradients are bf16 always (DeepSpeed's `bf16_master_weights_and_grads`). On this CPU-only machine "
            "the parameters and gradients are in host memory too but are not part of that figure.\n\n"
            + "\n".join(rows) + "\n\n" + DEEPSPEED_NOTE + "\n")


# ----------------------------------------------------------------------------- the largest model


def _trains(layers: int, width: int, fmt: tuple, budget: int, queue) -> None:
    """In a child: cap private writable memory, build and train one step with optimizer offload."""
    try:
        import zero

        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        base_usage = _private_bytes()
        resource.setrlimit(resource.RLIMIT_DATA, (base_usage + budget, hard))
        label, master, state, stochastic = fmt
        base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                      "stage3_param_persistence_threshold": 0}}
        engine, *_ = zero.initialize(model=_gpt(layers, width), config=format_config(base, master, state, stochastic))
        x = torch.randint(0, 256, (1, 64))
        engine.backward(engine(x, x))
        engine.step()
        queue.put(sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()))
    except (MemoryError, RuntimeError) as exc:
        queue.put(f"failed: {type(exc).__name__}: {str(exc)[:120]}")


def _private_bytes() -> int:
    """Private writable memory of this process now (what RLIMIT_DATA counts), from /proc."""
    total = 0
    with open(f"/proc/{os.getpid()}/smaps") as f:
        writable = False
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and "-" in parts[0] and len(parts[1]) == 4:
                writable = parts[1][1] == "w" and parts[1][3] == "p"
            elif parts and parts[0] == "Size:" and writable:
                total += int(parts[1]) * 1024
    return total


def _fits(layers: int, width: int, fmt: tuple, budget: int) -> int | None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_trains, args=(layers, width, fmt, budget, q))
    p.start()
    p.join(900)
    if p.is_alive():
        p.kill()
        return None
    got = q.get() if not q.empty() else None
    return got if isinstance(got, int) else None


def part_largest(args) -> str:
    rows = ["| format | deepest GPT that trains | parameters | vs today |", "| --- | --- | --- | --- |"]
    today = None
    for fmt in [f for f in FORMATS if f[0] != "bf16 master + bf16 moments, nearest"]:
        lo, hi, best = 0, 1, None  # double, then bisect on the number of layers
        while (n := _fits(hi, args.search_width, fmt, args.budget)) is not None:
            lo, best, hi = hi, n, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            n = _fits(mid, args.search_width, fmt, args.budget)
            lo, hi, best = (mid, hi, n) if n is not None else (lo, mid, best)
        today = today or best
        rows.append(f"| {fmt[0]} | {lo} layers | {best or 0:,} | {(best or 0) / today:.2f}x |" if today else
                    f"| {fmt[0]} | none | 0 | - |")
        print(rows[-1], flush=True)
    return (f"## The largest GPT in a host-memory budget (optimizer offload, stage 3, one rank)\n\n"
            f"Width {args.search_width}, sequence 64, batch 1, one training step in a child process whose private "
            f"writable memory (RLIMIT_DATA) is capped at {args.budget / 2**30:.1f} GiB above what it holds after "
            f"importing torch and zero. On this CPU-only machine the bf16 parameters and gradients live in host "
            f"memory too, so they count against the budget (on a GPU host only master, moments and gradient "
            f"staging would).\n\n" + "\n".join(rows) + "\n")


# ----------------------------------------------------------------------------- convergence


def _converge_gpt(fmt: tuple, steps: int, lr_scale: float, out: str, corpus: str) -> None:
    """The demo GPT (its model, corpus and config) trained on one fixed sequence of batches, then
    its loss on 32 fixed held-out batches (the last 10% of the corpus): the same data for every
    format, and a final loss that does not depend on which training batches came last."""
    torch.set_num_threads(1)

    import zero
    from zero.testing.models import GPT, CharDataset, GPTConfig

    base = json.loads((HERE.parent / "examples" / "configs" / "zero3_offload_bf16.json").read_text())
    base["zero_optimization"] = {"stage": 0}
    base.pop("wall_clock_breakdown", None)
    base["optimizer"]["params"]["lr"] *= lr_scale
    base["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=max(1, min(20, steps // 10)))
    cfg = format_config(base, *fmt[1:])
    text = Path(corpus).read_text(encoding="utf-8")  # one snapshot for every run (the docs may change meanwhile)
    cut = int(len(text) * 0.9)
    train, held = CharDataset(text[:cut], 64), CharDataset(text[cut:], 64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=max(train.vocab_size, held.vocab_size), block_size=64, n_layer=4, n_head=4,
                          n_embd=96))
    engine, *_ = zero.initialize(model=model, config=cfg)
    held.stoi, held.chars = train.stoi, train.chars  # one vocabulary: characters unseen in training map to 0
    held.data = torch.tensor([train.stoi.get(c, 0) for c in text[cut:]], dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(train), (16,), generator=g)
        x, y = (torch.stack(t) for t in zip(*(train[int(i)] for i in idx)))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        gh = torch.Generator().manual_seed(2)
        evals = []
        for _ in range(32):
            idx = torch.randint(0, len(held), (16,), generator=gh)
            x, y = (torch.stack(t) for t in zip(*(held[int(i)] for i in idx)))
            evals.append(engine(x, y).item())
    Path(out).write_text(json.dumps({"final": sum(evals) / len(evals), "train": sum(losses[-50:]) / 50,
                                     "first": losses[0]}))


def _converge_unet(fmt: tuple, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    import train_unet3d

    base = json.loads(json.dumps(train_unet3d.CONFIG))
    base["zero_optimization"] = {"stage": 0}
    cfg = format_config(base, *fmt[1:])
    path = Path(out).with_suffix(".json.cfg")
    path.write_text(json.dumps(cfg))
    r = train_unet3d.main(["--config", str(path), "--steps", str(steps)])
    Path(out).write_text(json.dumps({"final": r["final_loss"], "first": r["first_loss"], "dice": r["dice"]}))


def _run_jobs(jobs: list[tuple], parallel: int) -> None:
    """Each job in its own process (a fresh process group of one), `parallel` at a time."""
    ctx = mp.get_context("spawn")
    running: list = []
    for n, (target, args) in enumerate(jobs):
        while len(running) >= parallel:  # wait for whichever finishes first
            mp.connection.wait([p.sentinel for p in running])
            running = [p for p in running if p.is_alive()]
        p = ctx.Process(target=_with_env, args=(target, args, str(29600 + (os.getpid() % 300) * 40 + n)))
        p.start()
        running.append(p)
    for p in running:
        p.join()


def _with_env(target, args, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    target(*args)


def part_converge(args) -> str:
    tmp = Path(args.converge_dir or tempfile.mkdtemp(prefix="zero_formats_"))
    tmp.mkdir(parents=True, exist_ok=True)
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        import train_gpt

        corpus.write_text(train_gpt.corpus(), encoding="utf-8")
    jobs = []
    for i, fmt in enumerate(FORMATS):
        for j, scale in enumerate((1.0, 0.1)):
            jobs.append((_converge_gpt, (fmt, args.steps, scale, str(tmp / f"gpt{i}_{j}.json"), str(corpus))))
        jobs.append((_converge_unet, (fmt, args.unet_steps, str(tmp / f"unet{i}.json"))))
    _run_jobs([job for job in jobs if not Path(job[1][3 if job[0] is _converge_gpt else 2]).exists()],
              args.parallel)  # runs whose result is already there stay
    read = lambda name: json.loads((tmp / name).read_text())  # noqa: E731
    rows = ["| format | GPT held-out loss, lr 3e-3 | vs fp32 states | GPT held-out loss, lr 3e-4 | vs fp32 states "
            "| U-Net final loss | vs fp32 states | U-Net Dice |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = [read("gpt0_0.json")["final"], read("gpt0_1.json")["final"], read("unet0.json")["final"]]
    for i, (label, *_rest) in enumerate(FORMATS):
        g0, g1, u = read(f"gpt{i}_0.json")["final"], read(f"gpt{i}_1.json")["final"], read(f"unet{i}.json")
        rows.append(f"| {label} | {g0:.4f} | {(g0 / base[0] - 1) * 100:+.2f}% | {g1:.4f} | {(g1 / base[1] - 1) * 100:+.2f}% "
                    f"| {u['final']:.4f} | {(u['final'] / base[2] - 1) * 100:+.2f}% | {u['dice']:.3f} |")
    return (f"## Convergence\n\nThe demo GPT (examples/train_gpt.py: 4 blocks of width 96, its corpus and config, "
            f"stage 0 on one rank) for {args.steps} steps at the demo's lr (3e-3, warm-up and cosine decay) and at a "
            f"tenth of it, on one fixed sequence of batches of 90% of the corpus; its final loss is the mean over 32 "
            f"fixed batches of the held-out 10%. The 3D U-Net example for {args.unet_steps} steps on its own seeded "
            f"volumes: the mean training loss of the last 10 micro-steps and the Dice score there. The same data for "
            f"every format.\n\n" + "\n".join(rows) + "\n\n"
            "Why stochastic rounding: a bf16 master stores a weight with 8 significant bits, so an update smaller "
            "than half the spacing of bf16 numbers around the weight (2^-9 of it, ~0.2%) is lost when rounded to "
            "nearest; late in a cosine schedule, and at small learning rates, most updates are that small, and the "
            "weights stop moving. Stochastic rounding keeps each update in expectation.\n")


# ----------------------------------------------------------------------------- main


def header() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "?"
    from datetime import date

    return (f"# Optimizer state formats: bytes, the largest model, the loss\n\ncommit {commit}, {date.today()}, "
            f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, Python "
            f"{platform.python_version()}\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="bytes,largest,converge")
    parser.add_argument("--layers", type=int, default=4, help="bytes: GPT layers")
    parser.add_argument("--width", type=int, default=512, help="bytes: GPT width")
    parser.add_argument("--budget", type=float, default=2e9, help="largest: bytes of private memory allowed")
    parser.add_argument("--search-width", type=int, default=512, help="largest: GPT width")
    parser.add_argument("--steps", type=int, default=1000, help="converge: GPT steps")
    parser.add_argument("--unet-steps", type=int, default=200, help="converge: U-Net steps")
    parser.add_argument("--parallel", type=int, default=2, help="converge: runs at once (one thread each)")
    parser.add_argument("--converge-dir", type=Path, default=None,
                        help="converge: keep each run's result here; runs whose result is there are not repeated")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="writes state_formats_<part>.md here")
    args = parser.parse_args()
    args.budget = int(args.budget)
    parts = {"bytes": part_bytes, "largest": part_largest, "converge": part_converge}
    for name in args.parts.split(","):
        section = parts[name](args)
        print(section, flush=True)
        (args.out / f"state_formats_{name}.md").write_text(header() + section +
                                                           "\nProduced by benchmarks/bench_formats.py.\n")


if __name__ == "__main__":
    main()

"""Run the benchmarks and write their tables and plots to benchmarks/results/ (checked in, shown
in the README), each stamped with the commit, date, machine and torch they came from.

    python benchmarks/report.py                 # everything (about 10 minutes on a 2-core CPU)
    python benchmarks/report.py --only memory adam

- memory: model-state bytes per rank by stage against world size: the points are measured
  (`engine.memory_report()` of a real run at each world size), the lines are the formula
  (zero.estimate_memory);
- speed: step time by stage against DDP and FSDP2 (benchmarks/bench_zero.py), same GPT, same run;
- peak: peak memory per rank by stage against FSDP2, from torch's allocator (bench_zero.py's
  measured run: everything the job allocates, activations and buffers included);
- adam: CPU Adam throughput against torch's AdamW modes and the memory-bandwidth ceiling
  (benchmarks/bench_adam.py).

Needs matplotlib (`pip install 'zero[bench]'`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"


_STAMP: list[str] = []


def stamp() -> str:
    """Where the numbers come from: commit, date, machine, torch (taken once, before anything is written)."""
    if _STAMP:
        return _STAMP[0]
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=HERE.parent, capture_output=True,
                               text=True).stdout.strip()  # the results being rewritten do not count
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPU cores ({cpu})"
    _STAMP.append(f"commit {commit}, {datetime.date.today().isoformat()}, {device}, torch {torch.__version__}, "
                  f"Python {platform.python_version()}")
    return _STAMP[0]


def _save(fig, name: str) -> None:
    fig.text(0.995, 0.005, stamp(), fontsize=6, color="#666666", ha="right", va="bottom")
    fig.savefig(RESULTS / name, dpi=110)


def _write(name: str, title: str, body: str, image: str | None) -> None:
    RESULTS.mkdir(exist_ok=True)
    text = f"# {title}\n\n{stamp()}\n\n" + (f"![{title}]({image})\n\n" if image else "") + body.rstrip() + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    print(f"wrote {RESULTS / name}.md" + (f" and {image}" if image else ""), flush=True)


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _plt():
    import matplotlib

    RESULTS.mkdir(exist_ok=True)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- model-state memory against world size --------------------------------------------------------


def states_at(stage: int, layers: int, embd: int) -> tuple[int, int]:
    """On each rank: (measured model-state bytes after a step, trainable parameters)."""
    import torch
    import torch.distributed as dist

    import zero
    from zero.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=4, n_embd=embd, tie_weights=False))
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    return engine.memory_report()["model_states_total"], psi


def memory_report(worlds=(1, 2, 4), layers: int = 2, embd: int = 128) -> dict:
    from zero.estimate import estimate_memory
    from zero.testing.dist import DistPool

    measured: dict[int, dict[int, int]] = {}
    psi = 0
    for world in worlds:
        pool = DistPool(world)
        try:
            for stage in range(4):
                results = pool.run(states_at, stage, layers, embd, timeout=600)
                measured.setdefault(stage, {})[world] = max(r[0] for r in results)
                psi = results[0][1]
        finally:
            pool.close()
    span = range(1, 2 * max(worlds) + 1)
    formula = {stage: {n: estimate_memory(psi, n, stage=stage, offload="none", dtype="fp32",
                                          config={"zero_optimization": {"stage3_param_persistence_threshold": 0}}
                                          )[0].model_states_total for n in span} for stage in range(4)}
    return {"psi": psi, "measured": measured, "formula": formula, "worlds": list(worlds)}


def write_memory(data: dict) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for stage, color in zip(range(4), ("#777777", "#1f77b4", "#2ca02c", "#d62728")):
        line = data["formula"][stage]
        ax.plot(list(line), [v / 2**20 for v in line.values()], color=color, lw=1.5,
                label=f"stage {stage}" + (" (= DDP)" if stage == 0 else "") + ": formula")
        pts = data["measured"][stage]
        ax.plot(list(pts), [v / 2**20 for v in pts.values()], "o", color=color, ms=6)
    ax.set_xlabel("data-parallel ranks")
    ax.set_ylabel("model states per rank (MiB)")
    ax.set_title(f"Model-state memory per rank, GPT with {data['psi']:,} parameters, fp32 Adam")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="dots: measured (memory_report)", title_fontsize=8, loc="upper right")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _save(fig, "memory_vs_world.png")
    plt.close(fig)
    rows = [[f"stage {s}"] + [f"{data['measured'][s][n] / 2**20:.2f} / {data['formula'][s][n] / 2**20:.2f}"
                              for n in data["worlds"]] for s in range(4)]
    body = _table(["", *[f"{n} rank(s): measured / formula MiB" for n in data["worlds"]]], rows)
    body += ("\n\nMeasured: `engine.memory_report()['model_states_total']` on the largest rank after one step "
             "(stage 3 with `stage3_param_persistence_threshold: 0`). Formula: `zero.estimate_memory` "
             "(fp32: 16 Psi at stage 0, 8 Psi + 8 Psi/N at stage 1, 4 Psi + 12 Psi/N at stage 2, 16 Psi/N at stage "
             "3). They differ by bucket and unit padding only.")
    _write("memory", "Model-state memory per rank against world size", body, "memory_vs_world.png")


# -- step time and peak memory against DDP and FSDP2 ---------------------------------------------


def speed_report(world: int = 2, layers: int = 4, embd: int = 256) -> dict:
    import bench_zero

    kinds = ["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2"]
    rows, psi = bench_zero.measure(kinds, world, layers, embd, vocab=4096, seq=64, batch=4, warmup=3, steps=12,
                                   progress=lambda kind: print(f"  done: {kind}", flush=True))
    return {"rows": rows, "psi": psi, "world": world, "layers": layers, "embd": embd}


def write_speed(data: dict) -> None:
    plt = _plt()
    ok = {k: v for k, v in data["rows"].items() if isinstance(v, tuple)}
    labels = list(ok)
    colors = ["#777777" if k == "ddp" else "#ff7f0e" if k == "fsdp2" else "#1f77b4" for k in labels]
    what = f"GPT {data['layers']}x{data['embd']} ({data['psi']:,} parameters), {data['world']} gloo ranks, fp32"
    for name, index, scale, ylabel, title in (
            ("step_time", 0, 1e3, "step time (ms)", "Step time by stage against DDP and FSDP2"),
            ("peak_memory", 2, 1 / 2**20, "peak allocated per rank (MiB)", "Peak memory per rank against FSDP2")):
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        values = [ok[k][index] * scale for k in labels]
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n{what}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        _save(fig, f"{name}.png")
        plt.close(fig)
    ddp, fsdp = ok.get("ddp"), ok.get("fsdp2")
    rows = []
    for kind, row in data["rows"].items():
        if not isinstance(row, tuple):
            rows.append([kind, row, "", "", "", ""])
            continue
        t, states, peak, _ = row
        rows.append([kind, f"{t * 1e3:.1f}", f"{t / ddp[0]:.2f}x" if ddp else "-", f"{states / 2**20:.2f}",
                     f"{peak / 2**20:.2f}", f"{peak / fsdp[2]:.2f}x" if fsdp else "-"])
    table = _table(["config", "step ms", "vs DDP", "model states MiB", "peak MiB (allocator)", "peak vs FSDP2"], rows)
    note = (f"\n\n{what}; batch 4x64 tokens per rank; median step of 12 after 3 warm-up steps; DDP and FSDP2 use "
            "torch.optim.AdamW (fused where torch has it). The peak is torch's allocator high-water mark over building "
            "the job and two steps (everything: parameters, gradients, optimizer states, gathered parameters, "
            "buffers, activations). On gloo, communication is emulated: the time ratio measures overheads, not a "
            "network. Produced by benchmarks/bench_zero.py.")
    _write("step_time", "Step time by stage against DDP and FSDP2", table + note, "step_time.png")
    _write("peak_memory", "Peak memory per rank by stage against FSDP2", table + note, "peak_memory.png")


# -- CPU Adam ----------------------------------------------------------------------------------


def adam_report(n: int = 10_000_000, reps: int = 5) -> dict:
    import bench_adam
    import torch

    threads = torch.get_num_threads()
    rows = bench_adam.cpu_rows(n, reps, 2, threads, with_deepspeed=True)
    return {"rows": rows, "n": n, "threads": threads}


def write_adam(data: dict) -> None:
    plt = _plt()
    rows = [r for r in data["rows"] if r.seconds is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.0))
    for ax, copy_out in zip(axes, (False, True)):
        mine = [r for r in rows if r.copy_out == copy_out]
        if not mine:
            continue
        names = [r.name.replace(" (", "\n(") for r in mine]
        colors = ["#1f77b4" if r.name.lower().startswith("zero") else "#999999" for r in mine]
        bars = ax.barh(names, [r.gbps() for r in mine], color=colors)
        ax.bar_label(bars, labels=[f"{r.fraction:.0%}" for r in mine], fontsize=8, padding=2)
        ax.axvline(mine[0].ceiling_gbps, color="#d62728", ls="--", lw=1, label="bandwidth ceiling (stream pass)")
        ax.set_xlabel("GB/s of optimizer traffic")
        ax.set_title("fp32 only" if not copy_out else "with bf16 copy-out", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Adam step, {data['n'] / 1e6:g}M parameters, {data['threads']} threads (labels: share of the ceiling)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _save(fig, "cpu_adam.png")
    plt.close(fig)
    baseline = {r.copy_out: r.seconds for r in rows if r.name.startswith("torch AdamW (default)")}
    table = _table(["optimizer", "copy-out", "ms/step", "GB/s", "of ceiling", "vs torch default"],
                   [[r.name, "bf16" if r.copy_out else "-", f"{r.seconds * 1e3:.2f}", f"{r.gbps():.1f}",
                     f"{r.fraction:.0%}", f"{baseline[r.copy_out] / r.seconds:.2f}x" if r.copy_out in baseline else "-"]
                    for r in rows])
    missing = [f"- {r.name}: {r.note}" for r in data["rows"] if r.seconds is None]
    body = table + ("\n\nNot measured here:\n" + "\n".join(missing) if missing else "")
    body += ("\n\nGB/s counts 28 bytes per parameter (30 with the bf16 copy); the ceiling is a stream pass with the "
             "same traffic, threads and tiles, run beside each timed step. Produced by benchmarks/bench_adam.py.")
    _write("cpu_adam", "CPU Adam throughput against its peers and the bandwidth ceiling", body, "cpu_adam.png")


SECTIONS = {"memory": (memory_report, write_memory), "speed": (speed_report, write_speed),
            "adam": (adam_report, write_adam)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args(argv)
    try:
        _plt()
    except ImportError:
        parser.error("the plots need matplotlib: pip install 'zero[bench]'")
    for name in args.only:
        measure, write = SECTIONS[name]
        print(f"{name}: measuring ...", flush=True)
        write(measure())
    return 0


if __name__ == "__main__":
    sys.exit(main())

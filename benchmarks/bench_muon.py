"""Muon under ZeRO against AdamW under ZeRO: bytes sent, step time, model-state bytes, owner balance,
and where Newton-Schulz runs best, the same GPT on the same gloo ranks in the same run.

    python benchmarks/bench_muon.py [--world 2] [--layers 4] [--embd 256] [--write]
    python benchmarks/bench_muon.py --gpu [--write]        # Newton-Schulz on one CUDA GPU vs the host

Each configuration runs in fresh rank processes (one thread each), bf16, micro-batch 4 x 64 tokens:
- communication per step (the comm report of the last step: every collective's logical bytes) with
  AdamW and with Muon at stages 1, 2 and 3 (stage 3 gathering per linear layer, in forward and again
  in backward), and their ratio: issue 34 asks Muon <= 1.1x Adam;
- step time (median over ranks of the median step after warm-up) and the optimizer step's share
  (`wall_clock_breakdown`), with and without optimizer offload;
- model-state bytes per trainable parameter over all ranks, measured by memory_report() at stage 3;
- the Newton-Schulz work of the most loaded owner rank over the mean (zero.optim.muon.assign_owners).
Then, in this process, the time of one Muon update of a matrix of each shape the GPT has, with the
master and momentum in host memory: Newton-Schulz on the host (its BLAS, every core) and, with --gpu,
on the GPU with the bf16 update crossing the bus (see [Note: Newton-Schulz under offload]); and the
host step of offloaded Lion and Adagrad, zero's native kernels against the torch optimizers.
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
from zero.testing.dist import run_once  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run_one(optimizer: str, stage: int, offload: bool, layers: int, embd: int, steps: int) -> dict:
    import zero
    from zero.models import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=max(1, embd // 64), n_embd=embd))
    zc = {"stage": stage}
    if stage == 3:  # a unit per linear layer, gathered in forward and again in backward
        zc.update(stage3_param_persistence_threshold=10_000, stage3_module_granularity_threshold=embd * embd,
                  stage3_max_reuse_distance=0, stage3_max_live_parameters=0)
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    opt = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3}} if optimizer == "Muon" else \
        {"type": "AdamW", "params": {"lr": 3e-3}}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": zc, "optimizer": opt,
        "wall_clock_breakdown": True})
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(steps + 2):
        x = torch.randint(0, 256, (4, 64), generator=g)
        start = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        times.append(time.perf_counter() - start)
    comm = engine.comm_report()
    memory = engine.memory_report()
    split = engine.wall_clock_report() if hasattr(engine, "wall_clock_report") else {}
    psi = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    return {"bytes": sum(c["bytes"] for c in comm.values()), "calls": sum(c["calls"] for c in comm.values()),
            "step_ms": statistics.median(times[2:]) * 1e3, "split": split,
            "states": memory["model_states_total"], "psi": psi}


def step_share(split: dict) -> float:
    """The optimizer step's share of a step, from wall_clock_report()'s mean times."""
    parts = {k: v for k, v in split.items() if k in ("forward", "backward", "step")}
    return parts.get("step", 0.0) / sum(parts.values()) if parts and sum(parts.values()) else float("nan")


def newton_schulz_times(shapes: list[tuple[int, int]], gpu: bool, repeat: int = 5) -> list[dict]:
    """One Muon update per shape, master and momentum in host memory: host only, and with the GPU."""
    from zero.optim.muon import update_matrix

    rows = []
    for shape in shapes:
        param, grad, buf = torch.randn(shape), torch.randn(shape), torch.zeros(shape)
        row = {"shape": shape}
        for where in ("host", "gpu") if gpu else ("host",):
            device = torch.device("cuda") if where == "gpu" else None
            grad_on = grad.cuda() if where == "gpu" else grad
            update_matrix(param, grad_on, buf, ns_device=device, lr=0.02)  # warm-up (cuBLAS handles, threads)
            if where == "gpu":
                torch.cuda.synchronize()
            samples = []
            for _ in range(repeat):
                start = time.perf_counter()
                update_matrix(param, grad_on, buf, ns_device=device, lr=0.02)
                if where == "gpu":
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - start)
            row[where] = statistics.median(samples) * 1e3
        rows.append(row)
    return rows


def host_optimizer_times(n: int = 8_000_000, repeat: int = 5) -> list[tuple[str, float, float]]:
    """The host step of optimizer offload for Lion and Adagrad over `n` fp32 elements with a bf16
    gradient: zero's native kernel (zero/ops/cpu_optim.py) against the torch optimizer on the same
    tensors (zero.optim.lion.Lion; torch.optim.Adagrad with its default foreach implementation)."""
    grad = torch.randn(n).bfloat16()
    rows = []
    for name in ("Lion", "Adagrad"):
        native, reference = _host_steps(name, n, grad)
        times = []
        for fn in (native, reference):
            fn()  # warm-up (the op's build, the optimizer's state)
            samples = []
            for _ in range(repeat):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples) * 1e3)
        rows.append((name, *times))
    return rows


def _host_steps(name: str, n: int, grad: torch.Tensor):
    """(native step, torch step) of one optimizer on fresh tensors of `n` elements."""
    from zero.ops.cpu_optim import adagrad_step, lion_step
    from zero.optim.lion import Lion

    param, state = torch.randn(n), torch.zeros(n)
    p = torch.nn.Parameter(torch.randn(n))
    if name == "Lion":
        opt = Lion([p], lr=1e-4, weight_decay=0.1)

        def native():
            lion_step(param, grad, state, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    else:
        opt = torch.optim.Adagrad([p], lr=1e-2, weight_decay=0.01)

        def native():
            adagrad_step(param, grad, state, clr=1e-2, eps=1e-10, weight_decay=0.01)

    def reference():
        p.grad = grad.float()  # the host copy of a bf16 gradient, as the torch path needs it
        opt.step()

    return native, reference


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="only the Newton-Schulz placement, on a CUDA GPU")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/muon[_gpu].md")
    args = parser.parse_args(argv)
    e = args.embd
    shapes = [(3 * e, e), (e, e), (4 * e, e), (e, 4 * e)]
    lines = []
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu needs a CUDA GPU")
        big = [(3 * 2048, 2048), (2048, 2048), (4 * 2048, 2048), (2048, 4 * 2048)]
        lines += [f"# Newton-Schulz under optimizer offload: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                  f"{time.strftime('%Y-%m-%d')}", "",
                  "One Muon update, master and momentum in host memory (zero/optim/muon.py, [Note: Newton-Schulz under "
                  "offload]); median of 5, ms.", "", "| matrix | host BLAS | GPU (bf16 over the bus) | host / GPU |",
                  "|---|---:|---:|---:|"]
        for row in newton_schulz_times(shapes + big, gpu=True):
            lines.append(f"| {row['shape'][0]} x {row['shape'][1]} | {row['host']:.2f} | {row['gpu']:.2f} | "
                         f"{row['host'] / row['gpu']:.1f}x |")
        _emit(lines, RESULTS / "muon_gpu.md" if args.write else None)
        return

    from zero.optim.muon import assign_owners, ns_cost

    lines += [f"# Muon under ZeRO against AdamW: {args.layers}-layer GPT, width {e}, {args.world} gloo ranks (CPU), "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
              "Same model, data and ranks; bf16; micro-batch 4 x 64 tokens; medians after 2 warm-up steps "
              "(python benchmarks/bench_muon.py).", "",
              "## Communication per step (comm report) and step time", "",
              "| stage | offload | AdamW bytes | Muon bytes | Muon / AdamW | AdamW ms | Muon ms | Muon / AdamW "
              "| optimizer step share, AdamW / Muon |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    measured = {}
    for stage, offload in ((1, False), (2, False), (3, False), (2, True), (3, True)):
        pair = {}
        for optimizer in ("AdamW", "Muon"):
            results, _ = run_once(args.world, run_one, optimizer, stage, offload, args.layers, e, args.steps)
            pair[optimizer] = {"bytes": max(r["bytes"] for r in results), "step_ms": statistics.median(
                r["step_ms"] for r in results), "share": step_share(results[0]["split"]),
                "states": max(r["states"] for r in results), "psi": results[0]["psi"]}
        measured[(stage, offload)] = pair
        a, m = pair["AdamW"], pair["Muon"]
        lines.append(f"| {stage} | {'optimizer' if offload else 'none'} | {a['bytes']:,} | {m['bytes']:,} | "
                     f"{m['bytes'] / a['bytes']:.3f} | {a['step_ms']:.0f} | {m['step_ms']:.0f} | "
                     f"{m['step_ms'] / a['step_ms']:.2f} | {a['share']:.0%} / {m['share']:.0%} |")
    a, m = measured[(3, False)]["AdamW"], measured[(3, False)]["Muon"]
    lines += ["", "## Model states at stage 3 (memory_report(), the most loaded rank)", "",
              f"- AdamW: {a['states'] * args.world / a['psi']:.2f} B per trainable parameter over all ranks",
              f"- Muon: {m['states'] * args.world / m['psi']:.2f} B (its matrices keep one fp32 momentum: 12 B each in "
              f"bf16; the tables and norms keep AdamW's 16)"]
    work = [ns_cost(s) for s in shapes * args.layers]
    loads = [0] * args.world
    for w, r in zip(work, assign_owners(shapes * args.layers, args.world)):
        loads[r] += w
    lines += ["", "## Owner balance", "",
              f"Newton-Schulz work of the most loaded of {args.world} ranks over the mean: "
              f"{max(loads) / (sum(loads) / args.world):.3f} ({len(work)} matrices, largest first to the least "
              f"loaded rank)", "",
              "## One Muon update on the host (offload without a GPU), ms, median of 5", "",
              f"Host BLAS with {torch.get_num_threads()} thread(s); with a GPU, Newton-Schulz moves there (run --gpu).",
              "", "| matrix | host |", "|---|---:|"]
    for row in newton_schulz_times(shapes, gpu=False):
        lines.append(f"| {row['shape'][0]} x {row['shape'][1]} | {row['host']:.2f} |")
    lines += ["", "## Optimizer offload for Lion and Adagrad: the host step, 8M fp32 elements, bf16 gradient, ms", "",
              f"zero's native kernel (zero/ops/cpu_optim.py) against the torch optimizer on the same tensors, "
              f"{torch.get_num_threads()} thread(s), median of 5.", "",
              "| optimizer | native | torch | torch / native |", "|---|---:|---:|---:|"]
    for name, native, reference in host_optimizer_times():
        lines.append(f"| {name} | {native:.1f} | {reference:.1f} | {reference / native:.1f}x |")
    _emit(lines, RESULTS / "muon.md" if args.write else None)


def _emit(lines: list[str], path: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if path is not None:
        path.write_text(text)


if __name__ == "__main__":
    main()

"""The longest sequence a dense-attention HF Llama trains on at a fixed memory budget per rank, on 4
gloo ranks: plain ZeRO-3 with checkpointing, + tiled MLP and logits-loss, + Ulysses sequence
parallelism over the 4 ranks; and what sequence parallelism costs per token.

    python benchmarks/bench_long_context.py                    # 32 MiB per rank, writes nothing
    python benchmarks/bench_long_context.py --write            # + benchmarks/results/long_context.{md,png}

- Model: a Llama (transformers' LlamaForCausalLM, SDPA attention: dense, causal) with the shape
  ratios of Llama-3-8B scaled down: hidden 64, 4 query and 2 key/value heads, MLP 224, vocabulary
  2048 (32x the hidden size, as 128256 is to 4096), 2 layers; fp32 on the CPU. ZeRO stage 3 with
  AdamW, gradient checkpointing on every layer (transformers' own), micro-batch 1.
- Variants, all on the same 4 ranks: (1) plain: the model's logits over the whole sequence, then
  the loss; (2) tiled: every MLP through `TiledMLP` and the vocabulary projection + cross-entropy
  through `TiledFusedLogitsLoss`, in tiles of 256 and 64 tokens (the logits of a tile: 0.5 MiB,
  about the share of memory ALST's tiles take of an 80 GB GPU); (3) tiled + Ulysses: (2) with
  `UlyssesSPAttentionHF` over the 4 ranks, each holding a quarter of one sequence. In (1) and (2)
  each rank trains its own sequence (data parallelism).
- Peak: the most of 3 training steps (forward, backward, AdamW step) at a length, after a warm-up
  step, each measured as the end table does (zero.monitor.StepPeak: the bytes the engine holds at the step's start plus the
  most torch's CPU allocator adds during it), the most over the ranks. The longest length: the
  estimator (zero.estimate_activations + estimate_memory) proposes the longest multiple of 256 that
  fits, then measured steps move from there by 256 (or 2%) until one fits and the next does not;
  the table gives both, with the estimate beside the measurement.
- Same numbers: from the same weights, one step on one shared 1024-token sequence in every
  variant gives the loss over the whole sequence and the global gradient norm.
- Cost per token: at --time-len tokens, variant (2) (4 ranks, 4 sequences) against (3) (4 ranks,
  one sequence), mean of --reps timed steps after a warm-up; the all-to-all bytes are the comm
  report's "all_to_all (sequence)" of a step.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 4
TILE = 256  # tokens per tile of the tiled MLP
LOSS_TILE = 64  # tokens per tile of the logits-loss: 64 x 2048 logits, 0.5 MiB (Llama-3-8B's tiles are ~1 GiB of 80)
STEP = 256  # lengths are multiples of this
REPEATS = 3  # steps measured per length
VARIANTS = {"plain": "ZeRO-3 + checkpointing", "tiled": "+ tiled MLP and logits-loss",
            "ulysses": "+ Ulysses sequence parallelism over 4 ranks"}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20, use_cache=False)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model.train()


def _logits_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


class LongContextLM(nn.Module):
    """The Llama and its loss, `scale` x the summed cross-entropy of this rank's tokens (scale:
    1 / valid tokens of the sequence, x the group size under sequence parallelism, as
    zero.sequence.sequence_loss weighs it). Tiled: zero.sequence.tile_mlps and tiled_causal_lm_loss."""

    def __init__(self, lm: nn.Module, tiled: bool):
        super().__init__()
        self.lm, self.tiled = lm, tiled
        if tiled:
            from zero.sequence import tile_mlps

            tile_mlps(lm, tokens_per_tile=TILE)

    def forward(self, input_ids, shift_labels, position_ids, scale):
        if not self.tiled:
            return _logits_loss(self.lm(input_ids=input_ids, position_ids=position_ids).logits, shift_labels) * scale
        from zero.sequence import tiled_causal_lm_loss

        return tiled_causal_lm_loss(self.lm, input_ids, shift_labels, position_ids, tokens_per_tile=LOSS_TILE) * scale


def _engine(variant: str):
    import zero
    from zero.sequence.hf import UlyssesSPAttentionHF

    torch.manual_seed(0)
    lm = llama()
    mpu = None
    if variant == "ulysses":
        mpu = UlyssesSPAttentionHF.register_with_transformers(lm, "sdpa", WORLD, 1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = zero.initialize(model=LongContextLM(lm, tiled=variant != "plain"), config=config, mpu=mpu)
    return engine, config


def _batch(variant: str, length: int, seed: int) -> dict:
    """This rank's part of a sequence of `length` tokens (its own in data parallelism, the shared
    one's slice under sequence parallelism)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed if variant == "ulysses" else seed * WORLD + rank)
    ids = torch.randint(0, 2048, (1, length), generator=g)
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    positions = torch.arange(length).unsqueeze(0)
    valid = int((shift != -100).sum())
    if variant != "ulysses":
        return dict(input_ids=ids, shift_labels=shift, position_ids=positions, scale=torch.tensor(1.0 / valid))
    part = slice(rank * length // WORLD, (rank + 1) * length // WORLD)
    return dict(input_ids=ids[:, part], shift_labels=shift[:, part], position_ids=positions[:, part],
                scale=torch.tensor(WORLD / valid))


def _step(engine, batch: dict) -> torch.Tensor:
    loss = engine(**batch)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _measured_peak(engine, variant: str, length: int) -> tuple[float, float]:
    """(least, most) over REPEATS steps at this length of the most any rank reached in the step (the
    peak of a step varies with the timing of the collectives' threads: see the results)."""
    from zero.monitor import StepPeak

    peaks = []
    for r in range(REPEATS):
        batch = _batch(variant, length, seed=length + r)
        probe = StepPeak(engine)
        _step(engine, batch)
        peak = torch.tensor(probe.stop(), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks.append(float(peak))
    return min(peaks), max(peaks)


def _estimated_peak(engine, config: dict, variant: str, length: int) -> float:
    from zero.estimate import estimate_activations, estimate_memory

    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in _batch(variant, length, 0).items()}
    act = estimate_activations(engine.module, meta)
    row = estimate_memory(engine.module, WORLD, stage=3, offload="none", dtype="fp32", config=config, activations=act)[0]
    return float(row.peak_bytes + row.host_bytes)  # the CPU: one memory


def longest(variant: str, budget: float) -> dict:
    """Each rank: the estimator's longest length, then measured steps around it (see the docstring)."""
    engine, config = _engine(variant)
    _step(engine, _batch(variant, 1024, seed=1))  # warm-up: ops built, stage 3's order recorded
    fits = lambda n: _estimated_peak(engine, config, variant, n) <= budget  # noqa: E731
    lo, hi = STEP, STEP
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > STEP:  # the estimator's longest multiple of STEP
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    points = []  # (length, least measured, most measured, estimated)

    def fits_measured(n: int) -> bool:  # every step must fit
        points.append((n, *_measured_peak(engine, variant, n), _estimated_peak(engine, config, variant, n)))
        return points[-1][2] <= budget

    delta = lambda n: max(STEP, int(0.02 * n) // STEP * STEP)  # noqa: E731
    best = worst = None
    length = lo
    if fits_measured(length):  # up until one does not fit
        best = length
        while fits_measured(length + delta(length)):
            length += delta(length)
            best = length
        worst = length + delta(length)
    else:  # down until one fits
        worst = length
        while length - delta(length) >= STEP and not fits_measured(length - delta(length)):
            length -= delta(length)
            worst = length
        best = length - delta(length) if length - delta(length) >= STEP else None
    return {"variant": variant, "longest": best, "first_over": worst, "points": points}


def same_numbers(variant: str) -> tuple[float, float]:
    """Loss over the whole shared sequence and the global gradient norm after one step."""
    engine, _ = _engine(variant)
    batch = _batch(variant, 1024, seed=7)
    if variant != "ulysses":  # every rank the same sequence: the one the sequence-parallel group shares
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, 2048, (1, 1024), generator=g)
        shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        batch = dict(input_ids=ids, shift_labels=shift, position_ids=torch.arange(1024).unsqueeze(0),
                     scale=torch.tensor(1.0 / 1023))
    loss = _step(engine, batch)
    whole = loss.clone()
    dist.all_reduce(whole)  # sum over ranks: WORLD x the mean (data parallel), or WORLD x the mean (the shares)
    return float(whole) / WORLD, float(engine.get_global_grad_norm())


def step_time(variant: str, length: int, reps: int) -> dict:
    from zero.sequence.ulysses import exchange_wait_s

    engine, _ = _engine(variant)
    _step(engine, _batch(variant, length, seed=1))
    times, waited = [], exchange_wait_s()
    for r in range(reps):
        dist.barrier()
        start = time.perf_counter()
        _step(engine, _batch(variant, length, seed=2 + r))
        times.append(time.perf_counter() - start)
    exchanged = engine.comm_report().get("all_to_all (sequence)", {"bytes": 0, "calls": 0})
    tokens = length * (1 if variant == "ulysses" else WORLD)
    return {"variant": variant, "seconds": sum(times) / len(times), "tokens": tokens, "all_to_all": exchanged,
            "all_to_all_s": (exchange_wait_s() - waited) / reps}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> None:
    from zero.testing.dist import DistPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=32.0, help="allocator budget per rank (MiB)")
    parser.add_argument("--time-len", type=int, default=4096, help="sequence length of the per-token cost")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/long_context.{md,png}")
    args = parser.parse_args(argv)
    budget = args.budget_mib * 2**20
    pool = DistPool(WORLD, collective_timeout=1800)
    try:
        numbers = {v: pool.run(same_numbers, v, timeout=1800)[0] for v in VARIANTS}
        print("same numbers (loss, grad norm):", numbers, flush=True)
        found = {}
        for v in VARIANTS:
            found[v] = pool.run(longest, v, budget, timeout=3600)[0]
            print(v, found[v], flush=True)
        timed = {v: pool.run(step_time, v, args.time_len, args.reps, timeout=3600)[0] for v in ("tiled", "ulysses")}
        print(timed, flush=True)
    finally:
        pool.close()
    text = report(found, numbers, timed, args)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "long_context.md").write_text(text)
        plot(found, budget, RESULTS / "long_context.png")


def report(found: dict, numbers: dict, timed: dict, args) -> str:
    base = found["plain"]["longest"]
    lines = [f"# Longest sequence at {args.budget_mib:g} MiB per rank (4 gloo ranks, HF Llama, ZeRO-3)", "",
             "Written by `python benchmarks/bench_long_context.py --write` (see its docstring for the method); "
             f"torch {torch.__version__}, CPU.", "",
             "| variant | longest that fits (tokens) | x plain | peak there, measured (MiB/rank, least-most of "
             f"{REPEATS} steps) | estimated (MiB/rank) | first that does not fit | loss, grad norm on a shared "
             "1024-token sequence |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for v, name in VARIANTS.items():
        f = found[v]
        at = next(p for p in f["points"] if p[0] == f["longest"])
        loss, norm = numbers[v]
        lines.append(f"| {name} | {f['longest']:,} | {f['longest'] / base:.1f}x | {_mib(at[1])}-{_mib(at[2])} | "
                     f"{_mib(at[3])} | "
                     f"{f['first_over']:,} | {loss:.6f}, {norm:.6f} |")
    lines += ["", f"Every measured length (length: measured least-most of {REPEATS} steps / estimated peak, MiB per "
              "rank; a length fits when its most does; the steps differ by up to 10 MiB at the longest lengths "
              "with the timing of the collectives (most under sequence parallelism: gloo's all-to-alls), which the "
              "estimate does not model):", ""]
    for v, name in VARIANTS.items():
        pts = ", ".join(f"{n:,}: {_mib(lo)}-{_mib(hi)} / {_mib(e)}" for n, lo, hi, e in found[v]["points"])
        lines.append(f"- {name}: {pts}")
    t, u = timed["tiled"], timed["ulysses"]
    per_tok = lambda r: r["seconds"] / r["tokens"]  # noqa: E731
    lines += ["", f"## Cost per token at {args.time_len:,} tokens", "",
              "| variant | tokens per step (4 ranks) | seconds per step | ms per 1k tokens | all-to-all per step and rank "
              "| waiting for them per step (rank 0) |",
              "|---|---:|---:|---:|---:|---:|"]
    for r, name in ((t, "data parallel, tiled"), (u, "Ulysses over 4 ranks, tiled")):
        a2a = r["all_to_all"]
        lines.append(f"| {name} | {r['tokens']:,} | {r['seconds']:.2f} | {per_tok(r) * 1e6:.1f} | "
                     f"{_mib(a2a['bytes'])} MiB in {a2a['calls']} | {r['all_to_all_s']:.3f} s |")
    lines += ["", f"Sequence parallelism costs {per_tok(u) / per_tok(t):.2f}x the time per token of data parallelism "
              f"here. Attention's work per token is the same in both (whole sequences of the same length; all heads "
              f"on one rank, or a quarter of them on each of 4), so the difference is the all-to-alls (the waiting "
              f"column: {u['all_to_all_s'] / u['seconds']:.0%} of the step) and the smaller matrix products and fixed "
              f"costs of a quarter of the tokens per rank. Four gloo ranks share 2 cores here: times are indicative "
              f"only."]
    return "\n".join(lines) + "\n"


def plot(found: dict, budget: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v, name in VARIANTS.items():
        pts = sorted(found[v]["points"])
        ax.plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], "o-", label=f"{name} (measured, most)")
        ax.plot([p[0] for p in pts], [p[3] / 2**20 for p in pts], "x--", alpha=0.6, label=f"{name} (estimated)")
    ax.axhline(budget / 2**20, color="grey", linestyle=":", label="budget")
    ax.set_xscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak per rank (MiB)")
    ax.set_title("Longest sequence at a fixed budget, 4 ranks, ZeRO-3")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""Block-sparse attention against dense SDPA and FlexAttention: forward+backward time, peak memory,
and the longest sequence that fits a memory budget.

    python benchmarks/bench_sparse_attention.py [--seqs 1024,2048,4096,8192,16384] [--reps 3] [--write]
    python benchmarks/bench_sparse_attention.py --memory-sweep 1024,4096,10240 [--write]

- Problem: batch 1, 12 heads, head_dim 64, fp32 on the CPU (bf16 on a GPU), torch's thread count
  for every method. Layouts: BigBird and Fixed (bidirectional, block 64), their parameters chosen
  per length for the density nearest 10% (the density of the full square, printed per row).
- Time: best of --reps of forward + backward (a fixed random output gradient; dense SDPA on the
  CPU at 8k and above: one run, no warm-up, as one run takes tens of seconds). Dense SDPA is
  `F.scaled_dot_product_attention(q, k, v)` without a mask: torch's fastest path (flash attention
  on the CPU), the baseline the targets name. FlexAttention is `torch.compile(flex_attention)` with
  the layout as a BlockMask of the same block size (compile time excluded). torch has no
  FlexAttention backward on the CPU, so there it is compared on the forward alone.
- Memory: `AllocatorPeak` (torch's allocator; our kernels allocate their work space through it)
  over forward + backward, above the inputs: outputs, gradients, saved tensors and work space.
  Besides dense SDPA without a mask, dense SDPA with the layout expanded to a boolean element
  mask (the same attention pattern computed densely) is measured, once.
- Budget: per method, the longest measured length whose peak fits --budget-mib. Beyond the table,
  our kernel alone is run at doubling lengths until it no longer fits, with DeepSpeed's default
  BigBird (window 3, random 1, global 1: a fixed number of blocks per row, so time grows linearly);
  dense SDPA is not run past the table's longest length (minutes per step on a CPU).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero.probes import AllocatorPeak  # noqa: E402
from zero.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 12, 64, 64


def bigbird(blocks: int) -> BigBirdSparsityConfig:
    """BigBird with a window of ~6% of the blocks, random blocks for the rest of ~10%."""
    window = max(3, round(0.06 * blocks) // 2 * 2 + 1)
    random = max(1, round(0.10 * blocks) - window - 2)
    return BigBirdSparsityConfig(HEADS, block=BLOCK, num_random_blocks=random, num_sliding_window_blocks=window)


def fixed(blocks: int) -> FixedSparsityConfig:
    """Fixed with the local window (one global block per window) whose density is nearest 10%."""
    best = min(range(1, blocks + 1), key=lambda n: abs(_density(FixedSparsityConfig(HEADS, block=BLOCK,
                                                                                    num_local_blocks=n), blocks) - 0.1))
    return FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=best)


def _density(config, blocks: int) -> float:
    return config.make_layout(blocks * BLOCK)[0].float().mean().item()


def _timed(fn, reps: int, warm_up: bool = True) -> float:
    if warm_up:  # (and, for FlexAttention, the compile)
        fn()
    best = math.inf
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _fwd_bwd(attend, q, k, v, dout):
    """Forward + backward; the gradients of the previous call are dropped first."""
    def step():
        _drop_grads(q, k, v)
        attend(q, k, v).backward(dout)
    return step


def _drop_grads(*tensors) -> None:
    for x in tensors:
        x.grad = None


def _peak(fn, device, *inputs) -> float:
    """MiB allocated above the start by one call of fn. The inputs' old gradients are dropped
    before the measurement starts: on the CPU, freeing inside it a block that an earlier
    measurement saw allocated counts against this one's peak."""
    _drop_grads(*inputs)
    with AllocatorPeak(device) as peak:
        fn()
    return peak.peak / 2**20


def _flex(layout: torch.Tensor, seq: int, device):
    """(compiled flex_attention, its BlockMask for `layout`), or (None, why)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:  # pragma: no cover - old torch
        return None, f"n/a ({exc})"
    allowed = layout[0].bool().to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[q_idx // BLOCK, kv_idx // BLOCK]

    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=device, BLOCK_SIZE=BLOCK)
    compiled = torch.compile(flex_attention)
    return (lambda q, k, v: compiled(q, k, v, block_mask=block_mask)), ""


def measure(seq: int, reps: int, device, dtype) -> tuple[dict, list[dict]]:
    """(dense numbers, one dict per layout) at one sequence length."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(device, dtype)
    dense = _fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v, dout)
    long = seq >= 8192 and device.type == "cpu"  # one dense run takes tens of seconds: time it once
    dense_row = {"time": _timed(dense, 1 if long else reps, warm_up=not long), "peak": _peak(dense, device, q, k, v)}
    rows = []
    blocks = seq // BLOCK
    for name, make in (("BigBird", bigbird), ("Fixed", fixed)):
        config = make(blocks)
        attention = SparseSelfAttention(config, max_seq_length=seq)
        layout = attention.get_layout(seq)
        ours = _fwd_bwd(attention, q, k, v, dout)
        row = {"layout": name, "seq": seq, "density": layout[0].float().mean().item(), "config": config,
               "time": _timed(ours, reps), "peak": _peak(ours, device, q, k, v)}
        with torch.no_grad():
            row["fwd"] = _timed(lambda a=attention: a(q, k, v), reps)
        flex, why = _flex(layout, seq, device)
        row["flex"] = why or None
        if flex is not None:
            try:
                with torch.no_grad():  # FlexAttention's CPU forward refuses inputs that require grad
                    row["flex_fwd"] = _timed(lambda f=flex: f(q.detach(), k.detach(), v.detach()), reps)
                if device.type == "cuda":
                    row["flex_time"] = _timed(_fwd_bwd(flex, q, k, v, dout), reps)
            except Exception as exc:  # noqa: BLE001 - report what torch says, keep measuring
                row["flex"] = f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
        if name == "BigBird":  # the same pattern computed densely, its element mask made inside the measurement
            blocks_kept = layout[0].bool().to(device)

            def masked(a, b, c, blocks=blocks_kept):
                element = blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                return F.scaled_dot_product_attention(a, b, c, attn_mask=element)

            dense_row["masked_peak"] = _peak(_fwd_bwd(masked, q, k, v, dout), device, q, k, v)
        rows.append(row)
        print(f"  {name} seq {seq}: density {row['density']:.3f}, ours {row['time'] * 1e3:.0f} ms vs dense "
              f"{dense_row['time'] * 1e3:.0f} ms", flush=True)
    return dense_row, rows


def longest_ours(start: int, budget: float, device, dtype, limit: int = 1 << 20) -> tuple[int, dict[int, float]]:
    """Our longest length (doubling from `start`) within `budget` MiB with a fixed-width BigBird."""
    peaks: dict[int, float] = {}
    seq = start
    while seq <= limit:
        q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM).to(device, dtype).requires_grad_() for _ in range(3))
        attention = SparseSelfAttention(BigBirdSparsityConfig(HEADS, block=BLOCK), max_seq_length=seq)
        peaks[seq] = _peak(_fwd_bwd(attention, q, k, v, torch.ones_like(q)), device, q, k, v)
        print(f"  ours, BigBird(3, 1, 1) at {seq:,}: {peaks[seq]:,.0f} MiB", flush=True)
        del q, k, v
        if peaks[seq] > budget:
            break
        seq *= 2
    fits = [s for s, p in peaks.items() if p <= budget]
    return (max(fits) if fits else 0), peaks


def memory_sweep(budgets: list[float], device, dtype) -> str:
    """The longest power-of-two length each method fits in each budget: dense SDPA with the
    BigBird element mask (the same attention pattern computed densely: its memory grows with
    seq^2) and ours with DeepSpeed's default BigBird (window 3, random 1, global 1: linear), each
    run at doubling lengths from 1,024 until it, or the next length at the growth of the last
    doubling, exceeds the largest budget (that next length is not run). Dense SDPA without a
    mask is left out here: on the CPU it is flash attention, linear too (see the main table)."""
    top = max(budgets)
    masked: dict[int, float] = {}
    ours: dict[int, float] = {}
    for peaks, attend in ((masked, "masked"), (ours, "ours")):
        seq = 1024
        while True:
            q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM).to(device, dtype).requires_grad_() for _ in range(3))
            config = BigBirdSparsityConfig(HEADS, block=BLOCK)
            attention = SparseSelfAttention(config, max_seq_length=seq)
            if attend == "masked":
                element = attention.get_layout(seq)[0].bool().to(device)

                def fn(a, b, c, blocks=element):
                    mask = blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                    return F.scaled_dot_product_attention(a, b, c, attn_mask=mask)
            else:
                fn = attention
            start = time.perf_counter()
            peaks[seq] = _peak(_fwd_bwd(fn, q, k, v, torch.ones_like(q)), device, q, k, v)
            print(f"  {attend} at {seq:,}: {peaks[seq]:,.0f} MiB ({time.perf_counter() - start:.0f} s)", flush=True)
            del q, k, v
            sizes = sorted(peaks)
            growth = peaks[sizes[-1]] / peaks[sizes[-2]] if len(sizes) > 1 else 4.0
            if peaks[seq] > top or peaks[seq] * growth > top:  # the next length would not fit (or the host)
                break
            seq *= 2
    rows = ["| budget MiB | dense SDPA + element mask | ours, BigBird(3, 1, 1) | ratio |", "| --- | --- | --- | --- |"]
    for budget in budgets:
        a = max((s for s, p in masked.items() if p <= budget), default=0)
        b = max((s for s, p in ours.items() if p <= budget), default=0)
        rows.append(f"| {budget:,.0f} | {a:,} | {b:,} | {b / a if a else math.inf:.0f}x |")
    measured = ["", "Measured peaks (MiB above the inputs, forward + backward): dense + element mask "
                + ", ".join(f"{s:,}: {p:,.0f}" for s, p in masked.items()) + "; ours "
                + ", ".join(f"{s:,}: {p:,.0f}" for s, p in ours.items())]
    return "\n".join(rows + measured)


def longest_within(peaks: dict[int, float], budget: float) -> str:
    fits = [s for s, p in sorted(peaks.items()) if p <= budget]
    if not fits:
        return "none measured"
    return f"{fits[-1]:,}" + (" (the longest measured)" if fits[-1] == max(peaks) else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    parser.add_argument("--memory-sweep", default=None, metavar="MIB,MIB",
                        help="only the longest sequence each method fits in each of these budgets (see memory_sweep)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/sparse_attention.md and .png")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.memory_sweep:
        text = memory_sweep([float(b) for b in args.memory_sweep.split(",")], device, dtype)
        where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
        text = (f"batch 1, {HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK}, {str(dtype).replace('torch.', '')}, "
                f"{where}\n\nLongest power-of-two sequence whose forward + backward fits each budget "
                f"(`--memory-sweep`):\n\n" + text)
        print(text)
        if args.write:
            from report import _write

            _write("sparse_attention_memory", "Block-sparse attention: the longest sequence a memory budget holds",
                   text, None)
        return 0
    seqs = [int(s) for s in args.seqs.split(",")]
    dense, rows = {}, []
    for seq in seqs:
        dense[seq], layout_rows = measure(seq, args.reps, device, dtype)
        rows += layout_rows

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = [f"batch 1, {HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK}, {str(dtype).replace('torch.', '')}, {where}; "
             f"best of {args.reps} (dense SDPA on the CPU at 8k and above: one run)", "",
             "Forward + backward (ms) and peak memory above the inputs (MiB):", "",
             "| layout | seq | density | dense SDPA ms | ours ms | speed-up | dense MiB | dense + element mask MiB "
             "| ours MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        d = dense[r["seq"]]
        lines.append(f"| {r['layout']} | {r['seq']:,} | {r['density']:.1%} | {d['time'] * 1e3:,.0f} | "
                     f"{r['time'] * 1e3:,.0f} | {d['time'] / r['time']:.1f}x | {d['peak']:,.0f} | "
                     f"{d.get('masked_peak', math.nan):,.0f} | {r['peak']:,.0f} |")
    flex_head = "FlexAttention fwd+bwd ms | " if device.type == "cuda" else ""
    lines += ["", "Against FlexAttention (compiled, same block mask)" +
              ("" if device.type == "cuda" else "; forward only: torch has no FlexAttention backward on the CPU") + ":",
              "", f"| layout | seq | FlexAttention fwd ms | ours fwd ms | ours vs Flex | {flex_head}",
              "| --- | --- | --- | --- | --- |" + (" --- |" if flex_head else "")]
    for r in rows:
        if "flex_fwd" not in r:
            lines.append(f"| {r['layout']} | {r['seq']:,} | {r['flex']} | {r['fwd'] * 1e3:,.1f} | | " +
                         ("|" if flex_head else ""))
            continue
        extra = f" {r['flex_time'] * 1e3:,.1f} |" if flex_head else ""
        lines.append(f"| {r['layout']} | {r['seq']:,} | {r['flex_fwd'] * 1e3:,.1f} | {r['fwd'] * 1e3:,.1f} | "
                     f"{r['flex_fwd'] / r['fwd']:.2f}x |{extra}")
    budget = args.budget_mib
    lines += ["", f"Longest measured sequence whose forward + backward fits {budget:,.0f} MiB:", "",
              f"- dense SDPA (flash, no mask): {longest_within({s: d['peak'] for s, d in dense.items()}, budget)}",
              f"- dense SDPA with the BigBird element mask: "
              f"{longest_within({s: d['masked_peak'] for s, d in dense.items()}, budget)}"]
    for name in ("BigBird", "Fixed"):
        peaks = {r["seq"]: r["peak"] for r in rows if r["layout"] == name}
        lines.append(f"- ours, {name}: {longest_within(peaks, budget)}")
    longest, sweep = longest_ours(max(seqs) * 2, budget, device, dtype)
    lines.append(f"- ours, DeepSpeed's default BigBird (window 3, random 1, global 1), run at doubling lengths: "
                 f"{longest:,} (" + ", ".join(f"{s:,}: {p:,.0f} MiB" for s, p in sweep.items()) + ")")
    lines += ["", "Layout parameters per length: " + "; ".join(
        f"{r['layout']} {r['seq']:,}: " + (f"window {r['config'].num_sliding_window_blocks}, random "
                                           f"{r['config'].num_random_blocks}, global {r['config'].num_global_blocks}"
                                           if r["layout"] == "BigBird" else
                                           f"local {r['config'].num_local_blocks}, global {r['config'].num_global_blocks}")
        for r in rows)]
    text = "\n".join(lines)
    print(text)
    if args.write:
        from report import _plt, _save, _write

        plt = _plt()
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        left.plot(seqs, [dense[s]["time"] * 1e3 for s in seqs], "o-", label="dense SDPA")
        for name in ("BigBird", "Fixed"):
            mine = [r for r in rows if r["layout"] == name]
            left.plot([r["seq"] for r in mine], [r["time"] * 1e3 for r in mine], "o-", label=f"ours, {name} (density: see table)")
        left.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="forward + backward ms",
                 title="time")
        right.plot(seqs, [dense[s]["peak"] for s in seqs], "o-", label="dense SDPA")
        right.plot(seqs, [dense[s]["masked_peak"] for s in seqs], "o--", label="dense SDPA + element mask")
        for name in ("BigBird", "Fixed"):
            mine = [r for r in rows if r["layout"] == name]
            right.plot([r["seq"] for r in mine], [r["peak"] for r in mine], "o-", label=f"ours, {name}")
        right.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="peak MiB above inputs",
                  title="memory")
        for ax in (left, right):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Block-sparse attention, {HEADS} heads x {HEAD_DIM}, block {BLOCK} ({where})")
        fig.tight_layout()
        _save(fig, "sparse_attention.png")
        _write("sparse_attention", "Block-sparse attention against dense SDPA and FlexAttention", text,
               "sparse_attention.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

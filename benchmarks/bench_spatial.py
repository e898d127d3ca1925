"""Spatial parallelism (issue 45): the largest cube per rank budget, activations, halo bytes and time.

The largest cube a 3D U-Net (ours and MONAI's) trains on at a fixed memory budget per rank on
P = 1, 2, 4 gloo ranks, activation memory per rank against P = 1, the halo exchange's bytes
against their formula and its share of the step time.

    python benchmarks/bench_spatial.py --quick                 # width 8, 48 MiB, P = 1, 2, no checkpointing
    python benchmarks/bench_spatial.py                          # 1 GiB per rank, P = 1, 2, 4, writes nothing
    python benchmarks/bench_spatial.py --write                  # + benchmarks/results/spatial.{md,png}

- Models: zero.models.UNet3D(width=32, depth=4, cin=1, cout=1), with and without its activation
  checkpointing (each conv block recomputed in backward); MONAI's UNet(spatial_dims=3, channels
  (32, 64, 128, 256), strides (2, 2, 2), num_res_units=2) and, for checkpointing, MONAI's own
  CheckpointUNet (the same network, its encoder-decoder blocks wrapped in checkpoints, nested).
  fp32 on the CPU, one thread per rank; ZeRO stage 3, AdamW, micro-batch 1. P = 1 is one process
  with the model unconverted (the plain loss `mean((out - y)^2)`); P > 1 is P processes with
  `spatial_parallel_size: P`, each fed `zero.spatial.shard_volume(x)` and the loss built with
  `zero.spatial.volume_mean` (docs/spatial.md, "Using it"). Each P has its own set of processes.
- Largest cube: cubes of edge e (e a multiple of 8, the 3 halvings of both networks, and e / 8 >= P
  so that every rank holds a plane at the deepest level). "Trains one step at edge e" means: on
  every rank, the CPU allocator's peak (zero.probes.AllocatorPeak: the most bytes torch's
  allocator held above its level at the start) over building the model, `zero.initialize` and
  one full step (forward, loss, backward, optimizer step) is within --budget-mib. The whole input
  and target volumes are made before the measured block and not counted (they stand for a loader
  that reads only the rank's slab: zero.spatial.data's read_slab); the rank's slabs of them
  (`shard_volume`, a copy; at P = 1 a clone of the whole) are made inside and counted. Memory
  outside torch's allocator (the Python heap, gloo's own buffers) is not counted. One run per
  edge, the most over the ranks. Search: the peak is nearly affine in voxels, so two edges are
  measured (the smallest valid one, 8 max(P, 2), and twice it); the line through the two measured
  points nearest the budget predicts the largest edge that fits, which is measured with its
  neighbour (the next edge if it fitted, the one before if not); a second round of prediction
  if that did not close the bracket, then bisection (doubling while nothing is over).
  Target: voxels(P) / voxels(1) >= 0.8 P.
- At one common edge (--edge; default the largest cube of UNet3D without checkpointing at P = 1,
  rounded down to a multiple of 8 with e / 8 >= the largest P), per model, checkpointing and P:
  after building the engine and one warm-up step, (a) the activation peak: AllocatorPeak over
  forward + loss + backward (model states already exist and are not counted; ZeRO-3's gathered
  parameters and gradient buckets are), its ratio P x peak(P) / peak(1), target <= 1.15; (b) the
  halo bytes of that step, engine.comm_report()["spatial_halo"]["bytes"] (what each rank sent,
  forward and backward), against the formula below; (c) the time of an unprofiled step, and the
  share of a profiled step spent in the halo all-to-alls (the "zero::spatial_halo"
  record_function ranges zero's Comm opens), in the whole fetch (the all-to-all and its copies:
  zero.spatial.halo's _exchange and _return, wrapped here in a "bench::halo_fetch" range) and in
  the plan's all-gathers and the norms' all-reduces ("zero::spatial_sizes", "zero::spatial_stats").
- Halo formula, computed here without zero.spatial: the model runs once at P = 1 on the meta
  device (forward, then backward), a pre-hook on every convolution, transposed convolution and
  pool recording its input shape and whether it ran in forward or in a checkpoint's recompute
  during backward. For each call, with input length L along depth and the canonical split of L
  and of the output length over P (the first L % P ranks one plane more), each rank's output
  slab reads the span of input planes that its windows touch (a convolution or pool: input plane
  o*s - pad + d*j for output plane o and kernel tap j; a transposed convolution: the planes i
  with i*s - pad + d*j = o); the planes of that span (inside [0, L)) that another rank owns are
  sent to it in forward, each worth N*C*H*W*4 bytes, and their gradient comes back in backward
  (once per forward-phase call whose input needs a gradient: a recompute's fetch has no backward
  of its own, and the network's input gets none). For a 3^3 convolution with padding 1 and
  stride 1 that is 2 (P - 1) planes over the group each way; a 2^3 pool or a stride-2 2^3
  transposed convolution needs none while every slab boundary is at an even plane, one where
  the canonical split of an odd length puts it at an odd one; MONAI's stride-2 3^3 convolutions
  (padding 1) read one plane below their slab, and its 3^3 transposed ones one above.
- Cost: each P runs in P processes of one thread; the full run (width 32, 1 GiB, P = 1, 2, 4,
  both networks with and without checkpointing) takes hours on a few cores and needs about
  P x 1.5 GiB of memory for P ranks. --quick (width 8, 48 MiB, P = 1, 2, no checkpointing) takes
  about a minute of CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

UNIT = 8  # both networks halve the volume 3 times: edges are multiples of 8
VARIANTS = (("unet3d", False), ("unet3d", True), ("monai", False), ("monai", True))
NAMES = {"unet3d": "zero.models.UNet3D", "monai": "MONAI UNet"}
ACT_TARGET, VOXEL_TARGET = 1.15, 0.8


def build(name: str, width: int, checkpointing: bool) -> nn.Module:
    """UNet3D(width, depth=4) or MONAI's UNet with channels (w, 2w, 4w, 8w), strides (2, 2, 2) and 2
    residual units (MONAI's CheckpointUNet with `checkpointing`)."""
    if name == "unet3d":
        from zero.models import UNet3D

        return UNet3D(width=width, depth=4, cin=1, cout=1, checkpointing=checkpointing)
    from monai.networks.nets import UNet
    from monai.networks.nets.unet import CheckpointUNet

    cls = CheckpointUNet if checkpointing else UNet
    return cls(spatial_dims=3, in_channels=1, out_channels=1, channels=tuple(width * 2**i for i in range(4)),
               strides=(2, 2, 2), num_res_units=2)


def variant_name(name: str, checkpointing: bool) -> str:
    if name == "monai":
        return "MONAI CheckpointUNet" if checkpointing else "MONAI UNet"
    return NAMES[name] + (" + checkpointing" if checkpointing else "")


# -- on each rank ---------------------------------------------------------------------------------


_FROZEN: list[bool] = []


def _engine(name: str, width: int, checkpointing: bool):
    import zero

    if not _FROZEN:  # the first time on this rank: the imports' objects out of the collector's way
        build(name, width, checkpointing)
        gc.collect()
        gc.freeze()  # (each engine.destroy() collects: 0.5-1 s per call with MONAI's 500k objects, not frozen)
        _FROZEN.append(True)
    world = dist.get_world_size()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3}, **({"spatial_parallel_size": world} if world > 1 else {})}
    engine, *_ = zero.initialize(model=build(name, width, checkpointing).train(), config=config)
    return engine


def _volumes(edge: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 1, edge, edge, edge, generator=g), torch.randn(1, 1, edge, edge, edge, generator=g)


def _slab(t: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return t.clone()
    from zero.spatial import shard_volume

    return shard_volume(t)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return (out - y).square().mean()
    from zero.spatial import volume_mean

    return volume_mean((out - y).square())


def _step(engine, x: torch.Tensor, y: torch.Tensor) -> None:
    engine.backward(_loss(engine(x), y))
    engine.step()


def _drop(engine) -> None:
    engine.destroy()
    del engine
    gc.collect()  # the engine's reference cycles: its memory, before the next measurement


def trains_one_step(name: str, width: int, checkpointing: bool, edge: int) -> float:
    """This rank's allocator peak over building the engine and one step at `edge` (see the docstring)."""
    from zero.probes import AllocatorPeak

    x, y = _volumes(edge, seed=edge)
    with AllocatorPeak() as mem:
        engine = _engine(name, width, checkpointing)
        _step(engine, _slab(x), _slab(y))
    _drop(engine)
    return float(mem.peak)


@contextlib.contextmanager
def _fetch_ranges():
    """Open a "bench::halo_fetch" profiler range around each halo fetch and its adjoint (the
    all-to-all with its packing and unpacking copies), for the time share; restored after."""
    from torch.autograd.profiler import record_function

    import zero.spatial.halo as halo

    saved = getattr(halo, "_exchange", None), getattr(halo, "_return", None)
    if None in saved:  # renamed: the "whole fetch" column reads 0
        yield
        return

    def wrap(fn):
        def ranged(*args, **kwargs):
            with record_function("bench::halo_fetch"):
                return fn(*args, **kwargs)
        return ranged

    halo._exchange, halo._return = map(wrap, saved)
    try:
        yield
    finally:
        halo._exchange, halo._return = saved


RANGES = {"halo": "zero::spatial_halo", "fetch": "bench::halo_fetch", "sizes": "zero::spatial_sizes",
          "stats": "zero::spatial_stats"}


def at_volume(name: str, width: int, checkpointing: bool, edge: int) -> dict:
    """This rank's activation peak, halo bytes and step times at `edge` (see the docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from zero.probes import AllocatorPeak

    x, y = _volumes(edge, seed=1)
    engine = _engine(name, width, checkpointing)
    xs, ys = _slab(x), _slab(y)  # (shard_volume splits over the group the engine made)
    _step(engine, xs, ys)  # warm-up: optimizer states made, stage 3's order recorded
    gc.collect()
    with AllocatorPeak() as mem:
        engine.backward(_loss(engine(xs), ys))
    engine.step()
    comm = engine.comm_report()
    dist.barrier()
    start = time.perf_counter()
    _step(engine, xs, ys)
    step_s = time.perf_counter() - start
    dist.barrier()
    with _fetch_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        _step(engine, xs, ys)
        profiled_s = time.perf_counter() - start
    spent = dict.fromkeys(RANGES, 0.0)
    for e in prof.events():
        for key, label in RANGES.items():
            if e.name == label:
                spent[key] += e.time_range.elapsed_us() * 1e-6
    _drop(engine)
    return {"activation_peak": float(mem.peak), "halo_bytes": comm.get("spatial_halo", {}).get("bytes", 0),
            "comm": {k: v for k, v in comm.items() if k.startswith("spatial")}, "step_s": step_s,
            "profiled_s": profiled_s, **{f"{k}_s": v for k, v in spent.items()}}


# -- the halo formula (no zero.spatial) -----------------------------------------------------------


def _split(length: int, parts: int) -> list[tuple[int, int]]:
    """The canonical split: the first length % parts ranks one plane more."""
    base, extra = divmod(length, parts)
    starts = [r * base + min(r, extra) for r in range(parts + 1)]
    return list(zip(starts[:-1], starts[1:]))


def _depth_geometry(module: nn.Module, length: int):
    """(output length, planes(o): the input planes output plane o reads) along depth (dimension 2)."""
    def at(v, default=1):
        v = default if v is None else v
        return v[0] if isinstance(v, (tuple, list)) else v
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        k, s, d, p, op = (at(module.kernel_size), at(module.stride), at(module.dilation), at(module.padding),
                          at(module.output_padding))
        out = (length - 1) * s - 2 * p + d * (k - 1) + op + 1
        return out, lambda o: [(o + p - d * j) // s for j in range(k) if (o + p - d * j) % s == 0]
    if isinstance(module, nn.modules.conv._ConvNd):
        k, s, d = at(module.kernel_size), at(module.stride), at(module.dilation)
        if module.padding == "valid":
            left = right = 0
        elif module.padding == "same":
            left, right = d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2
        else:
            left = right = at(module.padding)
    elif isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
        k = at(module.kernel_size)
        s, d = at(module.stride, k), at(getattr(module, "dilation", 1))
        left = right = at(module.padding)
    else:
        raise NotImplementedError(f"no halo formula for {type(module).__name__}")
    out = (length + left + right - d * (k - 1) - 1) // s + 1
    return out, lambda o: [o * s - left + d * j for j in range(k)]


def halo_planes(module: nn.Module, length: int, parts: int) -> list[list[int]]:
    """sent[q][r]: the input planes rank q sends rank r in forward for this layer."""
    out, reads = _depth_geometry(module, length)
    own = _split(length, parts)
    sent = [[0] * parts for _ in range(parts)]
    for r, (o0, o1) in enumerate(_split(out, parts)):
        planes = [i for o in range(o0, o1) for i in reads(o) if 0 <= i < length]
        if not planes:
            continue
        lo, hi = min(planes), max(planes) + 1  # the span the slab's windows read
        for q, (a, b) in enumerate(own):
            if q != r:
                sent[q][r] = max(0, min(b, hi) - max(a, lo))
    return sent


HALO_LAYERS = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)


def halo_formula(name: str, width: int, checkpointing: bool, edge: int, parts: int) -> dict:
    """Bytes each rank sends per training step by the formula: {"per_rank": [...], "conv3": [...]
    (the part from 3^3 stride-1 convolutions), "layers": calls seen}."""
    with torch.device("meta"):
        model = build(name, width, checkpointing).train()
    calls, phase = [], ["forward"]
    unsupported = [type(m).__name__ for m in model.modules() if isinstance(m, (nn.Upsample,))]
    if unsupported:
        raise NotImplementedError(f"no halo formula for {sorted(set(unsupported))}")
    def seen(module, args):  # the gradient of an input that needs none is not sent back
        backward = phase[0] == "forward" and args[0].requires_grad
        calls.append((module, tuple(args[0].shape), args[0].element_size(), backward))

    hooks = [m.register_forward_pre_hook(seen) for m in model.modules() if isinstance(m, HALO_LAYERS)]
    x = torch.empty(1, 1, edge, edge, edge, device="meta")
    out = model(x)
    phase[0] = "backward"  # what runs now is a checkpoint's recompute
    out.sum().backward()
    for h in hooks:
        h.remove()
    per_rank, conv3 = [0] * parts, [0] * parts
    for module, shape, size, backward in calls:
        plane = math.prod(shape) // shape[2] * size
        sent = halo_planes(module, shape[2], parts)
        simple = (isinstance(module, nn.Conv3d) and tuple(module.kernel_size) == (3, 3, 3)
                  and tuple(module.stride) == (1, 1, 1) and module.padding in ((1, 1, 1), "same"))
        for q in range(parts):
            planes = sum(sent[q])  # forward: q's planes others read
            if backward:
                planes += sum(sent[r][q] for r in range(parts))  # backward: the gradient of what q read
            per_rank[q] += planes * plane
            if simple:
                conv3[q] += planes * plane
    return {"per_rank": per_rank, "conv3": conv3, "calls": len(calls)}


# -- the search -------------------------------------------------------------------------------------


def largest_edge(measure, budget: float, smallest: int, predictions: int = 2, seed: int | None = None) -> dict:
    """The largest multiple of UNIT >= `smallest` whose measured peak (`measure(edge)`: the most
    over the ranks) is within `budget`: two edges measured (`seed` and its neighbour towards the
    budget when given, e.g. P = 1's edge scaled by P^(1/3); else `smallest` and twice it), then up
    to `predictions` rounds of an edge the line predicts and its neighbour (the next edge if it
    fitted, the previous if not), then bisection (doubling while nothing is over) until a fitting
    edge and the next are known."""
    peaks: dict[int, float] = {}
    lo, hi = 0, math.inf  # the largest edge that fits, the smallest that does not

    def measured(e: int) -> None:
        nonlocal lo, hi
        peaks[e] = measure(e)
        print(f"    edge {e}: {peaks[e] / 2**20:,.1f} MiB", flush=True)
        if peaks[e] <= budget:
            lo = max(lo, e)
        else:
            hi = min(hi, e)

    if seed is not None and seed > smallest:
        measured(seed)
        measured(seed + UNIT if peaks[seed] <= budget else seed - UNIT)
    else:
        measured(smallest)
        if lo:
            measured(2 * smallest)
    while hi - lo > UNIT and (lo or hi > smallest):
        guess = _predicted(peaks, budget) if predictions else None
        if guess is None or not lo and guess < smallest:
            predictions = 0
            floor = lo or smallest - UNIT  # nothing fits yet: bisect down to the smallest edge
            measured(2 * lo if hi == math.inf else max((floor + hi) // 2 // UNIT * UNIT, smallest))
            continue
        predictions -= 1
        edge = min(max(guess, lo + UNIT), hi - UNIT)  # strictly between: not measured yet
        measured(edge)
        neighbour = edge + UNIT if peaks[edge] <= budget else edge - UNIT  # the confirmation
        if lo < neighbour < hi:
            measured(neighbour)
    return {"edge": lo or None, "over": hi, "peaks": peaks}


def _predicted(peaks: dict[int, float], budget: float) -> int | None:
    """The largest edge the line through the two measured points nearest the budget (peak against
    voxels) puts within it."""
    near = sorted(peaks, key=lambda e: abs(peaks[e] - budget))[:2]
    if len(near) < 2:
        return None
    (e1, p1), (e2, p2) = [(e, peaks[e]) for e in near]
    slope = (p2 - p1) / (e2**3 - e1**3)
    if slope <= 0:
        return None
    voxels = e1**3 + (budget - p1) / slope
    return int(max(voxels, 0) ** (1 / 3) + 1e-9) // UNIT * UNIT


# -- main ------------------------------------------------------------------------------------------


def _most_over_ranks(pool, name: str, width: int, checkpointing: bool, timeout: float, edge: int) -> float:
    return max(pool.run(trains_one_step, name, width, checkpointing, edge, timeout=timeout))


def run(args) -> dict:
    from zero.testing.dist import DistPool

    budget = args.budget_mib * 2**20
    variants = [v for v in VARIANTS if v[0] in args.models and not (v[1] and args.no_checkpointing)]
    variants = [v for v in variants if not v[1]] + [v for v in variants if v[1]]
    largest: dict[tuple, dict] = {}
    volume: dict[tuple, list[dict]] = {}
    edge = args.edge
    for parts in args.ranks:
        pool = DistPool(parts, collective_timeout=args.timeout)
        try:
            for name, ck in variants:
                print(f"P={parts} {variant_name(name, ck)}: largest cube at {args.budget_mib:g} MiB", flush=True)
                measure = functools.partial(_most_over_ranks, pool, name, args.width, ck, args.timeout)
                first = largest.get((name, ck, 1), {}).get("edge")  # P = 1's, scaled: near the answer
                seed = int(first * parts ** (1 / 3)) // UNIT * UNIT if first and parts > 1 else None
                found = largest_edge(measure, budget, UNIT * max(parts, 2), seed=seed)
                largest[name, ck, parts] = found
                print(f"  -> {found['edge']} (first over: {found['over']})", flush=True)
            if edge is None:
                first = largest.get((variants[0][0], variants[0][1], 1), {}).get("edge")
                edge = max((first or 0) // UNIT * UNIT, UNIT * max(args.ranks))
            for name, ck in variants:
                print(f"P={parts} {variant_name(name, ck)}: at {edge}^3", flush=True)
                volume[name, ck, parts] = pool.run(at_volume, name, args.width, ck, edge, timeout=args.timeout)
        finally:
            pool.close()
    formula = {(name, ck, parts): halo_formula(name, args.width, ck, edge, parts)
               for name, ck in variants for parts in args.ranks if parts > 1}
    return {"largest": largest, "volume": volume, "formula": formula, "edge": edge, "variants": variants}


def _at_budget(found: dict, budget: float) -> float:
    """Voxels where the line between the largest fitting edge and the first over reaches `budget`."""
    lo, hi, peaks = found.get("edge"), found.get("over"), found.get("peaks", {})
    if not lo or hi not in peaks:
        return math.nan
    return lo**3 + (budget - peaks[lo]) * (hi**3 - lo**3) / (peaks[hi] - peaks[lo])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _kib(n: float) -> str:
    return f"{n / 2**10:,.1f}"


def report(data: dict, args, command: str) -> str:
    largest, volume, formula, edge = data["largest"], data["volume"], data["formula"], data["edge"]
    variants = data["variants"]
    lines = [f"fp32, CPU, one thread per gloo rank; ZeRO stage 3, AdamW, micro-batch 1; width {args.width}; budget "
             f"{args.budget_mib:g} MiB per rank (torch's CPU allocator); `{command}`; method: the docstring of "
             f"benchmarks/bench_spatial.py.", "",
             f"## Largest cube that trains one step at {args.budget_mib:g} MiB per rank", "",
             "| model | P | largest edge | voxels | x P=1 | target >= 0.8 P | met | peak there (MiB, max rank) "
             "| first edge over (MiB) | edges measured | voxels at the budget, interpolated | x P=1 |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, ck in variants:
        base = largest.get((name, ck, 1), {})
        for parts in args.ranks:
            f = largest[name, ck, parts]
            e, over = f["edge"], f["over"]
            ratio = (e / base["edge"]) ** 3 if e and base.get("edge") else math.nan
            between = _at_budget(f, args.budget_mib * 2**20)
            lines.append(
                f"| {variant_name(name, ck)} | {parts} | {e if e else f'< {over}'} | {e**3 if e else 0:,} | "
                f"{ratio:.2f} | {VOXEL_TARGET * parts:.1f} | {_met(ratio >= VOXEL_TARGET * parts)} | "
                f"{_mib(f['peaks'][e]) if e else '-'} | {over} ({_mib(f['peaks'][over])}) | {len(f['peaks'])} | "
                f"{between:,.0f} | {between / _at_budget(base, args.budget_mib * 2**20):.2f} |")
    lines += ["", "Edges come in steps of 8, so a ratio of cubes moves in coarse steps (from 80^3 to 88^3 is 1.33x); "
              "the last columns interpolate the voxels at which the peak reaches the budget between the largest "
              "edge that fits and the first that does not (peak affine in voxels between them)."]
    lines += ["", "Every measured edge (edge: MiB, max over ranks):", ""]
    for name, ck in variants:
        for parts in args.ranks:
            pts = largest[name, ck, parts]["peaks"]
            lines.append(f"- {variant_name(name, ck)}, P={parts}: " +
                         ", ".join(f"{e}: {_mib(pts[e])}" for e in sorted(pts)))
    lines += ["", f"## Activation peak per rank at {edge}^3", "",
              "Forward + loss + backward after a warm-up step (model states excluded; gathered stage-3 parameters "
              "and gradient buckets included), max over ranks.", "",
              "| model | P | activation peak (MiB) | P x peak / peak(P=1) | target <= 1.15 | met |",
              "|---|---:|---:|---:|---:|---|"]
    for name, ck in variants:
        base = max(r["activation_peak"] for r in volume[name, ck, 1]) if (name, ck, 1) in volume else math.nan
        for parts in args.ranks:
            peak = max(r["activation_peak"] for r in volume[name, ck, parts])
            ratio = parts * peak / base
            lines.append(f"| {variant_name(name, ck)} | {parts} | {_mib(peak)} | {ratio:.3f} | {ACT_TARGET} | "
                         f"{_met(ratio <= ACT_TARGET)} |")
    lines += ["", f"## Halo bytes per step at {edge}^3: counted against the formula", "",
              "Counted: engine.comm_report()[\"spatial_halo\"][\"bytes\"], what each rank sent in the step (forward "
              "and backward). Formula: the docstring's, from the layers' input shapes at P = 1 (of it, the part from "
              "3^3 stride-1 convolutions: 2 (P - 1) planes each way per call over the group).", "",
              "| model | P | counted per rank (KiB) | formula per rank (KiB) | counted sum / max | formula sum / max | "
              "of it 3^3 convs (sum) | equal | layer calls |", "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, ck in variants:
        for parts in args.ranks:
            if parts == 1:
                continue
            counted = [r["halo_bytes"] for r in volume[name, ck, parts]]
            f = formula[name, ck, parts]
            lines.append(f"| {variant_name(name, ck)} | {parts} | {', '.join(_kib(c) for c in counted)} | "
                         f"{', '.join(_kib(c) for c in f['per_rank'])} | {_kib(sum(counted))} / {_kib(max(counted))} | "
                         f"{_kib(sum(f['per_rank']))} / {_kib(max(f['per_rank']))} | {_kib(sum(f['conv3']))} | "
                         f"{'yes' if counted == f['per_rank'] else '**no**'} | {f['calls']} |")
    lines += ["", f"## Step time and the halo exchange's share at {edge}^3", "",
              "Step: one unprofiled step (forward, backward, optimizer), rank 0. Shares: of a profiled step, the most "
              "over the ranks, from the profiler's ranges: the halo all-to-alls (zero::spatial_halo), the whole "
              "fetch with its copies (bench::halo_fetch), the plan's all-gathers and the norms' all-reduces "
              "(zero::spatial_sizes + zero::spatial_stats). On gloo ranks sharing a CPU's cores these are the "
              "waits for the slowest rank as much as transfers: indicative only.", "",
              "| model | P | step (s) | profiled step (s) | halo all-to-alls | whole fetch | sizes + stats |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ck in variants:
        for parts in args.ranks:
            rows = volume[name, ck, parts]
            lines.append(f"| {variant_name(name, ck)} | {parts} | {rows[0]['step_s']:.2f} | "
                         f"{rows[0]['profiled_s']:.2f} | {_share(rows, 'halo_s'):.1%} | {_share(rows, 'fetch_s'):.1%} | "
                         f"{_share(rows, 'sizes_s', 'stats_s'):.1%} |")
    return "\n".join(lines) + "\n"


def _share(rows: list[dict], *keys: str) -> float:
    """The most over the ranks of the part of the profiled step the ranges `keys` took."""
    return max(sum(r[k] for k in keys) / r["profiled_s"] for r in rows)


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def plot(data: dict, args, path_name: str) -> None:
    from report import _plt, _save

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    ranks = args.ranks
    span = [1, max(ranks)]
    for i, (name, ck) in enumerate(data["variants"]):
        color = f"C{i}"
        edges = [data["largest"][name, ck, p]["edge"] or 0 for p in ranks]
        voxels = [e**3 for e in edges]
        label = variant_name(name, ck)
        left.plot(ranks, voxels, "o-", color=color, label=label)
        if voxels[0]:
            left.plot(span, [voxels[0] * p for p in span], ":", color=color, alpha=0.5)
            left.plot(span, [VOXEL_TARGET * voxels[0] * p for p in span], "--", color=color, alpha=0.35)
            right.plot(ranks, [v / voxels[0] for v in voxels], "o-", color=color, label=label)
    right.plot(span, span, ":", color="black", label="P (ideal)")
    right.plot(span, [VOXEL_TARGET * p for p in span], "--", color="grey", label="0.8 P (target)")
    left.set(xscale="log", yscale="log", xlabel="spatial ranks P", ylabel="voxels of the largest cube",
             title=f"largest cube at {args.budget_mib:g} MiB per rank (dotted: P x, dashed: 0.8 P x P=1)")
    right.set(xlabel="spatial ranks P", ylabel="voxels(P) / voxels(1)", title="against P = 1")
    for ax in (left, right):
        ax.set_xticks(ranks, [str(p) for p in ranks])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Spatial parallelism, ZeRO-3, fp32 on CPU, width {args.width}")
    fig.tight_layout()
    _save(fig, path_name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="allocator budget per rank (MiB)")
    parser.add_argument("--ranks", default="1,2,4", help="spatial ranks P, comma-separated (must include 1)")
    parser.add_argument("--width", type=int, default=32, help="channels at the top level of both networks")
    parser.add_argument("--models", default="unet3d,monai", help="unet3d, monai or both")
    parser.add_argument("--no-checkpointing", action="store_true", help="only the variants without checkpointing")
    parser.add_argument("--edge", type=int, default=None,
                        help="edge of the common volume (default: the largest P=1 cube of the first model, "
                             "without checkpointing)")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds one measurement may take")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (about a minute): width 8, 48 MiB, P = 1, 2, no checkpointing")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/spatial.{md,png} (spatial_quick.* with --quick)")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_spatial.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.width, args.budget_mib, args.ranks, args.no_checkpointing = 8, 48.0, "1,2", True
    args.ranks = sorted({int(p) for p in args.ranks.split(",")})
    args.models = [m for m in args.models.split(",") if m]
    if args.ranks[0] != 1 or any(m not in NAMES for m in args.models):
        parser.error("--ranks must include 1 (the baseline); --models takes unet3d and/or monai")
    if args.edge is not None and (args.edge % UNIT or args.edge // UNIT < max(args.ranks)):
        parser.error(f"--edge must be a multiple of {UNIT} with edge / {UNIT} >= the largest P")
    data = run(args)
    text = report(data, args, command.strip())
    print(text)
    if args.write:
        from report import _write

        name = "spatial_quick" if args.quick else "spatial"
        plot(data, args, f"{name}.png")
        _write(name, "Spatial parallelism: the largest cube per rank budget, activations, halo bytes", text,
               f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

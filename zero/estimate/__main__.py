"""`python -m zero.estimate`: per-rank memory of every ZeRO stage and offload option.

    python -m zero.estimate --params 7e9 --gpus 8 --nodes 2
    python -m zero.estimate --model path/to/config.json --gpus 8 --dtype bf16
    python -m zero.estimate --params 1.3e9 --gpus 4 --config ds_config.json
    python -m zero.estimate --params 7e9 --gpus 8 --master-dtype bf16 --state-dtype int8
    python -m zero.estimate --params 7e9 --gpus 8 --stage 3 --state-formats
    python -m zero.estimate --params 70e9 --gpus 8 --stage 3 --nvme --config ds_config.json
    python -m zero.estimate --model path/to/config.json --gpus 8 --seq-len 32768 --checkpointing
    python -m zero.estimate --model path/to/config.json --gpus 8 --seq-len 262144 --sequence-parallel 8
    python -m zero.estimate --unet 32 5 --volume 512 512 512 --spatial 4 --gpus 8 --checkpointing
    python -m zero.estimate --unet 32 5 --volume 512 512 512 --spatial 4 --gpus 8 --budget 80GB
    python -m zero.estimate --model-file my_net.py:build --volume 256 256 256 --spatial 2 --gpus 2

The table is in one state format (how the optimizer stores its master weights and Adam's moments):
the config's (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`,
`optimizer.params.state_dtype`; fp32 master and fp32 moments by default), or the one that
--master-dtype and --state-dtype name. --state-formats adds a state-format column and, under each
option, a line for each common format after that one: for bf16 training fp32 master + fp32
moments, bf16 master + bf16 moments, fp32 master + 8-bit moments and bf16 master + 8-bit moments
(fp16/fp32 training: fp32 master with fp32, bf16 or 8-bit moments). See docs/config.md, "State
formats".

--nvme sends the offload options' states to NVMe (ZeRO-Infinity): a disk column gives what each
rank keeps in its swap files, and host memory holds the buffers they are read into instead (sized
by the config's `buffer_count`, `sub_group_size` and `offload_param.max_in_cpu`, DeepSpeed's
defaults otherwise; docs/offload.md#nvme).

With --model and --seq-len the table gets a peak column: the model states plus one forward and
backward's activations at --micro-batch sequences of --seq-len tokens (zero.estimate_activations
traces the HF model's own code on fake tensors: its attention, --checkpointing, and Ulysses
attention over --sequence-parallel ranks, each holding seq_len / that many tokens).

With a 3D model (--unet WIDTH DEPTH: zero.models.UNet3D; or --model-file PATH.py:NAME, a class or
function of no arguments that returns the module) and --volume D H W, the peak column adds one
forward and backward of --micro-batch volumes of --in-channels channels. --spatial P splits each
volume along depth over P ranks (zero.spatial, docs/spatial.md): the trace runs one rank's slab
(the most loaded: a middle rank, the widest slab) and the lines under the table give the slab, the
activations and the halo bytes that rank sends per step (this machine's CPU convolution scratch
is left out: the table is for the GPUs). ZeRO partitions the model states over all --gpus x
--nodes ranks; batch sizes count world / P data-parallel ranks. --budget 80GB (GB = 10**9 bytes,
GiB = 2**30; also MB, MiB, TB, TiB) adds the largest cube edge whose peak per rank (model states
at --stage, stage 3 if not given, and --offload, none if not given, plus the activations) fits,
in steps that keep every level of the model whole and split over the P ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys

from zero.estimate import DTYPES, MASTER_DTYPES, OFFLOADS, STATE_DTYPES, estimate_memory, format_bytes


def _model_from(path: str):
    """A HuggingFace model built from its config on the meta device: parameters counted and units
    planned without allocating them."""
    try:
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as err:
        raise SystemExit(f"--model needs transformers (pip install 'zero[hf]'): {err}") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--model {path}: not a HuggingFace config, model directory or hub name here ({err})") from None
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


def _activations(model, args):
    import torch

    from zero.estimate import estimate_activations

    if args.checkpointing:  # transformers' newer name first
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    return estimate_activations(model, micro_batch_size=args.micro_batch, seq_len=args.seq_len,
                                dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype],
                                sequence_parallel_size=args.sequence_parallel)


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MAX_EDGE = 2**16  # the budget search stops there


def _memory(text: str) -> int:
    """"80GB" (10**9 bytes each), "79GiB" (2**30), "40000MB", ... in bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)\s*", text, re.IGNORECASE)
    if found is None:
        raise ValueError(f"{text!r} is not an amount of memory: give a number and a unit, as in 80GB, 79GiB or 40000MB")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


def _model_file(spec: str, parser: argparse.ArgumentParser):
    """The module that NAME in PATH.py (a class or function of no arguments) builds, on the meta device."""
    import importlib.util
    import pathlib

    import torch
    import torch.nn as nn

    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        parser.error(f"--model-file {spec}: give PATH.py:NAME, NAME a class or function of no arguments that returns "
                     f"the model")
    file = pathlib.Path(path)
    if not file.is_file():
        parser.error(f"--model-file {spec}: there is no file {path}")
    loaded = importlib.util.spec_from_file_location(f"_zero_estimate_{file.stem}", file)
    module = importlib.util.module_from_spec(loaded)
    try:
        loaded.loader.exec_module(module)
        make = getattr(module, name, None)
        if not callable(make):
            parser.error(f"--model-file {spec}: {path} has no class or function {name}")
        with torch.device("meta"):  # shapes only: nothing allocated
            model = make()
    except Exception as err:  # the user's file: whatever it raises is reported, not a traceback of ours
        parser.error(f"--model-file {spec}: {type(err).__name__}: {err}")
    if not isinstance(model, nn.Module):
        parser.error(f"--model-file {spec}: {name}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _volume_model(args, parser: argparse.ArgumentParser):
    """The 3D model (on the meta device) and how many times its deepest level is smaller than the
    volume along each edge (None: to be found by tracing)."""
    import torch

    if args.unet is None:
        model = _model_file(args.model_file, parser)
        if args.checkpointing:
            if not hasattr(model, "checkpointing"):
                parser.error(f"--checkpointing: {type(model).__name__} has no `checkpointing` switch; build it with "
                             f"checkpointing on in {args.model_file}")
            model.checkpointing = True
        return model, None
    from zero.models import UNet3D

    width, depth = args.unet
    if width < 1 or depth < 1:
        parser.error(f"--unet {width} {depth}: WIDTH and DEPTH must be at least 1")
    try:
        with torch.device("meta"):
            model = UNet3D(width, depth, args.in_channels, args.out_channels, checkpointing=args.checkpointing)
    except ValueError as err:  # GroupNorm's 4 groups
        parser.error(f"--unet {width} {depth}: {err}")
    return model, 2 ** (depth - 1)


def _volume_activations(model, args, volume, spatial: int):
    """One forward and backward of --micro-batch volumes, one rank's slab of each when spatial > 1
    (without this machine's CPU kernels' scratch memory: the table is for the GPUs)."""
    import torch

    from zero.estimate import estimate_activations

    model.train()
    x = torch.empty(args.micro_batch, args.in_channels, *volume, device="meta")
    return estimate_activations(model, (x,), dtype=DTYPES[args.dtype], spatial_parallel_size=spatial,
                                kernel_scratch=False)


def _deepest(model, args) -> int:
    """How many times (a power of two) the model's deepest level is shallower than --volume: the
    smallest depth of a module's input or output in one unsplit pass on fake tensors."""
    import torch

    from zero.estimate.spatial import plan_trace

    x = torch.empty(args.micro_batch, args.in_channels, *args.volume, device="meta")
    trace = plan_trace(model, (x,), {}, 1, 2, DTYPES[args.dtype])
    smallest = min(trace.levels, default=args.volume[0])
    return 2 ** int(math.log2(max(1, args.volume[0] // max(smallest, 1))))


def _spatial_config(config, world: int, spatial: int, parser: argparse.ArgumentParser):
    """The config with its batch sizes counting world / spatial data-parallel ranks."""
    if config is None or spatial == 1:
        return config
    from zero.config.loading import _read

    data = dict(_read(config)[0])
    given = data.get("spatial_parallel_size")
    if given not in (None, spatial):
        parser.error(f"--spatial {spatial}: the config's spatial_parallel_size is {given}; give the same number")
    data["spatial_parallel_size"] = spatial
    total, micro = data.get("train_batch_size"), data.get("train_micro_batch_size_per_gpu")
    if "gradient_accumulation_steps" not in data and isinstance(total, int) and isinstance(micro, int) and micro > 0:
        data["gradient_accumulation_steps"] = max(1, total // (micro * (world // spatial)))
    return data


def _shape(sizes) -> str:
    return " x ".join(str(n) for n in sizes)


def _volume_lines(args, act, world: int, spatial: int) -> list[str]:
    """What the trace of a volume (one rank's slab of it) found, under the table."""
    from zero.estimate.spatial import dimension_name

    lines = [f"volume {_shape(args.volume)}: {args.micro_batch} per micro-batch, {args.in_channels} channel(s) in, "
             f"{args.dtype}; {world // spatial} data-parallel rank(s) x {spatial} spatial"]
    if spatial > 1:
        lines.append(f"slab {_shape(act.slab[2:])} of {_shape(args.volume)} per rank ({dimension_name(2)} split over "
                     f"{spatial} ranks; traced: rank {act.spatial_rank}, the most halo)")
    lines.append(f"activations per rank: peak {format_bytes(act.peak)}, {format_bytes(act.saved)} kept for backward")
    if spatial > 1:
        lines.append(f"halo per rank and step: {format_bytes(act.halo_bytes)} sent ({act.halo_bytes:,} B, forward and "
                     f"backward)")
    return lines


def _check_volume(args, step: int, spatial: int, parser: argparse.ArgumentParser) -> None:
    """Refuse a volume the model cannot take, or whose depth at the deepest level is too thin for
    the spatial ranks, naming the sizes."""
    depth, given = args.volume[0], " ".join(map(str, args.volume))
    if args.unet is not None and any(n % step for n in args.volume):
        parser.error(f"--volume {given}: UNet3D of depth {args.unet[1]} halves every edge {args.unet[1] - 1} time(s); "
                     f"give edges that are multiples of {step}")
    if depth // step < spatial:
        parser.error(f"--volume {given}: the depth, {depth} planes, is {depth // step} plane(s) at the model's deepest "
                     f"level ({depth} / {step}), too few to split over {spatial} spatial ranks; give a depth of at "
                     f"least {spatial * step}, or fewer ranks")


def _largest_cube(model, args, budget: int, world: int, spatial: int, step: int, config) -> str:
    """The line naming the largest cube edge (a multiple of `step`) whose peak per rank fits
    --budget. The peak grows about linearly with the voxels: each edge tried is where the line
    through the two largest edges traced so far meets the budget (kept inside the bracket, and
    halving it after three tries), each one traced, until the last edge that fits is found."""
    stage = 3 if args.stage is None else args.stage
    offload = args.offload or "none"
    row = estimate_memory(model, world, stage=stage, offload=offload, dtype=args.dtype, config=config,
                          gpus_per_node=args.gpus, master_dtype=args.master_dtype, state_dtype=args.state_dtype)[0]
    peaks: dict[int, int] = {}

    def peak(k: int) -> int:  # edge k * step
        if k not in peaks:
            act = _volume_activations(model, args, (k * step,) * 3, spatial)
            peaks[k] = dataclasses.replace(row, activations=act.peak).peak_bytes
        return peaks[k]

    where = (f"per rank at {row.label}" + (" (--stage not given: stage 3)" if args.stage is None else "")
             + (f", depth split over {spatial} ranks" if spatial > 1 else ""))
    fits = f"{args.budget} ({format_bytes(budget)})"
    lo, hi, top = spatial, None, _MAX_EDGE // step  # the deepest level's depth, in planes: at least one per rank
    if peak(lo) > budget:
        return (f"largest cube edge that fits {fits} {where}: none; the smallest, {lo * step} (edges in steps of "
                f"{step}), needs {format_bytes(peak(lo))}")
    k, tries = 2 * lo, 0
    while hi is None or hi - lo > 1:
        k = max(lo + 1, min(k, top if hi is None else hi - 1))
        if peak(k) <= budget:
            lo = k
            if lo == top:
                return (f"largest cube edge that fits {fits} {where}: at least {lo * step} (peak "
                        f"{format_bytes(peak(lo))}; the search stops at {_MAX_EDGE})")
        else:
            hi = k
        tries += 1
        a, b = sorted(peaks)[-2:]
        slope = (peaks[b] - peaks[a]) / (b ** 3 - a ** 3)
        k = int(max((budget - peaks[b]) / slope + b ** 3, 1) ** (1 / 3)) if slope > 0 else 2 * lo
        if tries > 3 and hi is not None:
            k = (lo + hi) // 2
    return (f"largest cube edge that fits {fits} {where}: {lo * step} ({_shape([lo * step] * 3)}, peak "
            f"{format_bytes(peak(lo))}); {hi * step} needs {format_bytes(peak(hi))} (edges in steps of {step}, "
            f"{args.micro_batch} volume(s) per micro-batch, {len(peaks)} cubes traced)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.estimate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="trainable parameters (7e9, 1.3e9, ...)")
    what.add_argument("--model", help="a HuggingFace config.json, model directory or hub name (built on the meta device)")
    what.add_argument("--unet", type=int, nargs=2, metavar=("WIDTH", "DEPTH"),
                      help="a 3D U-Net, zero.models.UNet3D(WIDTH, DEPTH) (built on the meta device)")
    what.add_argument("--model-file", metavar="PATH.py:NAME",
                      help="a 3D model: NAME in PATH.py, a class or function of no arguments that returns it")
    parser.add_argument("--gpus", type=int, default=1, help="ranks (GPUs) per node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="training dtype (default bf16)")
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="only this stage")
    parser.add_argument("--offload", choices=OFFLOADS, help="only this offload option")
    parser.add_argument("--config", help="a DeepSpeed-style config for bucket sizes, stage-3 thresholds, gradient "
                        "accumulation, the communication dtype and the state format")
    parser.add_argument("--master-dtype", choices=list(MASTER_DTYPES), default=None,
                        help="master weights in this format (bf16: --dtype bf16 only; default: the config's, "
                        "else fp32)")
    parser.add_argument("--state-dtype", choices=list(STATE_DTYPES), default=None,
                        help="Adam's moments in this format (int8: 8-bit codes; default: the config's, "
                        "else fp32)")
    parser.add_argument("--state-formats", action="store_true",
                        help="also every common state format: one line per format under each option")
    parser.add_argument("--nvme", action="store_true",
                        help="the offload options keep their states on NVMe (a disk column; buffers in host memory)")
    parser.add_argument("--persistent", type=int, default=None, help="with --params: elements stage 3 keeps whole")
    parser.add_argument("--largest-layer", type=int, default=None,
                        help="with --params: elements of the largest layer (sizes stage 3's buffers)")
    parser.add_argument("--seq-len", type=int, help="with --model: tokens per sequence, for the activations")
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="with --seq-len: sequences per micro-batch; with --volume or --budget: volumes")
    parser.add_argument("--checkpointing", action="store_true",
                        help="with --seq-len: gradient checkpointing on; with --unet: UNet3D(checkpointing=True)")
    parser.add_argument("--sequence-parallel", type=int, default=1,
                        help="with --seq-len: Ulysses sequence parallelism over this many ranks")
    parser.add_argument("--volume", type=int, nargs=3, metavar=("D", "H", "W"),
                        help="with --unet or --model-file: one sample's volume, for the activations")
    parser.add_argument("--in-channels", type=int, default=1, help="with a 3D model: channels in (default 1)")
    parser.add_argument("--out-channels", type=int, default=1, help="with --unet: channels out (default 1)")
    parser.add_argument("--spatial", type=int, default=None,
                        help="with --volume or --budget: split each volume along depth over this many ranks "
                        "(zero.spatial); must divide --gpus x --nodes")
    parser.add_argument("--budget", default=None,
                        help="with a 3D model: device memory per rank (80GB, 79GiB, 40000MB): also the largest cube "
                        "edge whose peak fits")
    args = parser.parse_args(argv)
    for name in ("gpus", "nodes", "micro_batch", "in_channels", "out_channels"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    world = args.gpus * args.nodes
    volumetric = args.unet is not None or args.model_file is not None
    if args.seq_len is not None and not args.model:
        parser.error("--seq-len needs --model (the activations are traced from the model's code)")
    if args.sequence_parallel < 1 or world % args.sequence_parallel:
        parser.error(f"--sequence-parallel {args.sequence_parallel} must divide the {world} ranks (--gpus x --nodes)")
    for flag, given in (("--volume", args.volume), ("--budget", args.budget)):
        if given is not None and not volumetric:
            parser.error(f"{flag} needs a 3D model: --unet WIDTH DEPTH or --model-file PATH.py:NAME")
    if args.spatial is not None and args.volume is None and args.budget is None:
        parser.error("--spatial splits a volume: give --volume D H W (or --budget, to search for the largest cube)")
    spatial = 1 if args.spatial is None else args.spatial
    if spatial < 1 or world % spatial:
        parser.error(f"--spatial {spatial} must divide the {world} ranks (--gpus x --nodes): each group of {spatial} "
                     f"ranks shares one volume")
    if spatial > 1 and args.sequence_parallel > 1:
        parser.error("--spatial and --sequence-parallel do not combine (zero's spatial parallelism does not combine "
                     "with sequence parallelism yet)")
    if args.volume is not None and min(args.volume) < 1:
        parser.error(f"--volume {' '.join(map(str, args.volume))}: every edge must be at least 1")
    if args.budget is not None and args.model_file and args.volume is None:
        parser.error("--budget with --model-file needs --volume (one volume the model takes, to find its levels)")
    budget = None
    if args.budget is not None:
        try:
            budget = _memory(args.budget)
        except ValueError as err:
            parser.error(f"--budget {args.budget}: {err}")
    subject = _model_from(args.model) if args.model else args.params
    step = None
    if volumetric:
        subject, step = _volume_model(args, parser)
    config = _spatial_config(args.config, world, spatial, parser)
    try:
        activations, lines = None, []
        if args.seq_len is not None:
            activations = _activations(subject, args)
        if args.volume is not None:
            step = step or _deepest(subject, args)
            _check_volume(args, step, spatial, parser)
            activations = _volume_activations(subject, args, args.volume, spatial)
            lines = _volume_lines(args, activations, world, spatial)
        table = estimate_memory(subject, world, stage=args.stage, offload=args.offload,
                                dtype=args.dtype, config=config, gpus_per_node=args.gpus,
                                persistent_params=args.persistent, largest_layer=args.largest_layer,
                                master_dtype=args.master_dtype, state_dtype=args.state_dtype,
                                state_formats=args.state_formats, activations=activations, nvme=args.nvme)
        if args.budget is not None:
            lines.append(_largest_cube(subject, args, budget, world, spatial, step, config))
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    except RuntimeError as err:  # a volume the model's own code cannot take (sizes that do not meet)
        if not volumetric:
            raise
        parser.error(f"the model does not run on this volume: {err}")
    print(table)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

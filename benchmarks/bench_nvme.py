"""NVMe offload (ZeRO-Infinity's optimizer half): the drive's own speed, the step's I/O against it,
the step against CPU offload, and the largest model that trains under a host-memory cap.

    python benchmarks/bench_nvme.py --dir /local_nvme            # all parts; results/nvme.md
    python benchmarks/bench_nvme.py --dir /local_nvme --part cap  # one part
    python benchmarks/bench_nvme.py --part step --layers 30 --width 2048 --write  # on a GPU: results/nvme_gpu.md

Parts, each in one process on one rank:
- `disk`: the drive's sequential write and read speed, measured by the benchmark itself with zero's
  aio op (O_DIRECT, the `aio` section's block size, queue depth and threads) on a file as large as
  the step's model state: the dd/fio-like pass the step's figures are shares of.
- `step`: one GPT with optimizer offload to the CPU and to NVMe (stage 2, bf16): per-step times,
  the optimizer step's bytes read and written, the time the step waited for reads and writes, the
  I/O throughput the step reached as a share of the drive's, and the share of the I/O hidden behind
  the CPU Adam. Bytes written per step and the drive writes per 1,000 steps.
- `cap`: under a host-memory cap (RLIMIT_DATA, default 1 GiB: every private allocation of the
  process counts, the page cache and the swap files' mappings do not), the deepest GPT of a fixed
  width that trains 3 steps at stage 3, each trial in a fresh process: the optimizer state and the
  parameter shards in host memory (CPU offload), the optimizer state on NVMe, and both on NVMe.
  All three hold at most 4 layers gathered (`stage3_max_live_parameters`, no reuse across forward
  and backward) and step tiles of 1M elements (`sub_group_size`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
AIO = {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 2}


def gpt(layers: int, width: int):
    from zero.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=max(1, width // 64), n_embd=width))


def config(offload: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "aio": AIO,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2, "offload_optimizer": offload}}


def capped_config(width: int, offload: dict, params: dict) -> dict:
    """Stage 3 with a bounded gathered set, for the cap part."""
    layer = 12 * width * width
    return {**config(offload), "zero_optimization": {
        "stage": 3, "offload_optimizer": offload, "offload_param": params, "sub_group_size": 1 << 20,
        "stage3_max_live_parameters": 4 * layer, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": layer}}


def train(layers: int, width: int, offload: dict, steps: int, cfg: dict | None = None) -> dict:
    """Train `steps` steps (with `offload`, or the config `cfg`); per-step seconds and the NVMe
    store's counters."""
    import zero

    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=gpt(layers, width), config={**(cfg or config(offload)),
                                                                   "wall_clock_breakdown": True})
    x = torch.randint(0, 256, (1, 64))
    times, opt = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(engine(x, x))
        mid = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        opt.append(time.perf_counter() - mid)
    store = engine.optimizer.storage.store
    out = {"params": sum(p.numel() for p in engine.module.parameters()), "step_s": times, "opt_s": opt}
    if store.policy.on_disk:
        out.update(step_bytes=store.step_bytes, waits=dict(store.times), io=store.io.stats(), disk=store.size,
                   buffers=sum(b.numel() for b in store.buffers()), cpu_adam=engine.optimizer.host_adam.times["cpu_adam"])
    engine.destroy()
    return out


# -- parts -----------------------------------------------------------------------------------------


def disk_pass(directory: str, nbytes: int) -> dict:
    """Sequential write then read of `nbytes` with the aio op (O_DIRECT), the page cache dropped
    between them where this process may (root), else bypassed by O_DIRECT anyway."""
    from zero.ops.aio import AsyncIO, DataFile, aligned_empty

    io = AsyncIO(AIO["intra_op_parallelism"], AIO["queue_depth"], AIO["block_size"])
    path = os.path.join(directory, f"zero-bench-{os.getpid()}.bin")
    f = DataFile.create(path, nbytes)
    chunk = 64 << 20
    buf = aligned_empty(min(chunk, nbytes)).random_(0, 255)
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, chunk):
            io.write(f, buf[:min(chunk, nbytes - off)], off).wait()
        os.fsync(f.fd)
        write = nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        for off in range(0, nbytes, chunk):
            io.read(f, buf[:min(chunk, nbytes - off)], off).wait()
        read = nbytes / (time.perf_counter() - start)
        # both at once, as the step runs them: read each chunk while the one before is written back
        other = aligned_empty(min(chunk, nbytes))
        start = time.perf_counter()
        pending = None
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            r = io.read(f, buf[:n], off)
            if pending is not None:
                pending.wait()
            pending = io.write(f, other[:n], off)
            r.wait()
        pending.wait()
        os.fsync(f.fd)
        mixed = 2 * nbytes / (time.perf_counter() - start)
        direct = f.fd_direct >= 0
    finally:
        f.close()
        os.unlink(path)
        io.close()
    return {"bytes": nbytes, "write_Bps": write, "read_Bps": read, "mixed_Bps": mixed, "direct": direct}


def step_part(directory: str, layers: int, width: int, steps: int) -> dict:
    cpu = train(layers, width, {"device": "cpu"}, steps)
    nvme = train(layers, width, {"device": "nvme", "nvme_path": directory, "buffer_count": 4}, steps)
    disk = disk_pass(directory, nvme["disk"])
    return {"cpu": cpu, "nvme": nvme, "disk": disk}


def trial(layers: int, width: int, cfg: dict, cap: int) -> bool:
    """Does the GPT train 3 steps in a fresh process whose private memory is capped at `cap`?"""
    code = (f"import sys, resource; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"resource.setrlimit(resource.RLIMIT_DATA, ({cap}, {cap})); import bench_nvme; "
            f"bench_nvme.train({layers}, {width}, None, 3, {cfg!r})")
    # glibc raises its mmap threshold each time a large block is freed (the fp32 model, once
    # initialize has sharded it), after which freed memory stays in the heap, counted by the cap:
    # a fixed threshold returns it, in all three layouts alike
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": "65536"})
    if r.returncode != 0 and not any(s in r.stderr for s in ("MemoryError", "bad_alloc", "memory")):
        print(r.stderr[-2000:], file=sys.stderr)  # not the cap: say why
    return r.returncode == 0


def deepest(width: int, cfg: dict, cap: int, start: int) -> tuple[int, list]:
    """The most layers that train under `cap`: double from `start` until one fails, then bisect."""
    log, good, bad = [], 0, None
    n = start
    while bad is None:
        ok = trial(n, width, cfg, cap)
        log.append((n, ok))
        good, bad = (n, None) if ok else (good, n)
        n *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        ok = trial(mid, width, cfg, cap)
        log.append((mid, ok))
        good, bad = (mid, bad) if ok else (good, mid)
    return good, log


CAP_VARIANTS = {  # name -> (optimizer offload, parameter offload, first depth tried)
    "cpu": ("CPU offload (both in host memory)", lambda d: ({"device": "cpu"}, {"device": "cpu"}), 2),
    "nvme": ("optimizer state on NVMe", lambda d: ({"device": "nvme", "nvme_path": d, "buffer_count": 4},
                                                   {"device": "cpu"}), 8),
    "nvme_params": ("optimizer state and parameters on NVMe",
                    lambda d: ({"device": "nvme", "nvme_path": d, "buffer_count": 4},
                               {"device": "nvme", "nvme_path": d, "buffer_count": 4, "max_in_cpu": 0}), 8),
}


def cap_part(directory: str, width: int, cap: int) -> dict:
    out = {}
    for name, (_, offloads, start) in CAP_VARIANTS.items():
        cfg = capped_config(width, *offloads(directory))
        layers, log = deepest(width, cfg, cap, start)
        params = sum(p.numel() for p in gpt(layers, width).parameters()) if layers else 0
        out[name] = {"layers": layers, "params": params, "trials": log}
        print(f"cap {cap / 2**30:.2f} GiB, {name}: {layers} layers, {params / 1e6:.1f}M parameters ({log})", flush=True)
    return out


# -- report ------------------------------------------------------------------------------------------


def report(step: dict | None, cap: dict | None, args) -> str:
    lines = ["# NVMe offload (benchmarks/bench_nvme.py)", "",
             f"Machine: {os.cpu_count()} CPU cores, the drive under `{args.dir}`, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}. One rank, stage 2, bf16, AdamW; aio {AIO}. "
             + (f"GPU: {torch.cuda.get_device_name()}." if torch.cuda.is_available() else
                "No GPU: the \"device\" is the host, so parameters and gradients share host memory with everything "
                "else."), ""]
    if step is not None:
        c, n, d = step["cpu"], step["nvme"], step["disk"]
        sb = n["step_bytes"]
        steps = len(n["opt_s"]) - 1
        opt_nvme = sum(n["opt_s"][1:]) / steps
        opt_cpu = sum(c["opt_s"][1:]) / steps
        # the drive alone, the same bytes, reads and writes at once as in the step (its mixed pass)
        io_time = (sb["read"] + sb["written"]) / d.get("mixed_Bps", 1 / (1 / d["read_Bps"] + 1 / d["write_Bps"]) * 2)
        waits = (n["waits"]["read_wait"] + n["waits"]["write_wait"]) / len(n["opt_s"])
        lines += ["## The drive and the step", "",
                  f"The drive, by the benchmark's own pass ({d['bytes'] / 2**20:.0f} MiB, "
                  f"{'O_DIRECT' if d['direct'] else 'buffered'}): write {d['write_Bps'] / 1e9:.2f} GB/s, "
                  f"read {d['read_Bps'] / 1e9:.2f} GB/s"
                  + (f", reading and writing at once {d['mixed_Bps'] / 1e9:.2f} GB/s in all (the step's pattern: "
                     f"each chunk read while the one before is written)" if "mixed_Bps" in d else "") + ".", "",
                  f"GPT of {n['params'] / 1e6:.1f}M parameters, {steps} timed steps after one warm-up:", "",
                  "| | CPU offload | NVMe offload |", "|---|---|---|",
                  f"| step (s) | {sum(c['step_s'][1:]) / steps:.2f} | {sum(n['step_s'][1:]) / steps:.2f} |",
                  f"| of which the optimizer step (s) | {opt_cpu:.2f} | {opt_nvme:.2f} |",
                  f"| optimizer state on disk | - | {n['disk'] / 2**20:.0f} MiB |",
                  f"| bytes read / written per step | - | {sb['read'] / 2**20:.0f} / {sb['written'] / 2**20:.0f} MiB |",
                  f"| host buffers (nvme_buffers) | - | {n['buffers'] / 2**20:.0f} MiB |", "",
                  f"- The same bytes through the drive alone take {io_time:.2f} s; the optimizer step took "
                  f"{opt_nvme:.2f} s, so its I/O ran at **{io_time / opt_nvme:.0%} of the drive's speed** (target "
                  f">= 80%; where the CPU Adam is slower than the drive, the step is compute-bound and this share "
                  f"is the Adam's pace, not the I/O's).",
                  f"- Of the {opt_nvme:.2f} s optimizer step, {waits:.2f} s went to waiting for reads and writes and "
                  f"{n['cpu_adam'] / len(n['opt_s']):.2f} s to the CPU Adam: the I/O hides the Adam, not the other way "
                  f"round, because here the drive needs {io_time:.2f} s for the step's bytes and the Adam "
                  f"{n['cpu_adam'] / len(n['opt_s']):.2f} s. Where the Adam is the slower one (more cores per rank "
                  f"than drives), the same pipeline hides the I/O behind it.",
                  f"- NVMe step time / CPU-offload step time: **{sum(n['step_s'][1:]) / sum(c['step_s'][1:]):.2f}x**.",
                  f"- Bytes written per step {sb['written'] / 2**20:.0f} MiB: {sb['written'] * 1000 / 1e12:.3f} TB "
                  f"per 1,000 steps for this rank (a 7B model with fp32 states on 4 ranks of one host: 84 TB).", ""]
    if cap is not None:
        c = cap["cpu"]
        lines += [f"## Largest model under a {args.cap / 2**30:.2f} GiB host-memory cap (RLIMIT_DATA)", "",
                  f"GPT of width {args.width} at stage 3, the deepest that trains 3 steps, each trial a fresh "
                  f"process (see the module's docstring for the settings):", "",
                  "| where the state lives | layers | parameters | / CPU offload | trials (layers, trained) |",
                  "|---|---|---|---|---|"]
        for name, (label, _, _) in CAP_VARIANTS.items():
            v = cap[name]
            lines.append(f"| {label} | {v['layers']} | {v['params'] / 1e6:.1f}M | "
                         f"{v['params'] / max(1, c['params']):.2f}x | {v['trials']} |")
        lines += ["", CAP_NOTE, ""]
    return "\n".join(lines)


CAP_NOTE = (
    "Target: NVMe >= 5x the parameters of CPU offload; **not met on this machine**. Per parameter (bf16), "
    "CPU offload keeps 16 bytes in host memory (the bf16 shard 2, the fp32 master 4, two fp32 moments 8, the "
    "host copy of the gradient 2) plus the gradient where the model computes (2); with both on NVMe, only the "
    "gradient and its host copy stay (2 + 2). On this CPU-only machine the \"device\" is host memory, so the "
    "model's gradients count against the cap too: the ceiling here is (16 + 2) / (2 + 2) = 4.5x before fixed "
    "costs, and the fixed costs lower it further: the interpreter and torch take about 220 MB of the cap "
    "before any model is built, and the I/O buffers about 70 MB (measured in /proc/self/status's VmData, "
    "what RLIMIT_DATA counts). Building the model in fp32 before initialize also takes 4 bytes per "
    "parameter for a moment. On a GPU host the gradients live on the GPU and the host keeps 16 bytes "
    "against 2: 8x before fixed costs, to be measured there.")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the drive to measure (default: a temporary one)")
    parser.add_argument("--part", choices=["all", "step", "cap", "report"], default="all",
                        help="report: write the report again from the saved results")
    parser.add_argument("--layers", type=int, default=24, help="step: GPT depth (24 x 512: 75M parameters, 0.9 GB "
                        "of state, enough tiles that filling and draining the pipeline is a small part)")
    parser.add_argument("--width", type=int, default=512, help="GPT width")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cap", type=float, default=1.0, help="cap: GiB of private host memory")
    parser.add_argument("--write", action="store_true", help="write results/nvme.md")
    args = parser.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="zero-bench-nvme-", dir="/var/tmp")
    args.cap = int(args.cap * 2**30)
    step = step_part(args.dir, args.layers, args.width, args.steps) if args.part in ("all", "step") else None
    cap = cap_part(args.dir, args.width, args.cap) if args.part in ("all", "cap") else None
    if args.write and (RESULTS / f"{_name()}.json").exists():  # one part run: keep the other's results
        previous = json.loads((RESULTS / f"{_name()}.json").read_text())
        step, cap = step or previous.get("step"), cap or previous.get("cap")
    text = report(step, cap, args)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{_name()}.md").write_text(text)
        (RESULTS / f"{_name()}.json").write_text(json.dumps({"step": step, "cap": cap}, indent=1, default=str))


def _name() -> str:
    return "nvme_gpu" if torch.cuda.is_available() else "nvme"  # the GPU plan's PART=nvme (.ci/gpu-check)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()

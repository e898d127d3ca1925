"""What a dead rank costs with periodic checkpoints and auto_resume: the time from the kill to the
first training step after torchrun's restart, and the steps lost, at a save interval of 10.

    python benchmarks/bench_resume.py [--interval 10] [--kills 13,17,19] [--write]

- The job is zero.testing.resume_job (a small GPT, 2 gloo ranks, ZeRO stage 1), launched by
  `torchrun --standalone --nproc_per_node 2 --max-restarts 1` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  (docs/checkpoint.md, "When a rank dies"); rank 1 kills itself (SIGKILL) after step k of the first
  attempt, for each k of --kills.
- Time to train again: from the kill (rank 1's clock) to the end of the first optimizer step after
  the restart (rank 0's clock, the same host): the survivor's failure, torchrun's restart, Python and
  torch start-up, `initialize` with the resume, and one step. Steps lost: k minus the step resumed from.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def one(kill_at: int, interval: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "--max-restarts", "1", "-m", "zero.testing.resume_job", "--dir", f"{tmp}/ck",
                              "--out", f"{tmp}/final.safetensors", "--steps", str(steps), "--interval", str(interval),
                              "--kill-at", str(kill_at)], env=env, capture_output=True, text=True, timeout=600)
        log = run.stdout + run.stderr
        if run.returncode:
            raise RuntimeError(log[-3000:])
    killed = float(re.search(r"killed after step \d+ at ([\d.]+)", log).group(1))
    again = float(re.search(r"first step after the restart at ([\d.]+)", log).group(1))
    resumed = int(re.search(r"attempt 1 starts at step (\d+)", log).group(1))
    return {"kill_at": kill_at, "resumed_at": resumed, "lost": kill_at - resumed, "seconds": again - killed}


def lose_node(kill_at: int, interval: int, steps: int) -> dict:
    import socket
    import time

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        agents = []
        for _ in range(2):
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                 "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "1", "--monitor-interval", "0.5",
                 "-m", "zero.testing.resume_job", "--dir", f"{tmp}/ck", "--out", f"{tmp}/final.safetensors",
                 "--steps", str(steps), "--interval", str(interval), "--elastic", "--kill-node-at", str(kill_at)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            time.sleep(0.5)
        survivor, lost = (a.communicate(timeout=600)[0] for a in agents)
        if agents[0].returncode:
            raise RuntimeError(survivor[-3000:])
    killed = float(re.search(r"node 1 dies after step \d+ at ([\d.]+)", lost).group(1))
    again = float(re.search(r"first step after the restart at ([\d.]+)", survivor).group(1))
    resumed = int(re.search(r"attempt 1 starts at step (\d+)", survivor).group(1))
    return {"kill_at": kill_at, "resumed_at": resumed, "lost": kill_at - resumed, "seconds": again - killed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--kills", default="13,17,19", help="steps after which rank 1 dies")
    parser.add_argument("--node-kills", default="13", help="steps after which node 1 dies (--nnodes 1:2)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/resume.md")
    args = parser.parse_args(argv)
    rows = [one(int(k), args.interval, 3 * args.interval) for k in args.kills.split(",")]
    nodes = [lose_node(int(k), args.interval, 2 * args.interval) for k in args.node_kills.split(",") if k]
    lines = [f"# A dead rank with save_interval {args.interval} (2 gloo ranks, torchrun --max-restarts 1)", "",
             "Written by `python benchmarks/bench_resume.py --write` (see its docstring for the method).", "",
             "| killed after step | resumed from | steps lost | seconds from the kill to training again |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['kill_at']} | {r['resumed_at']} | {r['lost']} | {r['seconds']:.1f} |" for r in rows]
    mean = sum(r["seconds"] for r in rows) / len(rows)
    lines += ["", f"Mean {mean:.1f} s from the kill to the first step after the restart; steps lost are those since "
              f"the last save (at most {args.interval - 1} with save_interval {args.interval}, "
              f"{(args.interval - 1) / 2:.1f} on average for a kill at a random step)."]
    if nodes:
        lines += ["", f"## A lost node: torchrun --nnodes 1:2, 2 agents x 2 gloo ranks, elastic batch 12, "
                  f"save_interval {args.interval}", "",
                  "| node 1 died after step | resumed (2 ranks) from | steps lost | seconds from the death to training "
                  "again |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['kill_at']} | {r['resumed_at']} | {r['lost']} | {r['seconds']:.1f} |" for r in nodes]
        lines += ["", "The survivor's ranks fail at their next collective, its agent restarts them after a "
                  "rendezvous of the smaller world, and they resume with micro-batch 2 x accumulation 3 instead "
                  "of 1 x 3 (the same 12 samples per step)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "resume.md").write_text(text)


if __name__ == "__main__":
    main()

"""A user's first minute: how long the native CPU ops take to build from nothing, how much of that a
killed build keeps, and how soon the demo's first step comes with an empty op cache.

    python benchmarks/bench_build.py [--before DIR] [--write]

- cold: `python -m zero.ops build` with an empty ZERO_CACHE_DIR (every CPU op; the CUDA ops are
  skipped on a CPU-only torch), wall time and each op's own time from its output.
- killed: the same cold build killed (SIGKILL, its whole process group) once half of cpu_adam's C
  files are in the cache, then run again: the second run's time, and how many files it compiled.
- demo: `examples/train_gpt.py --steps 2` on 2 ranks with an empty cache, from launch to the end
  (what `make demo` does first, without its 1000 steps).
- --before DIR: the cold build of another checkout of zero (e.g. a `git worktree` of an older
  commit), run the same way in the same session, for the ratio.

Run it on a quiet machine: the compiler's time is CPU time, so anything else running stretches it.
The target of issue 44 is a cold build <= 60 s on the project's 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _env(cache: str, checkout: Path = ROOT) -> dict:
    return {**os.environ, "ZERO_CACHE_DIR": cache, "PYTHONPATH": str(checkout)}


def cold(checkout: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "zero.ops", "build"], env=_env(cache, checkout), cwd=checkout,
                           capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - t0
        if r.returncode:
            raise RuntimeError(r.stdout + r.stderr)
    ops = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+): built in ([\d.]+) s", r.stdout, re.MULTILINE)}
    if not ops:  # an older checkout does not time each op: take the stderr lines' order only
        ops = {m[1]: float("nan") for m in re.finditer(r"^(\w+): built in", r.stdout, re.MULTILINE)}
    return {"wall": wall, "ops": ops}


def killed() -> dict:
    with tempfile.TemporaryDirectory() as cache:
        p = subprocess.Popen([sys.executable, "-m", "zero.ops", "build", "cpu_adam"], env=_env(cache),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        objects = Path(cache) / "objects"
        while p.poll() is None and len(list(objects.glob("*.o"))) < 3:
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        kept = len(list(objects.glob("*.o")))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "zero.ops", "build", "cpu_adam"], env=_env(cache),
                           capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - t0
        if r.returncode:
            raise RuntimeError(r.stdout + r.stderr)
    compiled = re.search(r": (\d+) of (\d+) C files", r.stderr)
    return {"kept": kept, "compiled": int(compiled[1]), "files": int(compiled[2]), "wall": wall}


def demo() -> float:
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "examples/train_gpt.py", "--steps", "2", "--no-sample"], env=_env(cache), cwd=ROOT,
                           capture_output=True, text=True, timeout=3600)
        if r.returncode:
            raise RuntimeError(r.stdout[-3000:] + r.stderr[-3000:])
        return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout of zero to build cold the same way")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/build.md")
    args = parser.parse_args()
    now = cold()
    print(f"cold build: {now['wall']:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in now['ops'].items())})", flush=True)
    before = cold(args.before) if args.before else None
    if before:
        print(f"cold build of {args.before}: {before['wall']:.1f} s ({before['wall'] / now['wall']:.1f}x)", flush=True)
    k = killed()
    print(f"killed with {k['kept']} of {k['files']} cpu_adam files built: the next build compiled {k['compiled']} "
          f"in {k['wall']:.1f} s", flush=True)
    first = demo()
    print(f"demo, 2 steps on 2 ranks, empty cache: {first:.1f} s", flush=True)
    if not args.write:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# Building the native CPU ops from nothing",
        "",
        f"`python benchmarks/bench_build.py{' --before ' + str(args.before) if args.before else ''} --write`, "
        f"commit {commit}, {date.today()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}. Every time is wall-clock with an empty `ZERO_CACHE_DIR`.",
        "",
        "| what | seconds |",
        "| --- | ---: |",
        f"| cold `python -m zero.ops build` (every CPU op) | {now['wall']:.1f} |",
        *(f"| - {op} | {t:.1f} |" for op, t in now["ops"].items()),
    ]
    if before:
        then = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.before, capture_output=True,
                              text=True).stdout.strip() or args.before.name
        lines.append(f"| the same at commit {then} (before: C++ torch bindings, one Adam unit) | "
                     f"{before['wall']:.1f} ({before['wall'] / now['wall']:.1f}x) |")
    lines += [
        f"| cpu_adam killed with {k['kept']} of {k['files']} files built, then built again | {k['wall']:.1f} "
        f"({k['compiled']} of them compiled) |",
        f"| `examples/train_gpt.py --steps 2` on 2 ranks, launch to exit | {first:.1f} |",
        "",
    ]
    (RESULTS / "build.md").write_text("\n".join(lines))
    print(f"wrote {RESULTS / 'build.md'}")


if __name__ == "__main__":
    main()

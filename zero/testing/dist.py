"""A pool of gloo ranks for tests: start N processes once, run many test functions on them.

Starting a process and importing torch costs seconds on a small machine, far more than most
distributed tests, so a `DistPool` keeps its ranks alive and reuses them. Each rank joins one
gloo group through a file rendezvous, uses one thread, and runs whatever function it is sent.

A failure on any rank is raised in the caller with that rank's traceback. A rank that does not
answer in time (a hang in a mismatched collective, say) makes the pool kill all its ranks and
raise TimeoutError; the next `run` starts fresh ones.
"""
from __future__ import annotations

import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A function raised on one or more ranks; the message holds their tracebacks."""


def _worker(rank: int, world_size: int, init_file: str, sys_path: list[str], tasks, results, timeout_s: float) -> None:
    sys.path[:] = sys_path
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    # The pool is CPU ranks over gloo, also on a machine with GPUs: hide them before torch loads,
    # so every rank computes on the CPU like the reference it is compared with.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the caller
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """N gloo ranks in child processes.

    Args:
        world_size: number of ranks.
        collective_timeout: seconds a collective may wait before gloo gives up.
    """

    def __init__(self, world_size: int, collective_timeout: float = 60.0):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="zero_pool_")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, os.path.join(self._dir, "rendezvous"), list(sys.path), self._tasks[r], self._results,
                      collective_timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        `fn` must be importable by name (a module-level function). Raises RankFailed if any rank
        raised, TimeoutError if some rank did not answer within `timeout` seconds.
        """
        if self.broken:
            raise RuntimeError("this DistPool was killed after a failure; make a new one")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
                (results if ok else failures)[rank] = value
                if failures:  # the others may wait forever in a collective the failed rank left
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            except queue.Empty:
                pass
            missing = sorted(set(range(self.world_size)) - results.keys() - failures.keys())
            dead = [r for r in missing if not self._procs[r].is_alive()]
            if dead or time.monotonic() > deadline:
                self.close(kill=True)
                if failures:
                    break
                if dead:
                    raise RankFailed(f"rank(s) {dead} died while running {fn.__name__}")
                raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} within {timeout:.0f} s")
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RankFailed(f"{fn.__name__} failed on rank(s) {sorted(failures)}:\n{text}")
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill and not self.broken:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.broken = True
        shutil.rmtree(self._dir, ignore_errors=True)


def _once(rank: int, world_size: int, init_file: str, sys_path: list[str], fn, args, results, env: dict) -> None:
    sys.path[:] = sys_path
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      CUDA_VISIBLE_DEVICES="", **env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=1800))  # the bound must come from zero, not from here
    try:
        results.put((rank, True, fn(*args), time.monotonic()))
    except BaseException:  # noqa: BLE001 - report everything to the caller
        results.put((rank, False, traceback.format_exc(), time.monotonic()))
    # then exit as a training script would: whatever gloo still waits for decides how long that takes


def run_once(world_size: int, fn: Callable[..., Any], *args: Any, env: dict | None = None,
             timeout: float = 120.0) -> tuple[list[Any], list[float]]:
    """Run `fn(*args)` once on `world_size` fresh gloo ranks (process group timeout 1800 s), let
    each process exit on its own, and measure how long each took to exit after returning.

    Returns:
        (each rank's result, or its traceback if it raised; seconds from each rank's return to
        its process's exit, inf for a process that had to be killed)
    """
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="zero_once_")
    results = ctx.Queue()
    procs = [ctx.Process(target=_once, args=(r, world_size, os.path.join(tmp, "rendezvous"), list(sys.path), fn, args,
                                             results, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    returned: dict[int, float] = {}
    exited: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(exited) < world_size:
            try:
                rank, ok, value, when = results.get(timeout=0.05)
                out[rank] = value if ok else f"raised: {value}"
                returned[rank] = when
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in exited and not p.is_alive():
                    exited[r] = time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
    exit_s = [exited[r] - returned[r] if r in exited and r in returned else float("inf") for r in range(world_size)]
    return [out.get(r, "no result (killed)") for r in range(world_size)], exit_s

"""Shared fixtures: a reusable pool of gloo ranks per world size (see zero/testing/dist.py)."""

import os

import pytest

from zero.testing.dist import DistPool

_pools: dict[int, DistPool] = {}


def run_on_ranks(world_size: int, fn, *args, timeout: float = 300.0, **kwargs):
    """Run `fn` on `world_size` gloo ranks, reusing live ranks across tests."""
    pool = _pools.get(world_size)
    if pool is None or pool.broken:
        pool = _pools[world_size] = DistPool(world_size)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def dist_run():
    yield run_on_ranks
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def pytest_collection_modifyitems(config, items):
    """ZERO_GPU_ONLY=1 (make gpu-check PART=tests): only the tests that skip without a CUDA GPU."""
    if not os.environ.get("ZERO_GPU_ONLY"):
        return
    gpu = [i for i in items if any("needs a CUDA GPU" in str(m.kwargs.get("reason", "")) for m in i.iter_markers("skipif"))]
    config.hook.pytest_deselected(items=[i for i in items if i not in gpu])
    items[:] = gpu

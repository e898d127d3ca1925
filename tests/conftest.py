"""Shared fixtures: a reusable pool of gloo ranks per world size (see zero/testing/dist.py)."""

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

"""The collectives zero relies on give the right numbers on the installed torch and backend.

See [Note: reduce with SUM] in zero/parallel/comm.py: we only use SUM (and MAX for flags), so those are
what is checked, for every dtype a bucket can have, and in place where zero uses them in place.
"""
import pytest
import torch
import torch.distributed as dist

from zero.parallel.comm import Comm
from zero.testing.dist import RankFailed


def collectives_on_this_rank():
    comm = Comm()
    r, n = comm.rank, comm.world_size
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.arange(n * 5, dtype=torch.float32) + 10 * r).to(dtype)
        got = torch.empty(5, dtype=dtype)
        comm.reduce_scatter(got, x)
        want = sum(torch.arange(n * 5, dtype=torch.float32) + 10 * k for k in range(n))[r * 5 : (r + 1) * 5]
        out[f"reduce_scatter_{dtype}"] = torch.equal(got.float(), want)

        buf = torch.zeros(n * 3, dtype=dtype)
        buf[r * 3 : (r + 1) * 3] = r + 1
        comm.all_gather(buf, buf[r * 3 : (r + 1) * 3])  # in place, as the engine does
        out[f"all_gather_inplace_{dtype}"] = torch.equal(buf.float(), torch.arange(1, n + 1).float().repeat_interleave(3))

    flag = torch.tensor([float(r == n - 1)])
    comm.all_reduce(flag, "max")
    out["all_reduce_max"] = flag.item() == 1.0
    s = torch.tensor([float(r)])
    comm.all_reduce(s, "sum", async_op=True).wait()
    out["all_reduce_sum_async"] = s.item() == n * (n - 1) / 2
    b = torch.full((4,), float(r))
    comm.broadcast(b, src=0)
    out["broadcast"] = torch.equal(b, torch.zeros(4))
    out["counts"] = comm.report()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gloo_collectives_give_the_right_numbers(dist_run, world_size):
    for result in dist_run(world_size, collectives_on_this_rank):
        counts = result.pop("counts")
        assert all(result.values()), result
        assert counts["reduce_scatter"]["elements"] == 3 * 5 * world_size  # logical: the whole input
        assert counts["all_gather"]["elements"] == 3 * 3 * world_size


def test_a_world_of_one_needs_no_process_group():
    assert not dist.is_initialized()
    comm = Comm()
    assert (comm.rank, comm.world_size) == (0, 1)
    out = torch.empty(3)
    comm.reduce_scatter(out, torch.ones(3))
    assert torch.equal(out, torch.ones(3))


def raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    dist.barrier()  # rank 0 waits for a rank that never comes


def test_pool_reports_the_failing_rank_with_its_traceback_and_recovers(dist_run):
    with pytest.raises(RankFailed, match=r"(?s)rank\(s\) \[1\].*boom on one"):
        dist_run(2, raise_on_rank_one)
    assert dist_run(2, dist.get_rank) == [0, 1]  # a fresh pool replaced the stuck one

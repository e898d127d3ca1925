"""Rank-divergent control flow under stage 3 ends in a clear error naming the unit and the step,
within a bounded time, never in a hang or in silently mixed-up parameters."""
import os
import time

import torch
import torch.distributed as dist

import zero
from zero.testing.dist import DistPool
from zero.testing.training import STAGE3, build_model, make_batch

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
          "zero_optimization": {"stage": 3, **STAGE3["gpt"]}}


def run_diverging(stop_early: bool, timeout_s: str):
    os.environ["ZERO_COLLECTIVE_TIMEOUT"] = timeout_s
    torch.manual_seed(0)
    net = build_model("gpt")
    engine, *_ = zero.initialize(model=net, config=CONFIG)
    if dist.get_rank() == 1:
        if stop_early:
            return "stopped"  # this rank issues no further collectives
        net.blocks = torch.nn.ModuleList([net.blocks[1]])  # this rank skips block 0
    start = time.monotonic()
    try:
        engine.backward(engine(*make_batch("gpt", 2, torch.Generator().manual_seed(0))))
        engine.step()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__} after {time.monotonic() - start:.0f}s: {exc}"


def test_a_rank_that_skips_a_unit_makes_every_rank_raise_naming_the_units():
    pool = DistPool(2)
    try:
        results = pool.run(run_diverging, False, "60", timeout=120)
    finally:
        pool.close(kill=True)  # the group saw mismatched collectives: do not reuse it
    for message in results:
        assert message.startswith("RankDivergenceError"), message
        assert "step 1" in message and "'blocks.0'" in message and "'blocks.1'" in message
        assert "rank 0: forward of unit 'blocks.0'" in message and "rank 1: forward of unit 'blocks.1'" in message


def test_a_rank_that_stops_makes_the_others_time_out_naming_the_unit():
    pool = DistPool(2)
    try:
        results = pool.run(run_diverging, True, "5", timeout=120)
    finally:
        pool.close(kill=True)
    assert results[1] == "stopped"
    assert results[0].startswith("CollectiveTimeout"), results[0]
    assert "step 1" in results[0] and "unit '<root>'" in results[0] and "within 5 s" in results[0]

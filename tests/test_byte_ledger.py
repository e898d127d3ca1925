"""The byte ledger (see [Note: the byte ledger] in zero/parallel/comm.py): on 4 ranks as 2 nodes of 2
(GROUP_RANK, as two torchrun agents set it), every collective's bytes split into those that cross a
node boundary and those that stay inside one, by the group's ranks."""
import os

import pytest
import torch
import torch.distributed as dist


def _ledger(stage: int, hybrid: bool, accumulation: int = 1) -> dict:
    import zero
    from zero.config import load_config
    from zero.engine import Engine
    from zero.parallel.dims import ParallelDims
    from zero.parallel.groups import ParallelGroups
    from zero.testing.training import STAGE3, build_model, make_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)  # ranks 0-1 on node 0, 2-3 on node 1
    try:
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                  "gradient_accumulation_steps": accumulation,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                        **({**STAGE3["mlp"], "stage3_max_reuse_distance": 0} if stage == 3 else {})}}
        torch.manual_seed(0)
        if hybrid:  # shard inside a node, replicate across nodes
            engine = Engine(build_model("mlp"), load_config(config, world_size=world),
                            parallel=ParallelGroups(ParallelDims(world, dp_replicate=2, dp_shard=2)))
        else:
            engine, *_ = zero.initialize(model=build_model("mlp"), config=config)
        monitor = zero.TrainingMonitor(engine, steps=2)
        for step in range(2 * accumulation):
            engine.backward(engine(*make_batch("mlp", 2, torch.Generator().manual_seed(10 * step + rank))))
            engine.step()
            monitor.step()
        table = monitor.report()
        return {"comm": engine.comm_report(), "nodes": engine.comm.node_of, "table": table,
                "world": (engine.world_size, engine.global_rank),
                "summary": {k: monitor.summary.get(k) for k in ("cross_node_bytes", "cross_node_formula")}}
    finally:
        os.environ.pop("GROUP_RANK")


@pytest.mark.parametrize("stage, hybrid", [(3, False), (2, False), (2, True)])
def test_the_bytes_that_cross_nodes_follow_the_groups_ranks(dist_run, stage, hybrid):
    for rank, r in enumerate(dist_run(4, _ledger, stage, hybrid)):
        comm = r["comm"]
        assert r["nodes"] == ([rank // 2] * 2 if hybrid else [0, 0, 1, 1]), r["nodes"]  # the zero group's nodes
        assert comm and all(c["cross_node_bytes"] <= 2 * c["bytes"] for c in comm.values())
        for label, c in comm.items():
            if hybrid and "replicas" not in label:  # the shard group is inside the node: nothing crosses
                assert c["cross_node_bytes"] == 0, (label, c)
            elif label.startswith("all_reduce"):  # 2 B (N - L) / N with N = 2 or 4, L = N / 2 (or 1 of 2)
                assert c["cross_node_bytes"] == c["bytes"], (label, c)
            else:  # all-gathers and reduce-scatters over 4 ranks, 2 of them on this node: half
                assert abs(c["cross_node_bytes"] - c["bytes"] / 2) <= c["calls"], (label, c)
        crossing = sum(c["cross_node_bytes"] for c in comm.values())
        assert crossing > 0
        assert r["world"] == (4, rank)  # every data-parallel rank, replicas too (DeepSpeed's meaning)
        assert bool(r["table"]) == (rank == 0), rank  # one end table, not one per replica
        if hybrid:  # once per step, the replicas' all-reduce of this rank's half of the gradients
            assert set(k for k, c in comm.items() if c["cross_node_bytes"]) == {"all_reduce (replicas)"}
        if rank == 0:  # the end table: the ledger's total beside the formula's (which leaves out the
            # padding of buckets and units, 8% of this 500-element model; 0.1% of bench_multinode's)
            assert "of which across nodes" in r["table"] and "zero.estimate.comm" in r["table"], r["table"]
            summary = r["summary"]
            assert len(summary["cross_node_bytes"]) == 4  # every rank's column, replicas too
            assert summary["cross_node_formula"] == pytest.approx(max(summary["cross_node_bytes"]), rel=0.1)


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_crosses_nodes_once_per_step_whatever_the_accumulation(dist_run, stage):
    """Shards inside a node, replicas across nodes: the replicas sum their gradient shards at the
    optimizer step, so the bytes between nodes are the same at accumulation 1 and 4 (HSDP's point),
    while the reduce-scatters inside the node grow with it."""
    for one, four in zip(dist_run(4, _ledger, stage, True, 1), dist_run(4, _ledger, stage, True, 4)):
        a, b = one["comm"], four["comm"]
        assert a["all_reduce (replicas)"] == b["all_reduce (replicas)"], (a, b)
        assert b["reduce_scatter"]["calls"] == 4 * a["reduce_scatter"]["calls"]
        assert sum(c["cross_node_bytes"] for c in b.values()) == sum(c["cross_node_bytes"] for c in a.values()) > 0


def _hpz(precision: str, offload: bool, nvme: str | None = None) -> dict:
    """Flat ZeRO-3 and ZeRO-3 with hpZ (zero_hpz_partition_size 2 = a node) on the same data: the same
    parameters bit for bit, and what each sends across nodes."""
    import copy

    import zero
    from zero.testing.training import STAGE3, build_model, make_batch

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        torch.manual_seed(0)
        base = build_model("gpt")
        engines = []
        for hpz in (1, 2):
            zc = {"stage": 3, **STAGE3["gpt"], "stage3_max_reuse_distance": 0, "zero_hpz_partition_size": hpz,
                  **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
                  **({"offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}} if nvme and hpz > 1
                     else {})}
            config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": zc,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **({precision: {"enabled": True}}
                                                                                  if precision != "fp32" else {})}
            engines.append(zero.initialize(model=copy.deepcopy(base), config=config)[0])
        g = torch.Generator().manual_seed(rank)
        for _ in range(3 * 2):
            batch = make_batch("gpt", 2, g)
            for engine in engines:
                engine.backward(engine(*batch))
                engine.step()
        with zero.GatheredParameters(list(engines[0].module.parameters())), \
                zero.GatheredParameters(list(engines[1].module.parameters())):
            same = all(torch.equal(p, q) for p, q in zip(engines[0].module.parameters(), engines[1].module.parameters()))
        reports = [e.comm_report() for e in engines]
        peak = engines[1].optimizer.gauges.secondary.peak
        left = engines[1].optimizer.gauges.secondary.now
        return {"same": same, "flat": reports[0], "hpz": reports[1], "secondary_peak": peak, "secondary_now": left,
                "psi_units": sum(u.full_numel for u in engines[1].optimizer.storage.units if not u.persistent),
                "itemsize": engines[1].optimizer.precision.param.itemsize}
    finally:
        os.environ.pop("GROUP_RANK")


@pytest.mark.parametrize("precision, offload, nvme", [("fp32", False, False), ("bf16", True, False),
                                                     ("fp32", True, True)])
def test_hpz_gathers_backward_inside_the_node_and_changes_no_number(dist_run, tmp_path, precision, offload, nvme):
    """fp32; bf16 with optimizer offload; and with the parameter shards on NVMe (forward reads them
    from disk, backward gathers the node's secondary shards)."""
    for r in dist_run(4, _hpz, precision, offload, str(tmp_path) if nvme else None):
        assert r["same"]  # gathers are copies: the same parameters as flat ZeRO-3, bit for bit
        flat, hpz = r["flat"], r["hpz"]
        # backward's all-gathers come from the node's secondary shards: none of their bytes cross
        assert hpz["all_gather (hpZ)"]["cross_node_bytes"] == 0 < hpz["all_gather (hpZ)"]["bytes"]
        assert hpz["all_gather"]["bytes"] + hpz["all_gather (hpZ)"]["bytes"] == flat["all_gather"]["bytes"]
        crossing = [sum(c["cross_node_bytes"] for c in rep.values()) for rep in (flat, hpz)]
        moved = hpz["all_gather (hpZ)"]["bytes"]  # backward's gathers, which cross half their bytes when flat
        assert crossing[1] == pytest.approx(crossing[0] - moved / 2, abs=16)
        # a node's share of every unit while forward's secondary shards live, none after the step
        assert r["secondary_peak"] == pytest.approx(r["psi_units"] * r["itemsize"] / 2, rel=0.01)
        assert r["secondary_now"] == 0


def test_the_estimator_counts_hpz_secondary_shards():
    """zero_hpz_partition_size L adds the parameters' bytes / L to stage 3's buffers (what
    memory_report()'s hpz_secondary_peak measures in the test above: p Psi_units / L)."""
    from zero.estimate import estimate_memory

    flat = estimate_memory(7e9, 16, stage=3, offload="none")[0]
    hpz = estimate_memory(7e9, 16, stage=3, offload="none", config={"zero_optimization": {"zero_hpz_partition_size": 8}})
    assert hpz[0].buffers - flat.buffers == pytest.approx(2 * 7e9 / 8, rel=1e-6)
    assert hpz[0].buffers_in_backward - flat.buffers_in_backward == pytest.approx(2 * 7e9 / 8, rel=1e-6)


def _side_groups() -> dict:
    from zero.parallel.dims import ParallelDims
    from zero.parallel.groups import ParallelGroups, group_of, shared_comm

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank % 2)  # even ranks on node 0, odd on node 1
    try:
        ParallelGroups(ParallelDims(4)).comm("zero")  # an engine's first group: the ranks learn their nodes
        pair = shared_comm(group_of([rank - rank % 2, rank - rank % 2 + 1]), "sequence")  # spans both nodes
        x = torch.zeros(2, 3)
        pair.all_to_all(torch.empty_like(x), x, label="all_to_all (sequence)")
        world = shared_comm(group_of([0, 1, 2, 3]), "uneven")
        splits = [[1, 2, 3, 4], [0, 1, 0, 1], [2, 2, 2, 2], [4, 0, 0, 0]][rank]  # rows to ranks 0-3
        received = [[1, 0, 2, 4], [2, 1, 2, 0], [3, 0, 2, 0], [4, 1, 2, 0]][rank]
        rows = torch.zeros(sum(splits), 5)
        world.all_to_all(torch.empty(sum(received), 5), rows, label="all_to_all (uneven)", input_splits=splits,
                         output_splits=received)
        return {"pair": pair.report()["all_to_all (sequence)"], "uneven": world.report()["all_to_all (uneven)"],
                "splits": splits}
    finally:
        os.environ.pop("GROUP_RANK")


def test_side_groups_and_uneven_all_to_alls_join_the_ledger(dist_run):
    """The sequence group's exchange (a shared Comm, not an engine's) is placed on nodes once an
    engine learnt them, and an all-to-all of uneven blocks counts the bytes of the blocks that go
    to other nodes, not an even share."""
    for rank, r in enumerate(dist_run(4, _side_groups)):
        assert r["pair"]["cross_node_bytes"] == r["pair"]["bytes"] // 2  # half the blocks go to the other node
        other = [i for i in range(4) if i % 2 != rank % 2]
        assert r["uneven"]["cross_node_bytes"] == sum(r["splits"][i] for i in other) * 5 * 4, (rank, r)

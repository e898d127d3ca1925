"""The placement seam's first user: hybrid sharding, expressed with the new types (ParallelDims with
dp_replicate = 2 and dp_shard = 2, the groups ParallelGroups hands out, the Sharded placement with
a replicate group), reduces correctly on 4 ranks: the optimizer state is partitioned within each
shard group of 2 and replicated across the 2 groups, gradients are reduce-scattered inside a shard
group and then all-reduced across the replicas, and training equals one process on the whole
batch, at stages 1, 2 and 3. (The config keys and the rest of the feature are their own issue.)"""
import copy

import pytest
import torch
import torch.distributed as dist

GLOBAL_BATCH = 16


def _hybrid(stage: int, accumulation: int = 1, offload: bool = False, steps: int = 4) -> dict:
    from zero.config import load_config
    from zero.engine import Engine
    from zero.parallel.dims import ParallelDims
    from zero.parallel.groups import ParallelGroups
    from zero.stages.placement import Sharded
    from zero.testing.training import STAGE3, build_model, make_batch, relative_error

    world = dist.get_world_size()
    dims = ParallelDims(world, dp_replicate=2, dp_shard=2)
    parallel = ParallelGroups(dims)
    config = load_config({"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_clipping": 0.5,
                          "gradient_accumulation_steps": accumulation,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                          "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                                **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
                                                **(STAGE3["mlp"] if stage == 3 else {})}}, world_size=world)
    torch.manual_seed(0)
    model = build_model("mlp")
    reference = copy.deepcopy(model)
    engine = Engine(model, config, parallel=parallel)
    storage = engine.optimizer.storage
    placement = storage.placements[0] if hasattr(storage, "placements") else storage.placement
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    per, at = GLOBAL_BATCH // world, parallel.index("batch")  # each data rank its own samples
    from zero.accessors import safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_grad, safe_set_full_grad, safe_set_local_grad

    grad_error = 0.0
    for step in range(steps):
        ref_opt.zero_grad()
        for micro in range(accumulation):  # the reference: the mean over every micro-batch of every rank
            x, y = make_batch("mlp", GLOBAL_BATCH, torch.Generator().manual_seed(step * accumulation + micro))
            (reference(x, y) / accumulation).backward()
        for micro in range(accumulation):
            x, y = make_batch("mlp", GLOBAL_BATCH, torch.Generator().manual_seed(step * accumulation + micro))
            engine.backward(engine(x[at * per : (at + 1) * per], y[at * per : (at + 1) * per]))
            if micro == accumulation - 1:  # the gradient accessors before the step: the final mean on every
                for p, r in zip(model.parameters(), reference.parameters()):  # replica, and writing it back
                    full = safe_get_full_grad(p)  # (locally too) must not make the step sum it again
                    grad_error = max(grad_error, ((full - r.grad).abs().max() / r.grad.abs().max()).item())
                    safe_set_full_grad(p, full)
                    if stage >= 2:
                        safe_set_local_grad(p, safe_get_local_grad(p))
            engine.step()
            if micro == accumulation - 1:  # after the step (a logging callback): nothing is owed, the next
                safe_get_full_grad(next(model.parameters()))  # backward goes on
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()

    # every replica reads the whole master, not only the first one (which writes checkpoints)
    got = [safe_get_full_fp32_param(p) for p in model.parameters()]
    accessor_error = max(((a - b.detach()).abs().max() / b.detach().abs().max()).item()
                         for a, b in zip(got, reference.parameters()))
    masters = torch.cat([s.master.reshape(-1) for s in engine.optimizer.slots()])
    theirs = torch.empty(2 * masters.numel())
    dist.all_gather_into_tensor(theirs, masters, group=parallel.group("replicate"))
    return {"error": relative_error(model, reference), "sharded": isinstance(placement, Sharded),
            "shard": parallel.ranks("zero"), "replicate": parallel.ranks("replicate"),
            "replicas_equal": torch.equal(theirs[: masters.numel()], theirs[masters.numel():]),
            "master_numel": masters.numel(), "psi": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
            "divisor": engine.optimizer.grad_divisor(reduced=True), "comm": engine.comm_report(),
            "norm": engine.get_global_grad_norm(), "accessor_error": accessor_error,
            "grad_error": grad_error}


@pytest.mark.parametrize("stage, accumulation, offload", [(1, 1, False), (2, 1, False), (3, 1, False),
                                                         (2, 2, True), (3, 2, True)])
def test_a_hybrid_placement_shards_in_pairs_replicates_across_them_and_trains_as_one_process(dist_run, stage,
                                                                                           accumulation, offload):
    results = dist_run(4, _hybrid, stage, accumulation, offload)
    for rank, r in enumerate(results):
        assert r["sharded"]
        assert r["shard"] == [rank - rank % 2, rank - rank % 2 + 1]  # shard within consecutive pairs
        assert r["replicate"] == [rank % 2, rank % 2 + 2]  # replicate across them
        assert r["error"] < 1e-6, (rank, r["error"])  # fp32 round-off of the summation order
        assert r["replicas_equal"]  # the two holders of a partition keep the same master bits
        assert r["accessor_error"] < 1e-5, r["accessor_error"]  # safe_get_full_fp32_param on every replica
        assert r["grad_error"] < 1e-5, r["grad_error"]  # safe_get_full_grad: the mean over every replica
        # each rank keeps half of the model's optimizer state (its shard group has 2 ranks, not 4)
        assert r["psi"] / 2 <= r["master_numel"] <= r["psi"] / 2 + 6 * 16, r["master_numel"]
        assert r["divisor"] == 4.0 * accumulation  # the mean over all 4 data ranks' micro-batches
        comm = r["comm"]
        # a reduce-scatter per bucket inside the pair, then each half all-reduced across the replicas
        assert comm["all_reduce (replicas)"]["elements"] * 2 * accumulation == comm["reduce_scatter"]["elements"], comm
        if stage < 3:  # a gather per step inside the pair (stage 3 gathers for forward and backward), a
            # reduce-scatter per micro-step at stage 2
            assert comm["all_gather"]["elements"] * (accumulation if stage == 2 else 1) == \
                comm["reduce_scatter"]["elements"], comm
    assert len({r["norm"] for r in results}) == 1  # every rank clips with the same norm


def _backward_after_accessor(stage: int) -> str:
    from zero.accessors import safe_get_full_grad
    from zero.config import load_config
    from zero.engine import Engine
    from zero.parallel.dims import ParallelDims
    from zero.parallel.groups import ParallelGroups
    from zero.stages.placement import ReplicasSummedError
    from zero.testing.training import STAGE3, build_model, make_batch

    world = dist.get_world_size()
    config = load_config({"train_micro_batch_size_per_gpu": 2,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                          "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                                **(STAGE3["mlp"] if stage == 3 else {})}}, world_size=world)
    torch.manual_seed(0)
    model = build_model("mlp")
    engine = Engine(model, config, parallel=ParallelGroups(ParallelDims(world, dp_replicate=2, dp_shard=2)))
    x, y = make_batch("mlp", 2, torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x, y))
    before = safe_get_full_grad(next(model.parameters()))
    try:
        engine.backward(engine(x, y))  # adds to gradients the replicas already summed
    except ReplicasSummedError as exc:
        after = safe_get_full_grad(next(model.parameters()))
        return str(exc) if torch.equal(before, after) else "the gradients changed"
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_backward_after_a_gradient_accessor_summed_the_replicas_is_refused_before_any_gradient_changes(dist_run,
                                                                                                       stage):
    for message in dist_run(4, _backward_after_accessor, stage):
        assert "summed this step's gradients over the replicas" in message, message
        assert "mics_shard_size" in message


def _init_then_hybrid() -> dict:
    import zero
    from zero.testing.training import STAGE3, build_model, make_batch

    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "mics_shard_size": 2, **STAGE3["mlp"]}}
    torch.manual_seed(0)
    reference = build_model("mlp")
    torch.manual_seed(0)
    with zero.Init(config=config):  # sharded over the 4 ranks of the world as it is built
        model = build_model("mlp")
    engine, *_ = zero.initialize(model=model, config=config)  # shards over pairs of ranks
    x, y = make_batch("mlp", 2 * world, torch.Generator().manual_seed(0))
    engine.backward(engine(x[2 * dist.get_rank() : 2 * dist.get_rank() + 2], y[2 * dist.get_rank() : 2 * dist.get_rank() + 2]))
    engine.step()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    reference(x, y).backward()
    opt.step()
    with zero.GatheredParameters(list(model.parameters())):
        error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(model.parameters(),
                                                                                 reference.parameters()))
    return {"error": error, "shard": next(model.parameters()).ds_tensor.numel(),
            "numel": next(model.parameters()).ds_numel}


def test_zero_init_shards_over_the_world_and_a_hybrid_engine_reshards_over_its_shard_group(dist_run):
    for r in dist_run(4, _init_then_hybrid):
        assert r["error"] < 1e-6, r["error"]
        assert r["shard"] == -(-r["numel"] // 2)  # a shard of a pair, not of the 4 ranks zero.Init cut over


def _hybrid_sequence_parallel(stage: int) -> dict:
    """4 ranks: 2 replicas (mics_shard_size 1: one data rank per shard group) of a sequence-parallel
    pair; the states are sharded over the pair and replicated across the replicas."""
    import zero
    from zero.models import GPT, GPTConfig
    from zero.sequence import ulysses_attention

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(cfg), config={
        "train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "mics_shard_size": 1, "stage3_param_persistence_threshold": 0}})
    ulysses_attention(engine.module, engine.seq_parallel_group)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    data, sp = engine.parallel.index("batch"), dist.get_process_group_ranks(engine.seq_parallel_group).index(
        dist.get_rank())
    g, s = torch.Generator().manual_seed(0), 16
    part = slice(sp * s // 2, (sp + 1) * s // 2)
    for _ in range(3):
        idx, targets = torch.randint(0, 64, (4, s), generator=g), torch.randint(0, 64, (4, s), generator=g)
        mine = slice(2 * data, 2 * data + 2)  # this replica's samples, this rank's half of each sequence
        engine.backward(engine(idx[mine, part], targets[mine, part], position_ids=torch.arange(s)[part]))
        engine.step()
        opt.zero_grad()
        reference(idx, targets).backward()
        opt.step()
    with zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 else torch.no_grad():
        error = max(((p.detach() - q.detach()).abs().max() / q.detach().abs().max()).item()
                    for p, q in zip(engine.module.parameters(), reference.parameters()))
    return {"error": error, "zero": engine.comm.world_size, "replicas": engine.replicate.world_size,
            "comm": engine.comm_report()}


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_composes_with_sequence_parallelism(dist_run, stage):
    for r in dist_run(4, _hybrid_sequence_parallel, stage):
        assert (r["zero"], r["replicas"]) == (2, 2)  # sharded over the sequence pair, replicated across
        assert "all_reduce (replicas)" in r["comm"] and "all_to_all (sequence)" in r["comm"]
        assert r["error"] < 1e-5, r["error"]


def _against_flat(stage: int, precision: str, accumulation: int, offload: bool, formats: bool = False) -> dict:
    """Flat ZeRO and HSDP (mics_shard_size 2 = a node of 2) on 2 nodes x 2 ranks, the same data:
    their parameters after 5 steps."""
    import os

    import zero
    from zero.accessors import safe_get_full_fp32_param
    from zero.testing.training import STAGE3, build_model, make_batch

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        torch.manual_seed(0)
        base = build_model("gpt")
        params = []
        for shard in (-1, 2):
            zc = {"stage": stage, "mics_shard_size": shard, "reduce_bucket_size": 500,
                  **(STAGE3["gpt"] if stage == 3 else {}), **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
            engine = zero.initialize(model=copy.deepcopy(base), config={
                "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation, "zero_optimization": zc,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **({"state_dtype": "int8"} if formats else {})}},
                **({precision: {"enabled": True, **({"bf16_master_weights_and_grads": True} if formats else {})}}
                   if precision != "fp32" else {})})[0]
            g = torch.Generator().manual_seed(rank)
            for _ in range(5 * accumulation):
                engine.backward(engine(*make_batch("gpt", 2, g)))
                engine.step()
            params.append(torch.cat([safe_get_full_fp32_param(p).reshape(-1) for p in engine.module.parameters()]))
            engine.destroy()
        flat, hybrid = params
        return {"error": ((flat - hybrid).abs().max() / flat.abs().max()).item(),
                "absolute": (flat - hybrid).abs().max().item(), "largest": flat.abs().max().item()}
    finally:
        os.environ.pop("GROUP_RANK")


@pytest.mark.parametrize("stage, precision, accumulation, offload, formats", [
    (1, "fp32", 4, False, False), (2, "bf16", 4, True, False), (3, "bf16", 1, False, False), (3, "fp32", 4, True, False),
    (3, "bf16", 4, True, False), (2, "bf16", 4, False, True), (3, "bf16", 1, True, True)])
def test_hsdp_equals_flat_zero_at_the_same_stage(dist_run, stage, precision, accumulation, offload, formats):
    """fp32: to round-off of the reduction order (shard group, then replicas), 1e-6 relative. bf16:
    the sums of bf16 gradients round differently in the two orders, and an Adam step moves a
    parameter by at most about lr whatever its gradient, so 5 steps of lr 1e-3 differ by at most
    2 x 5 x 1e-3 (measured: 2e-3 relative to the largest parameter, 1e-3 absolute). The state
    formats too: a bf16 master and 8-bit moments; the master is rounded stochastically with random
    bits drawn by position in the shard, which differs between the layouts, so each parameter may
    also differ by up to 2 ulps of bf16 (2 x 2^-7 of its size)."""
    for r in dist_run(4, _against_flat, stage, precision, accumulation, offload, formats):
        if precision == "fp32":
            assert r["error"] < 1e-6, r
        else:
            assert 0 < r["absolute"] <= 2 * 5 * 1e-3 + (2 * 2**-7 * r["largest"] if formats else 0), r


def test_a_shard_group_of_one_node_is_asked_for_by_name(monkeypatch):
    """`"mics_shard_size": "node"`: the data-parallel ranks of one node, from torchrun's
    LOCAL_WORLD_SIZE (less the ranks of the other dimensions); refused naming the key without it."""
    from zero.config import ConfigError, load_config

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": "node"}}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert load_config(config, world_size=8).zero_optimization.mics_shard_size == 4
    assert load_config({**config, "sequence_parallel_size": 2}, world_size=8).zero_optimization.mics_shard_size == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="zero_optimization.mics_shard_size: is 'node', but the ranks per node"):
        load_config(config, world_size=8)


def _edit_on_one_rank(modifier: int) -> dict:
    import zero
    from zero.testing.training import STAGE3, build_model

    world = dist.get_world_size()
    engine = zero.initialize(model=build_model("mlp"), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "mics_shard_size": 2, **STAGE3["mlp"]}})[0]
    weight = next(engine.module.parameters())
    with zero.GatheredParameters([weight], modifier_rank=modifier):
        if dist.get_rank() == modifier:  # the DeepSpeed pattern: one rank loads or edits
            with torch.no_grad():
                weight.fill_(0.5)
    with zero.GatheredParameters([weight]):
        value = weight.detach().clone()
    from zero.accessors import safe_get_full_fp32_param

    return {"value": value, "master": safe_get_full_fp32_param(weight), "world": world}


@pytest.mark.parametrize("modifier", [0, 3])
def test_an_edit_on_one_data_rank_reaches_every_replica(dist_run, modifier):
    """modifier_rank is a data-parallel rank (DeepSpeed's meaning): with 2 replicas of 2 ranks, an
    edit made on rank 0 or on rank 3 (the second replica's) reaches all 4 ranks, the masters too."""
    for r in dist_run(4, _edit_on_one_rank, modifier):
        assert torch.all(r["value"] == 0.5) and torch.all(r["master"] == 0.5)

"""ZeRO++ qwZ (see [Note: int8 weight blocks] in zero/zeropp/blocks.py): the C and CUDA kernels
equal the torch reference bit for bit; the quantized all-gather over 3 and 6 ranks decodes every
rank's message; training with it stays within the stated loss bound of exact ZeRO-3 while its
gathers send about half the bytes; the byte ledger agrees with the formula; bad input is refused
naming the key."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from zero.zeropp.blocks import BLOCK, dequantize, dequantize_reference, message_bytes, quantize, quantize_reference

SIZES = (0, 1, 3, 255, 256, 257, 1000, 4099)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _samples(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=g) * 10 ** torch.randint(-3, 3, (1,), generator=g).float()
    if n >= 600:  # a block of zeros, a block of subnormal-sized values, a ragged last block
        x[256:512] = 0
        x[512:600] = torch.randn(88, generator=g) * 1e-40
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_weight_blocks_the_c_kernel_equals_the_reference_bit_for_bit(dtype):
    from zero.ops.quant import dequantize_into, quantize_into

    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        x = _samples(n, dtype, g)
        native = torch.empty(message_bytes(n), dtype=torch.uint8)
        quantize_into(x, native)  # the C kernel itself (no fallback can hide here)
        assert torch.equal(native, quantize_reference(x)), n
        messages = torch.stack([native, quantize_reference(-2 * x), quantize_reference(x.flip(0))])
        out, ref = torch.empty(3 * n, dtype=dtype), torch.empty(3 * n, dtype=dtype)
        dequantize_into(messages, n, out)
        dequantize_reference(messages, n, ref)
        assert torch.equal(_bits(out), _bits(ref)), n
        if n:  # at most half a step (amax / 254 of the block) from the value, plus the dtype's rounding
            amax = torch.nn.functional.pad(x.float().abs(), (0, -n % BLOCK)).view(-1, BLOCK).amax(1)
            bound = (amax / 254).repeat_interleave(BLOCK)[:n] * (1 + 1e-5) + x.float().abs() * 2 ** -7
            assert ((out[:n].float() - x.float()).abs() <= bound).all(), n
    shaped = torch.randn(7, 33, generator=g).to(dtype)  # any shape: flattened
    assert torch.equal(quantize(shaped), quantize_reference(shaped.reshape(-1)))
    assert message_bytes(257) == 260 + 2 * 4  # codes padded to 4 bytes, then a scale per block


def test_a_nan_or_inf_weight_spoils_its_block_visibly_not_silently():
    x = torch.randn(600)
    x[5], x[300] = float("nan"), float("inf")
    for msg in (quantize(x), quantize_reference(x)):
        out = torch.empty(600)
        dequantize(msg.view(1, -1), 600, out)
        assert out[:256].isnan().all() and out[256:512].isnan().all() and out[512:].isfinite().all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_weight_blocks_the_cuda_kernel_equals_the_reference_bit_for_bit(dtype):
    from zero.ops.quant import dequantize_into_cuda, quantize_into_cuda

    g = torch.Generator().manual_seed(1)
    for n in (*SIZES, 1 << 20):
        x = _samples(n, dtype, g)
        msg = torch.empty(message_bytes(n), dtype=torch.uint8, device="cuda")
        quantize_into_cuda(x.cuda(), msg)
        assert torch.equal(msg.cpu(), quantize_reference(x)), n
        assert torch.equal(quantize_reference(x.cuda()).cpu(), quantize_reference(x)), n  # the reference on CUDA
        messages = torch.stack([quantize_reference(x), quantize_reference(-x)])
        out = torch.empty(2 * n, dtype=dtype, device="cuda")
        dequantize_into_cuda(messages.cuda(), n, out)
        assert torch.equal(_bits(out.cpu()), _bits(dequantize_reference(messages, n, torch.empty(2 * n, dtype=dtype))))


def _gather(n: int) -> dict:
    from zero.parallel.comm import Comm
    from zero.zeropp.gather import all_gather_quantized

    world, rank = dist.get_world_size(), dist.get_rank()
    shards = [_samples(n, torch.bfloat16, torch.Generator().manual_seed(r)) for r in range(world)]
    comm = Comm()
    full = torch.empty(world * n + 5, dtype=torch.bfloat16)
    all_gather_quantized(comm, full, shards[rank])
    expected = torch.cat([dequantize_reference(quantize_reference(s).view(1, -1), n, torch.empty(n, dtype=torch.bfloat16))
                          for s in shards])
    return {"equal": torch.equal(_bits(full[: world * n]), _bits(expected)),
            "bytes": comm.report()["all_gather (qwZ)"]["bytes"]}


@pytest.mark.parametrize("world", [3, 6])
def test_the_quantized_all_gather_decodes_every_ranks_message(dist_run, world):
    for n in (1, 517):  # odd sizes, a ragged last block
        for r in dist_run(world, _gather, n):
            assert r["equal"]
            assert r["bytes"] == world * message_bytes(n)


def _temporaries_estimate(module, zc: dict, dtype: str = "bf16") -> float:
    """The estimator's buffers of a stage-3 layout on 2 nodes of 2 ranks, less those of the same
    layout without ZeRO++'s quantized collectives and the two-hop gather: their temporaries."""
    from zero.estimate import estimate_memory

    plain = {k: v for k, v in zc.items() if not k.startswith(("zero_quantized", "mics_hierarchical"))}
    return (estimate_memory(module, 4, dtype=dtype, gpus_per_node=2, config={"zero_optimization": zc}).row(
        3, "none").buffers - estimate_memory(module, 4, dtype=dtype, gpus_per_node=2, config={
            "zero_optimization": plain}).row(3, "none").buffers)


def _train(steps: int) -> dict:
    import zero
    from zero.monitor import _cross_node_formula
    from zero.testing.training import STAGE3, build_model, make_batch

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)  # 2 nodes of 2 ranks
    try:
        torch.manual_seed(0)
        base = build_model("gpt")
        runs = {}
        for name, extra in (("exact", {}), ("qwz", {"zero_quantized_weights": True}),
                            ("hpz+qwz", {"zero_quantized_weights": True, "zero_hpz_partition_size": 2}),
                            ("qgz", {"zero_quantized_gradients": True}),
                            ("zero++", {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                        "zero_quantized_gradients": True}),
                            ("fp16 exact", {}), ("fp16 zero++", {"zero_quantized_weights": True,
                                                                 "zero_hpz_partition_size": 2,
                                                                 "zero_quantized_gradients": True})):
            zc = {"stage": 3, **STAGE3["gpt"], "stage3_max_reuse_distance": 0, **extra}
            precision = {"fp16": {"enabled": True, "initial_scale_power": 8}} if name.startswith("fp16") else \
                {"bf16": {"enabled": True}}
            engine = zero.initialize(model=copy.deepcopy(base), config={
                "train_micro_batch_size_per_gpu": 2, "zero_optimization": zc, **precision,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})[0]
            batch, losses = make_batch("gpt", 2, torch.Generator().manual_seed(rank)), []
            for _ in range(steps):  # one batch again and again: the loss must fall
                loss = engine(*batch)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            comm = engine.comm_report()
            runs[name] = {"loss": sum(losses[-3:]) / 3, "first": losses[0], "comm": comm,
                          "temporaries": engine.memory_report()["collective_temporaries_peak"],
                          "temporaries_estimate": _temporaries_estimate(engine.module, zc),
                          "crossing": sum(c["cross_node_bytes"] for c in comm.values()),
                          "formula": _cross_node_formula(engine)[1],
                          "masters": torch.cat([s.master.float().reshape(-1) for s in engine.optimizer.slots()])}
        return runs
    finally:
        os.environ.pop("GROUP_RANK")


def test_zeropp_trains_within_the_loss_bound_and_sends_a_quarter_of_the_bytes_across_nodes(dist_run):
    for r in dist_run(4, _train, 12):
        exact, qwz, both, qgz, zpp = r["exact"], r["qwz"], r["hpz+qwz"], r["qgz"], r["zero++"]
        assert exact["loss"] < exact["first"] * 0.95, exact  # it learns
        for run in (qwz, both, qgz, zpp):
            assert abs(run["loss"] - exact["loss"]) <= 0.005 * exact["loss"], (run["loss"], exact["loss"])
            assert not torch.equal(run["masters"], exact["masters"])  # the forward did see rounded weights
            assert run["crossing"] == pytest.approx(run["formula"], rel=0.1)  # the ledger and the formula
            # the int8 messages, reordered parts and partial sums: measured, within the estimate
            assert 0.5 * run["temporaries_estimate"] <= run["temporaries"] <= run["temporaries_estimate"], run
        assert exact["temporaries"] == exact["temporaries_estimate"] == 0
        # forward and backward gather int8 blocks: ~1.02 bytes per element instead of bf16's 2
        assert qwz["comm"]["all_gather (qwZ)"]["bytes"] <= 0.53 * exact["comm"]["all_gather"]["bytes"]
        assert both["comm"]["all_gather (hpZ)"]["cross_node_bytes"] == 0  # backward's gathers stay in the node
        assert both["crossing"] < qwz["crossing"] < exact["crossing"]
        # the reduce-scatter's bytes across nodes: one int8 message of its part to the other node
        assert qgz["comm"]["all_to_all (qgZ, across)"]["cross_node_bytes"] <= 0.26 * exact["comm"]["reduce_scatter"][
            "cross_node_bytes"]
        assert "reduce_scatter" not in zpp["comm"]
        assert zpp["crossing"] <= 0.3 * exact["crossing"], (zpp["crossing"], exact["crossing"])  # ZeRO++'s target
        fp16, fp16_zpp = r["fp16 exact"], r["fp16 zero++"]  # loss-scaled fp16 gradients through the int8 hops
        assert fp16["loss"] < fp16["first"] * 0.95
        assert abs(fp16_zpp["loss"] - fp16["loss"]) <= 0.005 * fp16["loss"], (fp16_zpp["loss"], fp16["loss"])


def test_quantized_weights_outside_stage_3_are_refused_naming_the_key():
    from zero.config import ConfigError, load_config

    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        with pytest.raises(ConfigError, match=f"zero_optimization.{key}.*stage 3"):
            load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, key: True}},
                        world_size=1)


def _node_of(rank: int, world: int, nodes: int, layout: str) -> int:
    if layout == "consecutive":
        return rank * nodes // world
    if layout == "interleaved":
        return rank % nodes
    return [0, 1, 1, 0, 0, 1][rank]  # not monotone: at place 1, node 0's rank (3) follows node 1's (2)


def _placed_two_hop(nodes: int, layout: str):
    """qgZ's groups over the world, its ranks on `nodes` nodes laid out as `layout` (GROUP_RANK
    set until the caller pops it)."""
    from zero.parallel.comm import Comm
    from zero.parallel.nodes import node_of_ranks
    from zero.zeropp.reduce import TwoHop

    os.environ["GROUP_RANK"] = str(_node_of(dist.get_rank(), dist.get_world_size(), nodes, layout))
    comm = Comm()
    comm.place_on_nodes(dict(enumerate(node_of_ranks())))
    return TwoHop(comm)


def _two_hop(n: int, nodes: int, layout: str = "consecutive") -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        hop = _placed_two_hop(nodes, layout)
        grads = [torch.randn(world * n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        buf = grads[rank].clone()
        mine = buf[rank * n : (rank + 1) * n]  # a view of the input, as stage 3 hands it
        hop.reduce_scatter(mine, buf)
        exact = torch.stack(grads).sum(0)[rank * n : (rank + 1) * n]
        step = max(g.abs().max().item() for g in grads) / 254  # half a step of the largest block, per rounding
        counts = {c: comm_.report() for c, comm_ in (("node", hop.in_node), ("across", hop.across)) if comm_}
        return {"error": (mine - exact).abs().max().item(), "bound": 2 * world * step, "counts": counts,
                "shape": (hop.nodes, hop.local)}
    finally:
        os.environ.pop("GROUP_RANK")


@pytest.mark.parametrize("world, nodes, layout", [(4, 2, "consecutive"), (6, 3, "consecutive"), (6, 2, "interleaved"),
                                                  (3, 3, "consecutive"), (6, 2, "mixed")])
def test_qgz_reduce_scatters_any_size_in_two_quantized_hops_within_the_rounding_bound(dist_run, world, nodes, layout):
    for n in (1, 517):
        for r in dist_run(world, _two_hop, n, nodes, layout):
            assert r["shape"] == (nodes, world // nodes)
            assert r["error"] <= r["bound"], r  # within half a step per element and hop
            assert r["error"] > 0 or n == 1, r  # rounded (a message of one element is exact: +-127 steps)
            counts = r["counts"]
            if nodes > 1:  # one message of n elements to every other node, nothing more crosses
                across = counts["across"]["all_to_all (qgZ, across)"]
                assert across["cross_node_bytes"] == (nodes - 1) * message_bytes(n), across
            if world // nodes > 1:
                assert counts["node"]["all_to_all (qgZ, node)"]["cross_node_bytes"] == 0


def _zpp_engine(zc_extra: dict, stage: int = 3):
    import zero
    from zero.testing.training import STAGE3, build_model

    torch.manual_seed(0)
    zc = {"stage": stage, **(STAGE3["gpt"] if stage == 3 else {}), **zc_extra}
    return zero.initialize(model=build_model("gpt"), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})[0]


ZEROPP = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}


def _zpp_save(path: str) -> list[torch.Tensor]:
    import zero
    from zero.testing.training import make_batch

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        engine = _zpp_engine(ZEROPP)
        for step in range(3):
            engine.backward(engine(*make_batch("gpt", 2, torch.Generator().manual_seed(10 * step + rank))))
            engine.step()
        engine.save_checkpoint(path, tag="zpp")
        with zero.GatheredParameters(list(engine.module.parameters())):  # fp32: the masters' exact values
            return [p.detach().clone() for p in engine.module.parameters()]
    finally:
        os.environ.pop("GROUP_RANK")


def _zpp_load(path: str, zc_extra: dict, stage: int) -> dict:
    import zero
    from zero.testing.training import make_batch

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        engine = _zpp_engine(zc_extra, stage)
        engine.load_checkpoint(path, tag="zpp")
        with zero.GatheredParameters(list(engine.module.parameters())):
            loaded = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(*make_batch("gpt", 2, torch.Generator().manual_seed(99))))
        engine.step()
        return {"loaded": loaded, "steps": engine.global_steps}
    finally:
        os.environ.pop("GROUP_RANK")


def test_a_zeropp_checkpoint_resumes_in_every_layout(dist_run, tmp_path):
    """Saved by hpZ + qwZ + qgZ on 2 nodes x 2 ranks (the masters are exact, so the checkpoint is
    ZeRO-3's), loaded into flat ZeRO-3 on 4 and 2 ranks, HSDP on 4, ZeRO++ on 4 and stage 1 on 1:
    the same parameters bit for bit, and training goes on."""
    path = str(tmp_path / "ckpt")
    saved = dist_run(4, _zpp_save, path)[0]
    for world, extra, stage in ((4, {}, 3), (2, {}, 3), (4, {"mics_shard_size": 2}, 3), (4, ZEROPP, 3), (1, {}, 1)):
        r = dist_run(world, _zpp_load, path, extra, stage)[0]
        assert all(torch.equal(a, b) for a, b in zip(r["loaded"], saved)), (world, extra, stage)
        assert r["steps"] == 4


def _two_hop_gather(nodes: int, layout: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        hop = _placed_two_hop(nodes, layout)
        n = 37
        mine = torch.arange(n, dtype=torch.float32) + 100 * rank
        full = torch.empty(world * n + 3)
        hop.all_gather(full, mine, async_op=True).wait()
        expected = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r for r in range(world)])
        counts = {**hop.across.report(), **(hop.in_node.report() if hop.in_node else {})}
        return {"equal": torch.equal(full[: world * n], expected), "counts": counts}
    finally:
        os.environ.pop("GROUP_RANK")


@pytest.mark.parametrize("world, nodes, layout", [(4, 2, "consecutive"), (6, 3, "interleaved"), (6, 2, "interleaved"),
                                                  (6, 2, "mixed")])
def test_the_two_hop_gather_is_exact_and_crosses_nodes_once_per_part(dist_run, world, nodes, layout):
    """Nodes of consecutive ranks, interleaved ones (rank r on node r mod M), and a layout whose
    nodes' ranks are not in the same order at every place: every rank gets every part in rank
    order, and receives M - 1 parts across nodes, not N - L."""
    for r in dist_run(world, _two_hop_gather, nodes, layout):
        assert r["equal"]
        assert r["counts"]["all_gather (two-hop, across)"]["cross_node_bytes"] == (nodes - 1) * 37 * 4
        if world > nodes:
            assert r["counts"]["all_gather (two-hop, node)"]["cross_node_bytes"] == 0


def _hierarchical_training() -> dict:
    import zero
    from zero.testing.training import STAGE3, build_model, make_batch

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        torch.manual_seed(0)
        base = build_model("gpt")
        out = []
        for hierarchical in (False, True):
            zc = {"stage": 3, **STAGE3["gpt"], "stage3_max_reuse_distance": 0,
                  "mics_hierarchical_params_gather": hierarchical}
            engine = zero.initialize(model=copy.deepcopy(base), config={
                "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": zc})[0]
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                engine.backward(engine(*make_batch("gpt", 2, g)))
                engine.step()
            with zero.GatheredParameters(list(engine.module.parameters())):
                out.append(([p.detach().clone() for p in engine.module.parameters()], engine.comm_report()))
        (flat, _), (two_hop, comm) = out
        from zero.monitor import _cross_node_formula

        return {"same": all(torch.equal(a, b) for a, b in zip(flat, two_hop)), "comm": comm,
                "temporaries": engine.memory_report()["collective_temporaries_peak"],
                "temporaries_estimate": _temporaries_estimate(engine.module, zc, "fp32"),
                "crossing": sum(c["cross_node_bytes"] for c in comm.values()), "formula": _cross_node_formula(engine)[1]}
    finally:
        os.environ.pop("GROUP_RANK")


def test_stage_3_with_the_two_hop_gather_trains_bit_for_bit_as_flat(dist_run):
    for r in dist_run(4, _hierarchical_training):
        assert r["same"]  # copies: the same parameters as flat ZeRO-3
        assert r["comm"]["all_gather (two-hop, across)"]["calls"] > 0
        assert 0.5 * r["temporaries_estimate"] <= r["temporaries"] <= r["temporaries_estimate"], r
        assert r["crossing"] == pytest.approx(r["formula"], rel=0.1)  # the ledger and the formula

"""1-bit Adam (issue 15): the compression, the compressed exchange against a one-process
reference of the algorithm at world sizes 2-4, exact Adam before freeze_step, convergence within
2% of Adam at stages 0-2, the bytes sent, and the errors."""
import pytest
import torch
import torch.distributed as dist

import zero
from zero.config import ConfigError
from zero.onebit.compress import BLOCK, pack, packed_bytes, scale_count, unpack_mean
from zero.testing.models import GPT, CharDataset, GPTConfig, arithmetic_corpus

SIZES = [1, 7, 33, 1000, 1024, 1025, 5003]  # not multiples of 8, 32, BLOCK or the world size


def test_pack_and_unpack_against_their_definition():
    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
        old = torch.randn(n, generator=g) * 0.1
        error = old.clone()
        bits, scales = pack(x, error)
        y = x + old
        assert bits.dtype == torch.uint8 and bits.numel() == packed_bytes(n) and scales.numel() == scale_count(n)
        expected_bits = [sum(int(y[8 * j + i] >= 0) << i for i in range(8) if 8 * j + i < n) for j in range(bits.numel())]
        assert bits.tolist() == expected_bits, n  # bitwise
        for k in range(scale_count(n)):
            block = y[k * BLOCK : (k + 1) * BLOCK]
            assert scales[k].item() == pytest.approx(block.square().mean().sqrt().item(), rel=1e-6)
        sent = unpack_mean(bits.view(1, -1), scales.view(1, -1), n)
        assert torch.allclose(sent + error, y, atol=1e-6), n  # error feedback: nothing lost
        assert torch.equal(sent.abs(), scales.repeat_interleave(BLOCK)[:n])
    many = torch.stack([pack(torch.randn(1025, generator=g), torch.zeros(1025))[0] for _ in range(3)])
    sc = torch.rand(3, scale_count(1025), generator=g)
    mean = unpack_mean(many, sc, 1025)
    one_by_one = sum(unpack_mean(many[r : r + 1], sc[r : r + 1], 1025) for r in range(3)) / 3
    assert torch.allclose(mean, one_by_one, atol=1e-6)


def test_native_kernels_equal_the_torch_reference_at_every_simd_level():
    from zero.onebit.compress import pack_reference, unpack_mean_reference
    from zero.ops.builder import missing
    from zero.ops.cpu_adam import simd_levels
    from zero.ops.onebit import pack_into, unpack_mean_into

    assert missing("onebit") is None, missing("onebit")  # a C compiler is part of the test setup
    g = torch.Generator().manual_seed(1)
    for simd in simd_levels():
        for n in SIZES + [100_003]:
            x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
            old = torch.randn(n, generator=g) * 0.1
            e_ref, e_nat = old.clone(), old.clone()
            bits_ref, scales_ref = pack_reference(x, e_ref)
            bits = torch.empty(packed_bytes(n), dtype=torch.uint8)
            scales = torch.empty(scale_count(n), dtype=torch.float32)
            pack_into(x, e_nat, bits, scales, BLOCK, simd=simd, num_threads=2)
            assert torch.equal(bits, bits_ref), (simd, n)  # bitwise
            assert torch.allclose(scales, scales_ref, rtol=1e-6), (simd, n)
            assert torch.allclose(e_nat, e_ref, rtol=1e-6, atol=1e-6), (simd, n)
            many = torch.stack([bits, bits_ref.roll(1), bits])
            sc = torch.stack([scales, scales * 0.5, scales * 2])
            out = torch.empty(n, dtype=torch.float32)
            unpack_mean_into(many, sc, out, BLOCK, simd=simd, num_threads=2)
            assert torch.allclose(out, unpack_mean_reference(many, sc, n), rtol=1e-6, atol=1e-7), (simd, n)


def _reference_exchange(inputs, full):
    """The algorithm of [Note: compressed exchange] in one process, for all ranks at once."""
    n = len(inputs)
    numel = inputs[0][0].numel()
    s = -(-numel // n)
    worker = [torch.zeros(n * s) for _ in range(n)]
    server = [torch.zeros(s) for _ in range(n)]
    results = []
    for step in range(len(inputs[0])):
        xs = [torch.cat([inputs[r][step], torch.zeros(n * s - numel)]) for r in range(n)]
        packed = [[pack(xs[r][c * s : (c + 1) * s], worker[r][c * s : (c + 1) * s]) for c in range(n)]
                  for r in range(n)]
        means = [unpack_mean(torch.stack([packed[r][c][0] for r in range(n)]),
                             torch.stack([packed[r][c][1] for r in range(n)]), s) for c in range(n)]
        if not full:
            results.append([means[r][: min(s, numel - r * s)] * n for r in range(n)])
            continue
        again = [pack(means[c], server[c]) for c in range(n)]
        whole = torch.cat([unpack_mean(b.view(1, -1), sc.view(1, -1), s) for b, sc in again])[:numel] * n
        results.append([whole] * n)
    return results


def exchange_on_ranks(numel: int, full: bool, steps: int):
    from zero.onebit.exchange import CompressedExchange
    from zero.parallel.comm import Comm

    comm = Comm()
    rank, n = comm.rank, comm.world_size
    ex = CompressedExchange(comm, [numel], full_result=full, device=torch.device("cpu"))
    s = -(-numel // n)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        buf = torch.randn(numel, generator=g) * torch.logspace(-2, 1, numel)
        ex.reduce(0, buf, (rank * s, min(numel, rank * s + s)))
        out.append(buf if full else buf[rank * s : min(numel, rank * s + s)])
    return out + [ex.worker_error[0][:numel].clone()]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_exchange_equals_the_reference_algorithm(dist_run, world):
    steps = 3
    for numel, full in ((5003, True), (1025, True), (world * 1030, False), (world * 7, False)):
        got = dist_run(world, exchange_on_ranks, numel, full, steps)
        inputs = [[torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + r))
                   * torch.logspace(-2, 1, numel) for step in range(steps)] for r in range(world)]
        want = _reference_exchange(inputs, full)
        for step in range(steps):
            for r in range(world):
                assert torch.allclose(got[r][step], want[step][r], rtol=1e-6, atol=1e-6), (world, numel, full, step, r)
        if not full:  # nothing lost: what arrived over the steps is what was sent, less what is still owed
            arrived = torch.cat([sum(got[r][step] for step in range(steps)) for r in range(world)])
            sent = sum(sum(inputs[r][step] for step in range(steps)) for r in range(world))
            owed = sum(got[r][steps] for r in range(world))
            assert torch.allclose(arrived, sent - owed, rtol=1e-5, atol=1e-4), (world, numel)


def _batch(data, g: torch.Generator, rank: int, world: int):
    """This rank's 16 windows of the next batch of 16 x world drawn from `g` (the same on every rank)."""
    idx = torch.randint(0, len(data), (16 * world,), generator=g)[16 * rank : 16 * rank + 16]
    return torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])


def train_gpt(stage: int, optimizer: str, steps: int, freeze: int, seed: int = 0, extra: dict | None = None):
    """The demo GPT on the arithmetic corpus: (mean loss of the last 20 steps, the comm reports of
    the step before the freeze and of the last, the parameters). `seed` draws the initial weights
    and the batches (seed 0: the batches ZeroOneAdam's test uses)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    data = CharDataset(arithmetic_corpus(100_000), 32)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64))
    params = {"lr": 3e-3, **({"freeze_step": freeze} if optimizer == "OneBitAdam" else {}), **(extra or {})}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 16, "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000}})
    g = torch.Generator().manual_seed(1 + seed)
    losses, reports = [], {}
    for step in range(steps):
        x, y = _batch(data, g, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step in (freeze - 1, steps - 1):
            reports[step] = engine.comm_report()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return sum(losses[-20:]) / 20, reports, params if stage < 3 else None


SEEDS = (0, 1, 2)


def test_exact_adam_before_freeze_step_then_within_two_percent(dist_run):
    """freeze_step 45 of 300 steps (15%). Before the freeze the parameters equal Adam's bitwise.
    Over three seeds, the demo GPT's mean final loss is within 2% of Adam's at stages 0-2, and at
    stage 2 with the compressed parameter gather too. (One seed alone is not a measurement: two
    Adam runs with different seeds end 0.5% apart here, and the compressed runs' order changes
    with the SIMD level of the machine.) After the freeze the gradient exchange is compressed
    about 30x against this fp32 run's, 15x against an fp16 exchange; with the compressed gather
    the whole step's traffic is, and every rank holds the same bits after every step."""
    def mean_loss(stage, optimizer, extra=None):
        runs = [dist_run(2, train_gpt, stage, optimizer, 300, 45, seed, extra) for seed in SEEDS]
        return sum(r[0][0] for r in runs) / len(runs), runs

    adam, _ = mean_loss(0, "Adam")  # Adam's result does not depend on the stage (test_stages_match_reference)
    for stage, extra in ((0, None), (1, None), (2, None), (2, {"compress_param_gather": True})):
        onebit, runs = mean_loss(stage, "OneBitAdam", extra)
        assert onebit < adam * 1.02, (stage, extra, adam, onebit)
        before, after = runs[0][0][1][44], runs[0][0][1][299]
        exact_bytes = sum(v["bytes"] for k, v in before.items() if k in ("all_reduce_sum", "reduce_scatter"))
        elements = sum(v["elements"] for k, v in before.items() if k in ("all_reduce_sum", "reduce_scatter"))
        assert not any(k.startswith("onebit") for k in before), before
        sent = sum(v["bytes"] for k, v in after.items() if k.startswith("onebit") and "param" not in k)
        assert sent * 15 <= elements * 2 * (2 if stage == 0 else 1) + 64, (stage, sent, elements)  # vs fp16
        assert sent * 25 <= exact_bytes * (2 if stage == 0 else 1), (stage, sent, exact_bytes)
        if extra:  # the parameters' all-gather too: the whole step, against Adam's 16-bit step
            everything = sum(v["bytes"] for k, v in after.items() if k != "all_reduce_sum")  # the norm's: 8 bytes
            assert not any(k == "all_gather" for k in after) and "onebit_param_bits" in after, after
            assert everything * 15 <= 2 * 2 * elements, (everything, elements)
            for r in runs:
                assert all(torch.equal(r[0][2][n], r[1][2][n]) for n in r[0][2]), "ranks differ"
    for stage in (0, 1, 2):
        exact = dist_run(2, train_gpt, stage, "OneBitAdam", 10, 10)[0]  # up to the freeze: Adam, bitwise
        reference = dist_run(2, train_gpt, stage, "Adam", 10, 100)[0]
        assert all(torch.equal(exact[2][n], reference[2][n]) for n in reference[2]), stage


def test_the_frozen_step_against_hand_written_torch():
    """World 1 (nothing to compress): Adam for freeze_step steps, then the variance and its bias
    correction frozen, AdamW's decoupled weight decay; against the update written out in torch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    w0 = [p.detach().clone() for p in model.parameters()]
    engine, optimizer, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01, "weight_decay": 0.1, "freeze_step": 2}}})
    assert optimizer.storage.exchange.tensors() == {}  # one rank: no error buffers
    params = [p.clone() for p in w0]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    b1, b2, lr, wd, eps = 0.9, 0.999, 0.01, 0.1, 1e-8
    for step in range(1, 6):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        ref = [p.detach().clone().requires_grad_() for p in params]
        torch.nn.functional.linear(x, *ref).square().mean().backward()
        for i, p in enumerate(ref):
            g = p.grad
            params[i] = params[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            if step <= 2:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            bc2 = 1 - b2 ** min(step, 2)
            params[i] = params[i] - lr / (1 - b1**step) * m[i] / (v[i].sqrt() / bc2**0.5 + eps)
        for p, q in zip(model.parameters(), params):
            assert torch.allclose(p.detach(), q, rtol=1e-5, atol=1e-7), step


def test_misuse_is_a_clear_error():
    base = {"train_micro_batch_size_per_gpu": 1}
    for optimizer, says in (({"type": "ZeroOneAdam", "params": {"freeze_step": 9}}, "freeze_step is a OneBitAdam"),
                            ({"type": "OneBitAdam", "params": {"var_freeze_step": 9}}, "is a ZeroOneAdam parameter"),
                            ({"type": "ZeroOneAdam", "params": {"local_step_clipper": 0}}, "local_step_clipper"),
                            ({"type": "OneBitAdam", "params": {"freeze_step": 0}}, r"params.freeze_step: .*>= 1"),
                            ({"type": "Adam", "params": {"freeze_step": 9}}, "freeze_step is a OneBitAdam parameter"),
                            ({"type": "OneBitAdam", "params": {"freezestep": 3}}, "freezestep"),
                            ({"type": "OneBitAdam", "params": {"comm_backend_name": "tcp"}}, "comm_backend_name"),
                            ({"type": "ZeroOneAdam", "params": {"compress_param_gather": True}},
                             "compress_param_gather is a OneBitAdam parameter"),
                            ({"type": "OneBitAdam", "params": {"compress_param_gather": "yes"}},
                             "compress_param_gather")):
        with pytest.raises(ConfigError, match=says):
            zero.load_config({**base, "optimizer": optimizer})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="OneBitAdam but initialize.. was given a SGD too"):
        zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        config={**base, "optimizer": {"type": "OneBitAdam"}})
    from zero.ops.builder import missing
    from zero.ops.onebit import pack_into

    if missing("onebit") is None:
        with pytest.raises(ValueError, match="bits"):  # a short output buffer, refused before any write
            pack_into(torch.zeros(100), torch.zeros(100), torch.empty(3, dtype=torch.uint8), torch.empty(1), BLOCK)
    with pytest.raises(ValueError, match="ZeroOneAdam needs ZeRO stage 0, not 1"):
        zero.initialize(model=torch.nn.Linear(2, 2), config={**base, "optimizer": {"type": "ZeroOneAdam"},
                                                             "zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match="ZeroOneAdam with offload_optimizer is not supported"):
        zero.initialize(model=torch.nn.Linear(2, 2), config={
            **base, "optimizer": {"type": "ZeroOneAdam"},
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match="compress_param_gather applies to ZeRO stages 1 and 2"):
        zero.initialize(model=torch.nn.Linear(2, 2), config={
            **base, "optimizer": {"type": "OneBitAdam", "params": {"compress_param_gather": True}}})
    with pytest.raises(ValueError, match="OneBitAdam needs ZeRO stage 0, 1 or 2"):
        zero.initialize(model=torch.nn.Linear(2, 2), config={**base, "optimizer": {"type": "OneBitAdam"},
                                                             "zero_optimization": {"stage": 3}})


def resume_run(stage: int, path: str, steps: int, save_at: int | None, load: bool, gather: bool = False):
    """Train the small GPT with OneBitAdam (freeze_step 3; `gather`: compress_param_gather) on
    batches fixed by the step number; optionally save after `save_at` steps, or start by loading."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=32))
    params = {"lr": 1e-2, "freeze_step": 3, **({"compress_param_gather": True} if gather else {})}
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "OneBitAdam", "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}})
    start = 0
    if load:
        engine.load_checkpoint(path)
        start = engine.global_steps
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 40, (4, 17), generator=g)
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(path)
    errors = {k: v.clone() for k, v in engine.optimizer.rank_state().items()}
    held = sum(t.untyped_storage().nbytes() for t in engine.optimizer.storage.exchange.tensors().values())
    assert engine.memory_report()["compression_errors"] == held and (held > 0) == (dist.is_initialized())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, errors


def test_resume_after_the_freeze_continues_bitwise(tmp_path):
    """Stop after the freeze, save, load in new processes, continue: the parameters and the error
    buffers equal the unbroken run's bitwise, with the compressed parameter gather too (its
    parameters trail the master: the checkpoint's model is what the ranks held). At another world
    size the buffers start from zero."""
    from zero.testing.dist import DistPool

    for stage, gather in ((0, False), (2, False), (2, True)):
        path = str(tmp_path / f"stage{stage}{'_gather' if gather else ''}")
        pool = DistPool(2)
        try:
            unbroken = pool.run(resume_run, stage, path + "_unused", 8, None, False, gather)
            pool.run(resume_run, stage, path, 5, 5, False, gather)  # saves after step 5 (compressing since step 4)
        finally:
            pool.close()
        pool = DistPool(2)  # new processes
        try:
            resumed = pool.run(resume_run, stage, path, 8, None, True, gather)
        finally:
            pool.close()
        for r in range(2):
            assert all(torch.equal(unbroken[r][0][n], resumed[r][0][n]) for n in unbroken[r][0]), (stage, r)
            assert unbroken[r][1].keys() == resumed[r][1].keys() and unbroken[r][1]
            assert all(torch.equal(unbroken[r][1][k], resumed[r][1][k]) for k in unbroken[r][1]), (stage, r)
    with pytest.warns(UserWarning, match="per-rank state .* starts from zero"):
        params, errors = resume_run(2, str(tmp_path / "stage2"), 6, None, True)  # world 1: other chunks
    assert all(torch.isfinite(p).all() for p in params.values())


def variants(stage: int, extra: dict, steps: int = 8):
    """OneBitAdam (freeze_step 3) with `extra` config: its parameters after `steps` steps."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=32))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
              "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3}}}
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    engine, *_ = zero.initialize(model=model, config=config)
    for step in range(steps * engine.config.gradient_accumulation_steps):
        x = torch.randint(0, 40, (4, 17), generator=torch.Generator().manual_seed(1000 * step + rank))
        engine.backward(engine(x[:, :-1], x[:, 1:]).float())
        engine.step()
    with zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}, engine.global_steps


def test_with_offload_accumulation_and_16_bit_training(dist_run):
    """Optimizer offload steps the same numbers on the host; accumulation, bf16 and fp16 train
    through the compressed phase to finite parameters. (A variance frozen after 3 steps of a tiny
    model makes large steps, so the runs are not compared with each other.)"""
    plain = dist_run(2, variants, 2, {})[0][0]
    offloaded = dist_run(2, variants, 2, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})[0][0]
    assert all(torch.allclose(plain[n], offloaded[n], rtol=1e-6, atol=1e-7) for n in plain)
    gather = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3, "compress_param_gather": True}}}
    plain = dist_run(2, variants, 1, gather)
    offloaded = dist_run(2, variants, 1, {**gather, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    for r in range(2):  # every rank holds the same bits, with and without offload
        assert all(torch.equal(plain[0][0][n], x[r][0][n]) for x in (plain, offloaded) for n in plain[0][0])
    bf16 = dist_run(2, variants, 2, {**gather, "bf16": {"enabled": True}})
    assert all(torch.equal(bf16[0][0][n], bf16[1][0][n]) and torch.isfinite(bf16[0][0][n]).all() for n in bf16[0][0])
    for stage in (1, 2):
        for extra in ({"gradient_accumulation_steps": 2}, {"bf16": {"enabled": True}},
                      {"fp16": {"enabled": True, "initial_scale_power": 8}}):
            params, steps = dist_run(2, variants, stage, extra)[0]
            assert steps == 8 and all(torch.isfinite(p).all() for p in params.values()), (stage, extra)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_equal_the_torch_reference():
    from zero.onebit.compress import pack_reference, unpack_mean_reference
    from zero.ops.onebit import pack_into_cuda, unpack_mean_into_cuda

    g = torch.Generator().manual_seed(2)
    for n in SIZES + [100_003, 3_000_001]:
        x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
        old = torch.randn(n, generator=g) * 0.1
        e_ref = old.clone()
        bits_ref, scales_ref = pack_reference(x, e_ref)
        e = old.cuda()
        bits = torch.empty(packed_bytes(n), dtype=torch.uint8, device="cuda")
        scales = torch.empty(scale_count(n), dtype=torch.float32, device="cuda")
        pack_into_cuda(x.cuda(), e, bits, scales, BLOCK)
        assert torch.equal(bits.cpu(), bits_ref), n  # bitwise
        assert torch.allclose(scales.cpu(), scales_ref, rtol=1e-6), n
        assert torch.allclose(e.cpu(), e_ref, rtol=1e-6, atol=1e-6), n
        many = torch.stack([bits_ref, bits_ref.roll(1), bits_ref])
        sc = torch.stack([scales_ref, scales_ref * 0.5, scales_ref * 2])
        out = torch.empty(n, dtype=torch.float32, device="cuda")
        unpack_mean_into_cuda(many.cuda(), sc.cuda(), out, BLOCK)
        assert torch.allclose(out.cpu(), unpack_mean_reference(many, sc, n), rtol=1e-6, atol=1e-7), n


def onebit_memory(stage: int, gather: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=32))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
              "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 1, "compress_param_gather": gather}}}
    estimate = zero.estimate_memory(model, 2, stage=stage, offload="none", dtype="fp32", config=config)[0]
    engine, *_ = zero.initialize(model=model, config=config)
    for step in range(3):  # past the freeze: the compressed gather's buffers have been used
        x = torch.randint(0, 40, (4, 17), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
    report = engine.memory_report()
    return (estimate.compression_errors, report["compression_errors"], len(engine.optimizer.storage.layout.buckets),
            estimate.fp32_master, report["fp32_master"], estimate.buffers, report.get("gather_buffers_peak", 0))


def test_the_estimator_counts_the_error_buffers(dist_run):
    """And the compressed gather's cost: at fp32 an fp32 master of the owned slices (else the
    parameters themselves), and a copy of the owned slices during the step."""
    for stage, gather in ((0, False), (2, False), (2, True)):
        estimated, measured, buckets, master_estimated, master, buffers, gathered = dist_run(2, onebit_memory, stage,
                                                                                            gather)[0]
        assert measured > 0 and abs(estimated - measured) <= 4 * 2 * 16 * (buckets + 1) * 2, (stage, estimated, measured)
        assert (master > 0) == gather and abs(master_estimated - master) <= 4 * 16 * buckets, (master_estimated, master)
        assert (gathered > 0) == gather and gathered <= buffers - estimated, (gathered, buffers, estimated)


ZERO_ONE = {"var_freeze_step": 45, "var_update_scaler": 4, "local_step_scaler": 20, "local_step_clipper": 4}


def train_zero_one(steps: int, params: dict, path: str | None = None, save_at: int | None = None,
                   load: bool = False, bf16: bool = False):
    """The demo GPT with ZeroOneAdam at stage 0: (final loss, bytes sent, the parameters after the
    last step that was a sync, this rank's parameters at the end)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    data = CharDataset(arithmetic_corpus(100_000), 32)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64))
    engine, optimizer, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 3e-3, **params}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 50_000}, "bf16": {"enabled": bf16}})
    start = 0
    if load:
        engine.load_checkpoint(path)
        start = engine.global_steps
    losses, sent, synced = [], 0, None
    world = dist.get_world_size() if dist.is_initialized() else 1
    g = torch.Generator().manual_seed(1)  # the batches of train_gpt, the same for Adam and a resumed run
    for _ in range(start):
        _batch(data, g, rank, world)
    for step in range(start, steps):
        x, y = _batch(data, g, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        sent += sum(v["bytes"] for v in engine.comm_report().values())
        if optimizer.schedule[5].item() == 0:  # this step ended with a sync (or a variance update)
            synced = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(path)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return sum(losses[-20:]) / 20, sent, synced, final


def test_zero_one_adam_converges_sends_less_and_syncs_bitwise(dist_run):
    """Variance frozen at 15% of 300 steps, syncs every 1-4 steps after it: within 2% of Adam's
    final loss, at least 5x fewer bytes over the run, and after every sync all ranks hold the same
    bits."""
    adam = dist_run(2, train_gpt, 0, "Adam", 300, 45)
    adam_sent = sum(sum(v["bytes"] for v in r.values()) for r in adam[0][1].values())  # two steps' worth
    zero_one = dist_run(2, train_zero_one, 300, ZERO_ONE)
    assert zero_one[0][0] < adam[0][0] * 1.02, (adam[0][0], zero_one[0][0])
    per_step_adam = adam_sent / 2
    assert zero_one[0][1] * 5 <= per_step_adam * 300, (zero_one[0][1], per_step_adam * 300)
    assert torch.equal(zero_one[0][2], zero_one[1][2])  # bitwise equal after the last sync


def test_zero_one_adam_resumes_bitwise_between_syncs(tmp_path):
    """Saved after a local step (ranks differ then), loaded in new processes: the same bits as the
    unbroken run, on every rank."""
    from zero.testing.dist import DistPool

    params = {"var_freeze_step": 4, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
    for bf16 in (False, True):  # bf16: the 16-bit parameters must follow each rank's own restored master
        path = str(tmp_path / f"ckpt{bf16}")
        pool = DistPool(2)
        try:
            unbroken = pool.run(train_zero_one, 14, params, None, None, False, bf16)
            pool.run(train_zero_one, 9, params, path, 9, False, bf16)
        finally:
            pool.close()
        pool = DistPool(2)
        try:
            resumed = pool.run(train_zero_one, 14, params, path, None, True, bf16)
        finally:
            pool.close()
        for r in range(2):
            assert torch.equal(unbroken[r][3], resumed[r][3]), (bf16, r)
    # at another world size (here one process) the per-rank state restarts and the schedule is
    # replayed from the step count: training goes on (a variance-update count of 0 would freeze it)
    with pytest.warns(UserWarning, match="per-rank state .* starts from zero"):
        _, _, _, loaded = train_zero_one(9, params, str(tmp_path / "ckptFalse"), None, True)  # no step
        _, _, _, after = train_zero_one(12, params, str(tmp_path / "ckptFalse"), None, True)
    assert torch.isfinite(after).all() and (after - loaded).abs().max() > 1e-4  # it still learns


def test_zero_one_adam_keeps_edits_and_survives_lr_zero():
    """World 1: a load_state_dict between syncs survives the next sync (the anchor moves with it),
    and lr 0 leaves everything finite and unchanged."""
    params = {"var_freeze_step": 2, "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 4}
    for lr in (1e-2, 0.0):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, optimizer, *_ = zero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "ZeroOneAdam", "params": {"lr": lr, **params}},
            "zero_optimization": {"stage": 0}})
        for step in range(7):
            if step == 4:  # between syncs (the interval is 2 now)
                assert optimizer.schedule[5].item() != 0 or lr == 0
                model.load_state_dict({n: torch.zeros_like(t) for n, t in start.items()})
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).square().mean())
            engine.step()
        for p in model.parameters():
            assert torch.isfinite(p).all()
            assert p.abs().max() < (0.05 if lr else 1e-12), (lr, p)  # the zeros were kept (lr 0: exactly)


def zero_one_memory():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=32))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},
              "optimizer": {"type": "ZeroOneAdam"}}
    estimate = zero.estimate_memory(model, 2, stage=0, offload="none", dtype="fp32", config=config)[0]
    plain = zero.estimate_memory(model, 2, stage=0, offload="none", dtype="fp32")[0]
    engine, *_ = zero.initialize(model=model, config=config)
    report = engine.memory_report()
    return estimate.buffers - plain.buffers, report["compression_errors"] + report["local_step_state"]


def test_the_estimator_counts_zero_one_adams_state(dist_run):
    estimated, measured = dist_run(2, zero_one_memory)[0]
    assert measured > 0 and abs(estimated - measured) <= 4 * 3 * 2 * 16 * 40, (estimated, measured)

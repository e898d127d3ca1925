"""zero.estimate_memory against the formulas and against memory_report() of real runs."""
import pytest
import torch
import torch.nn.functional as F

import zero
from zero.estimate import estimate_memory
from zero.estimate.__main__ import main as cli
from zero.partition.layout import ALIGN
from zero.testing.models import GPT, GPTConfig


def _formula(psi, n, stage, offload, p, persistent=0, grad=None):
    """The ZeRO paper's per-rank bytes (docs/engine.md), written out again for the test."""
    master = 4 if p < 4 or offload != "none" else 0
    grad = grad or (4 if p == 4 else p)  # one micro-batch: the gradient shard is in the communication dtype
    part = psi / n if stage else psi
    return {
        "params": p * psi / n + p * persistent if stage == 3 else p * psi,
        "grads": grad * (psi / n if stage >= 2 else psi),
        "fp32_master": master * part,
        "optimizer_states": 8 * part,
    }


def test_estimates_equal_the_formulas_for_every_stage_and_offload():
    psi, n = 7_000_000_000, 8
    for dtype, p in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        table = estimate_memory(psi, n, dtype=dtype, persistent_params=12_345)
        assert len(table) == 10 and {(r.stage, r.offload) for r in table} == {
            (s, o) for s in range(4) for o in ("none", "optimizer")} | {(3, "param"), (3, "optimizer+param")}
        for row in table:
            want = _formula(psi, n, row.stage, row.offload, p, 12_345 if row.stage == 3 else 0)
            for kind, value in want.items():
                assert getattr(row, kind) == pytest.approx(value, abs=1), (dtype, row.label, kind)
            on_host = (want["fp32_master"] + want["optimizer_states"] if "optimizer" in row.offload else 0)
            on_host += p * psi / n if "param" in row.offload else 0
            assert row.host_bytes == pytest.approx(on_host + row.host_staging, abs=2), row.label
            states = sum(want.values())
            assert row.device_bytes == pytest.approx(states + row.buffers - on_host, abs=2), row.label
            if "optimizer" in row.offload:  # the gradient shard's host copy (+ copy-back tiles in 16 bits)
                assert row.host_staging >= want["grads"] / (1 if row.stage >= 2 else n if row.stage else 1) - 1
    mixed = estimate_memory(psi, n, stage=2, offload="none")
    assert mixed[0].model_states_total == pytest.approx(2 * psi + 14 * psi / n, abs=1)  # docs/engine.md
    for config in ({"gradient_accumulation_steps": 4}, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2},
                   {"communication_data_type": "fp32"}):  # fp32 gradient shards in bf16 training
        row = estimate_memory(psi, n, stage=2, offload="none", config=config)[0]
        assert row.grads == pytest.approx(4 * psi / n, abs=1), config
    assert "stage 3 + offload optimizer+param" in str(estimate_memory(psi, n, stage=3))
    big = estimate_memory(psi, n, stage=3, offload="none", largest_layer=200_000_000)[0]
    small = estimate_memory(psi, n, stage=3, offload="none", largest_layer=1_000_000)[0]
    assert big.buffers - small.buffers == pytest.approx((2 + 2 * 2) * 199_000_000, abs=2)  # gather + 2 sends


@pytest.mark.parametrize("kwargs,error,says", [
    (dict(model_or_param_count=-5), ValueError, "positive whole number"),
    (dict(model_or_param_count=1.5), ValueError, "positive whole number"),
    (dict(model_or_param_count="7B"), TypeError, "a model or a parameter count"),
    (dict(model_or_param_count=100, stage=4), ValueError, "stage must be 0, 1, 2 or 3"),
    (dict(model_or_param_count=100, world_size=0), ValueError, "world_size must be a positive integer"),
    (dict(model_or_param_count=100, offload="nvme"), ValueError, "offload must be one of"),
    (dict(model_or_param_count=100, stage=2, offload="optimizer+param"), ValueError, "needs stage 3"),
    (dict(model_or_param_count=100, largest_layer=0), ValueError, "largest_layer"),
    (dict(model_or_param_count=100, dtype="int8"), ValueError, "dtype must be one of"),
    (dict(model_or_param_count=100, config={"zero_optimization": {"reduce_bucket_size": -1}}), ValueError,
     "reduce_bucket_size"),
])
def test_bad_arguments_are_clear_errors(kwargs, error, says):
    with pytest.raises(error, match=says):
        estimate_memory(**kwargs)


def test_the_command_line(capsys):
    assert cli(["--params", "7e9", "--gpus", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 trainable parameters" in out and "16 rank(s)" in out and "host/node (8 ranks)" in out
    for argv, says in ((["--params", "7e9", "--gpus", "0"], "--gpus must be at least 1"),
                       (["--params", "-1"], "positive whole number"),
                       (["--params", "1e6", "--stage", "4"], "invalid choice")):
        with pytest.raises(SystemExit):
            cli(argv)
        assert says in capsys.readouterr().err


def run_and_measure(stage: int, offload: str, dtype: str, extra: dict | None = None, tie: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_embd=48, tie_weights=tie))
    opt_off = offload in ("optimizer", "optimizer+param")
    param_off = offload in ("param", "optimizer+param")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                    "stage3_module_granularity_threshold": 10_000,
                                    "stage3_param_persistence_threshold": 200, "stage3_max_live_parameters": 30_000,
                                    "offload_optimizer": {"device": "cpu" if opt_off else "none"},
                                    "offload_param": {"device": "cpu" if param_off else "none"}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    config.update(extra or {})
    estimate = estimate_memory(model, 2, stage=stage, offload=offload, dtype=dtype, config=config)[0]
    engine, *_ = zero.initialize(model=model, config=config)
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(engine.comm.rank))
    for _ in range(2 * engine.gradient_accumulation_steps()):
        logits = engine(x)
        engine.backward(F.cross_entropy(logits.float().flatten(0, 1), x.flatten()))
        engine.step()
    storage = engine.optimizer.storage
    pieces = len(storage.units) if hasattr(storage, "units") else len(storage.layout.buckets)
    return estimate, engine.memory_report(), pieces


def test_estimates_equal_memory_report_of_real_runs_within_padding(dist_run):
    cases = [(s, o, d, None, False) for s in (0, 1, 2, 3) for o in ("none", "optimizer") for d in ("fp32", "bf16")]
    cases += [(3, "optimizer+param", "bf16", None, False), (3, "param", "fp32", None, False),
              (2, "none", "bf16", {"gradient_accumulation_steps": 2}, False),  # fp32 gradient shards
              (1, "optimizer", "bf16", {"train_batch_size": 8}, False),  # accumulation 2 from the batch sizes
              (2, "none", "bf16", {"communication_data_type": "fp32"}, False),
              (3, "none", "fp16", None, True), (2, "optimizer", "fp16", None, True)]  # tied embedding and head
    for stage, offload, dtype, extra, tie in cases:
        for estimate, measured, pieces in dist_run(2, run_and_measure, stage, offload, dtype, extra, tie):
            slack = 2 * ALIGN * 4 * (pieces + 1)  # each bucket/unit pads to 2 x ALIGN elements, <= 4 bytes each
            where = (stage, offload, dtype, extra, tie)
            for kind in ("params", "grads", "fp32_master", "optimizer_states", "host_staging"):
                assert abs(getattr(estimate, kind) - measured[kind]) <= 2 * slack, (where, kind, getattr(estimate, kind),
                                                                                    measured[kind])
            assert abs(estimate.host_bytes - measured["host_bytes"]) <= 4 * slack, (where, estimate, measured)
            peak = (measured["reduce_buffers_peak"] + measured.get("gathered_peak", 0)
                    + measured.get("gather_buffers_peak", 0))
            assert peak <= estimate.buffers + slack, (where, peak, estimate.buffers)
            assert measured["device_bytes"] <= estimate.device_bytes + 4 * slack, (where, estimate, measured)

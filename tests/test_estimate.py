"""zero.estimate_memory against the formulas and against memory_report() of real runs."""
import pytest
import torch
import torch.nn.functional as F

import zero
from zero.estimate import estimate_memory
from zero.estimate.__main__ import main as cli
from zero.partition.layout import ALIGN
from zero.testing.models import GPT, GPTConfig


def _formula(psi, n, stage, offload, p, persistent=0):
    """The ZeRO paper's per-rank bytes (docs/engine.md), written out again for the test."""
    master = 4 if p < 4 or offload != "none" else 0
    grad = 4 if p == 4 else p  # one micro-batch: the gradient shard is in the training dtype
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
        assert len(table) == 9 and {(r.stage, r.offload) for r in table} == {
            (s, o) for s in range(4) for o in ("none", "optimizer")} | {(3, "optimizer+param")}
        for row in table:
            want = _formula(psi, n, row.stage, row.offload, p, 12_345 if row.stage == 3 else 0)
            for kind, value in want.items():
                assert getattr(row, kind) == pytest.approx(value, abs=1), (dtype, row.label, kind)
            on_host = (row.fp32_master + row.optimizer_states if row.offload != "none" else 0) + row.host_staging
            on_host += p * psi // n if row.offload == "optimizer+param" else 0
            assert row.host_bytes == pytest.approx(on_host, abs=2), row.label
            assert row.device_bytes == pytest.approx(row.model_states_total + row.buffers + row.host_staging - on_host,
                                                     abs=2), row.label
    mixed = estimate_memory(psi, n, stage=2, offload="none")
    assert mixed[0].model_states_total == pytest.approx(2 * psi + 14 * psi / n, abs=1)  # docs/engine.md
    assert "stage 3 + offload optimizer+param" in str(estimate_memory(psi, n, stage=3))


@pytest.mark.parametrize("kwargs,error,says", [
    (dict(model_or_param_count=-5), ValueError, "positive whole number"),
    (dict(model_or_param_count=1.5), ValueError, "positive whole number"),
    (dict(model_or_param_count="7B"), TypeError, "a model or a parameter count"),
    (dict(model_or_param_count=100, stage=4), ValueError, "stage must be 0, 1, 2 or 3"),
    (dict(model_or_param_count=100, world_size=0), ValueError, "world_size must be a positive integer"),
    (dict(model_or_param_count=100, offload="nvme"), ValueError, "offload must be one of"),
    (dict(model_or_param_count=100, stage=2, offload="optimizer+param"), ValueError, "needs stage 3"),
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


def run_and_measure(stage: int, offload: str, dtype: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_embd=48, tie_weights=False))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                    "stage3_module_granularity_threshold": 10_000,
                                    "stage3_param_persistence_threshold": 200, "stage3_max_live_parameters": 30_000,
                                    "offload_optimizer": {"device": "cpu" if offload != "none" else "none"},
                                    "offload_param": {"device": "cpu" if offload == "optimizer+param" else "none"}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    estimate = estimate_memory(model, 2, stage=stage, offload=offload, dtype=dtype, config=config)[0]
    engine, *_ = zero.initialize(model=model, config=config)
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(engine.comm.rank))
    for _ in range(2):
        logits = engine(x)
        engine.backward(F.cross_entropy(logits.float().flatten(0, 1), x.flatten()))
        engine.step()
    pieces = len(getattr(engine.optimizer, "units", [])) + len(getattr(getattr(engine.optimizer, "layout", None),
                                                                       "buckets", []))
    return estimate, engine.memory_report(), pieces


def test_estimates_equal_memory_report_of_real_runs_within_padding(dist_run):
    cases = [(s, o, d) for s in (0, 1, 2, 3) for o in ("none", "optimizer") for d in ("fp32", "bf16")]
    cases += [(3, "optimizer+param", "bf16")]
    for stage, offload, dtype in cases:
        for estimate, measured, pieces in dist_run(2, run_and_measure, stage, offload, dtype):
            slack = 2 * ALIGN * 4 * (pieces + 1)  # each bucket/unit pads to 2 x ALIGN elements, <= 4 bytes each
            where = (stage, offload, dtype)
            for kind in ("params", "grads", "fp32_master", "optimizer_states", "host_staging"):
                assert abs(getattr(estimate, kind) - measured[kind]) <= 2 * slack, (where, kind, getattr(estimate, kind),
                                                                                    measured[kind])
            assert abs(estimate.host_bytes - measured["host_bytes"]) <= 4 * slack, (where, estimate, measured)
            peak = measured["reduce_buffers_peak"] + measured.get("gathered_peak", 0)
            assert peak <= estimate.buffers + slack, (where, peak, estimate.buffers)


def test_the_command_line_reads_a_huggingface_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="--model needs transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    config.save_pretrained(tmp_path)
    expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    assert cli(["--model", str(tmp_path), "--gpus", "2", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{expected:,} trainable parameters" in out and "stage 3 + offload optimizer+param" in out
    assert "kept whole under stage 3" in out  # the model's small parameters were planned as persistent

"""Ranks that disagree end in an error that names the difference, on every rank, within a bound,
and every process then exits within a bound: at initialize (different models or configs, checked
with one digest exchange) and at run time (a skipped backward, an extra step, a stalled rank, an
extra forward, a save or GatheredParameters on one rank only), on every stage."""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.testing.dist import run_once


def _net(extra: bool = False, wide: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8 if not wide else 12), nn.Tanh()]
    layers.append(nn.Linear(8 if not wide else 12, 4))
    if extra:
        layers.append(nn.Linear(4, 4))
    return nn.Sequential(*layers)


def _config(stage: int, **extra) -> dict:
    zc = {"stage": stage, **extra.pop("zero", {})}
    if stage == 3:
        zc.setdefault("stage3_param_persistence_threshold", 0)
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": zc, **extra}


INIT_CASES = {
    # case: (what rank 1 does differently, a phrase the error must contain)
    "extra layer, stage 2": (dict(extra=True), "rank 1: parameter '5.weight': shape (4, 4)"),
    "extra layer, stage 3": (dict(extra=True, stage=3), "rank 0: nothing (fewer parameters)"),
    "other shapes, same count": (dict(wide=True), "rank 0: parameter '2.weight': shape (8, 16)"),
    "stage 2 and stage 3": (dict(rank1_stage=3), "rank 0: config zero_optimization.stage = 2; rank 1: config "
                                                  "zero_optimization.stage = 3"),
    "bucket sizes": (dict(config=dict(zero={"reduce_bucket_size": 100})), "zero_optimization.reduce_bucket_size = 100"),
    "accumulation steps": (dict(config=dict(gradient_accumulation_steps=2)), "config train_batch_size = 8; rank 1: "
                                                                              "config train_batch_size = 16"),
    "bf16 on one rank": (dict(config=dict(bf16={"enabled": True})), "rank 1: config bf16.enabled = True"),
    "micro batch sizes": (dict(config=dict(train_micro_batch_size_per_gpu=8)), "rank 1: config train_batch_size = 16"),
}


def initialize_differently(case: str):
    rank = dist.get_rank()
    change, _ = INIT_CASES[case]
    stage = change.get("rank1_stage", change.get("stage", 2)) if rank == 1 else change.get("stage", 2)
    net = _net(extra=rank == 1 and change.get("extra", False), wide=rank == 1 and change.get("wide", False))
    cfg = _config(stage, **(dict(change.get("config", {})) if rank == 1 else {}))
    try:
        zero.initialize(model=net, config=cfg)
        return "no error"
    except zero.RankDivergenceError as exc:
        return str(exc)


def test_ranks_that_build_different_models_or_configs_fail_at_initialize_naming_the_difference(dist_run):
    for case, (_, phrase) in INIT_CASES.items():
        messages = dist_run(2, initialize_differently, case, timeout=60)
        for message in messages:
            assert message.startswith("zero.initialize: the ranks built different models or configs. First "
                                      "difference: rank 0: "), (case, message)
            assert "; rank 1: " in message and phrase in message, (case, message)
        assert messages[0] == messages[1], case
    # nothing was left in flight: the same ranks train normally afterwards
    assert dist_run(2, train_a_little, 2) == [True, True]


def train_a_little(stage: int) -> bool:
    engine, *_ = zero.initialize(model=_net(), config=_config(stage))
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
    return engine.global_steps == 1


def diverge(stage: int, how: str):
    """Rank 1 does something rank 0 does not, at the second step."""
    rank = dist.get_rank()
    net = _net()
    engine, *_ = zero.initialize(model=net, config=_config(stage, zero={"stage3_param_persistence_threshold": 0}
                                                           if stage == 3 else {}))
    g = torch.Generator().manual_seed(rank)
    start = time.monotonic()
    try:
        for step in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            if step == 1 and how == "checkpoint on one rank, 16-bit model on the other":
                start = time.monotonic()
                if rank == 0:
                    engine.save_checkpoint(os.environ["ZERO_TEST_DIR"], tag="one")
                else:
                    engine.save_16bit_model(os.environ["ZERO_TEST_DIR"], "model.bin")
            if step == 1 and rank == 1:
                if how == "skip backward":
                    engine.step()
                    continue
                if how == "extra step":
                    engine.step()
                if how == "stall":
                    time.sleep(8)  # alive but late: the peer gives up at ZERO_COLLECTIVE_TIMEOUT
                if how == "extra forward":
                    with torch.no_grad():
                        engine(x)
                if how == "save on one rank":
                    engine.save_16bit_model(os.environ["ZERO_TEST_DIR"], "model.bin")
                if how == "GatheredParameters on one rank":
                    with zero.GatheredParameters(list(net.parameters())):
                        pass
            start = time.monotonic()
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"


RUNTIME_CASES = [
    (1, "skip backward"), (2, "skip backward"), (3, "skip backward"),
    (2, "extra step"), (3, "extra step"),
    (2, "stall"), (3, "extra forward"),
    (2, "save on one rank"), (3, "GatheredParameters on one rank"), (2, "checkpoint on one rank, 16-bit model on the other"),
]


@pytest.mark.parametrize("stage,how", RUNTIME_CASES, ids=[f"stage{s}-{h.replace(' ', '-')}" for s, h in RUNTIME_CASES])
def test_ranks_that_diverge_at_run_time_raise_and_exit_within_a_bound(stage, how, tmp_path):
    results, exit_s = run_once(2, diverge, stage, how, env={"ZERO_COLLECTIVE_TIMEOUT": "4",
                                                             "ZERO_TEST_DIR": str(tmp_path)}, timeout=90)
    for message in results:
        kind, _, rest = message.partition(" after ")
        seconds = float(rest.split(" s:")[0]) if rest else None
        if how == "stall":
            assert kind == "CollectiveTimeout", message
            assert "did not complete within 4 s" in message or "another rank stopped" in message, message
        else:
            assert kind == "RankDivergenceError", message
            assert "rank 0: " in message and "rank 1: " in message, message
            assert seconds is not None and seconds < 3, message  # at once, not at the timeout
    if how == "stall":
        assert "within 4 s" in results[0] and float(results[0].split(" after ")[1].split(" s:")[0]) < 7, results[0]
    if how == "skip backward":
        assert "optimizer step 2 after 0 backward pass(es)" in results[1], results[1]
    if how.startswith("checkpoint"):  # each save named as itself
        assert "rank 0: save_checkpoint (tag checksum" in results[0] and "rank 1: saving the 16-bit model" in results[0]
    assert max(exit_s) < 10, (exit_s, results)  # not the process group's 1800 s


def config_error_on_rank_one():
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        zero.initialize(model=_net(), config=_config(2 if rank == 0 else 9))
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"


def test_a_rank_that_fails_inside_initialize_does_not_leave_the_others_waiting():
    results, exit_s = run_once(2, config_error_on_rank_one, env={"ZERO_COLLECTIVE_TIMEOUT": "3"}, timeout=60)
    assert results[1].startswith("ConfigError") and "zero_optimization.stage" in results[1], results[1]
    # rank 0 learns it at its first collective (the ranks saying their nodes), bounded, naming the cause
    assert results[0].startswith("CollectiveTimeout") and any(
        said in results[0] for said in ("did not all arrive within 3 s", "another rank stopped or crashed")), results[0]
    assert float(results[0].split(" after ")[1].split(" s:")[0]) < 6, results[0]
    assert max(exit_s) < 10, exit_s


def two_engines_diverge():
    """A GAN-like job: two engines in one process; rank 1 runs the other engine's backward."""
    rank = dist.get_rank()
    gen, disc = _net(), _net()
    g_engine, *_ = zero.initialize(model=gen, config=_config(2))
    d_engine, *_ = zero.initialize(model=disc, config=_config(2))
    x = torch.randn(4, 8)
    for engine in (g_engine, d_engine):  # one normal round
        engine.backward(engine(x).square().mean())
        engine.step()
    engine = g_engine if rank == 0 else d_engine
    try:
        engine.backward(engine(x).square().mean())
        engine.step()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"


def test_two_engines_in_one_process_are_told_apart():
    results, exit_s = run_once(2, two_engines_diverge, env={"ZERO_COLLECTIVE_TIMEOUT": "4"}, timeout=60)
    for message in results:
        assert message.startswith("RankDivergenceError"), message
        assert ("rank 0: gradient reduction of bucket 0 (320 elements) of engine 1; rank 1: gradient reduction of "
                "bucket 0 (320 elements) of engine 2") in message, message
    assert max(exit_s) < 10, exit_s


def save_fails_on_rank_zero(path: str):
    engine, *_ = zero.initialize(model=_net(), config=_config(2))
    try:
        engine.save_16bit_model(path, "model.bin")  # `path` is a file: rank 0 cannot make the directory
        outcome = "saved"
    except (OSError, RuntimeError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    engine.backward(engine(torch.randn(4, 8)).square().mean())  # and training goes on
    engine.step()
    return outcome, engine.global_steps


def test_a_save_that_fails_on_rank_zero_raises_on_every_rank_and_training_goes_on(dist_run, tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    (rank0, steps0), (rank1, steps1) = dist_run(2, save_fails_on_rank_zero, str(blocker), timeout=60)
    assert "not_a_directory" in rank0 and not rank0.startswith("RuntimeError: save_16bit_model"), rank0
    assert rank1.startswith("RuntimeError: save_16bit_model: rank 0 could not write"), rank1
    assert steps0 == steps1 == 1

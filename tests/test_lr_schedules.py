"""zero.lr_schedules reproduces DeepSpeed's learning-rate schedules number for number.

Expected values come from DeepSpeed's documented formulas, written out again here in terms of
k = how many times step() has been called (DeepSpeed's batch index is k - 1), plus a few values
worked out by hand.
"""

import logging
import math

import pytest
import torch

from zero.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    valid_scheduler_names,
)

STEPS = 30


def sgd(lr=0.5, groups=1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=lr)


def adam(lr=0.5):
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.9, 0.999))


def run(scheduler, optimizer, steps=STEPS, group=0):
    """lr in the optimizer after construction, then after each of `steps` step() calls."""
    seen = [optimizer.param_groups[group]["lr"]]
    for _ in range(steps):
        optimizer.step()  # no gradients: a no-op that keeps torch's call-order check quiet
        scheduler.step()
        seen.append(optimizer.param_groups[group]["lr"])
    return seen


# --- independent statements of DeepSpeed's formulas, indexed by k = number of step() calls ----


def warmup_progress(k, warmup_steps, kind):
    """Fraction of warmup done after k steps (batch k - 1); warmup lasts max(2, n) batches."""
    n = max(2, warmup_steps)
    batch = k - 1
    if batch >= n:
        return 1.0
    return math.log(k) / math.log(n) if kind == "log" else batch / n


def expected_warmup(k, lo, hi, n, kind):
    return lo if k == 0 else lo + (hi - lo) * warmup_progress(k, n, kind)


def expected_warmup_decay(k, lo, hi, n, total, kind):
    n_eff = max(2, n)
    batch = k - 1
    if k == 0:
        return lo
    if batch < n_eff:
        return lo + (hi - lo) * warmup_progress(k, n, kind)
    frac = max(0.0, (total - batch) / max(1, total - n_eff))
    return lo + (hi - lo) * frac


def expected_cosine(k, peak, total, n, min_ratio, floor, kind):
    n_eff = max(2, n)
    batch = k - 1
    if k == 0:
        return 0.0
    if batch < n_eff:
        return peak * (min_ratio + (1 - min_ratio) * warmup_progress(k, n, kind))
    t = min(1.0, (batch - n_eff + 1) / max(1, total - n_eff))
    return peak * max(0.0, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def triangle(k, up, down):
    """Cycle height in [0, 1] at position k of a cycle of length up + down (periodic)."""
    pos = k % (up + down)
    return pos / up if pos <= up else (up + down - pos) / down


def expected_one_cycle_lr(k, lo, hi, up, down, decay_rate=0.0, decay_size=0):
    if k == 0:
        return lo
    batch = k - 1
    if batch < up + down:
        return lo + (hi - lo) * triangle(k, up, down)
    if decay_size == 0 or decay_rate == 0:
        return lo
    return lo / (1 + decay_rate * (batch - (up + down) + 1) / decay_size)


# --- WarmupLR ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_follows_formula_for_both_warmup_types(kind):
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=kind)
    got = run(sched, opt)
    want = [expected_warmup(k, 0.01, 0.1, 10, kind) for k in range(STEPS + 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert sched.get_last_lr() == [got[-1]]


def test_warmup_lr_hand_checked_values():
    opt = sgd()
    log = run(WarmupLR(opt, 0.0, 0.1, 10, "log"), opt, steps=12)
    # before any step and at the first step (batch 0, log(1) = 0): the minimum
    assert log[0] == 0.0 and log[1] == 0.0
    assert log[2] == pytest.approx(0.1 * 0.30102999566)  # 0.1 * log(2) / log(10)
    assert log[10] == pytest.approx(0.1)  # batch 9: log(10) / log(10) reaches the top
    assert log[11] == log[12] == 0.1

    opt = sgd()
    lin = run(WarmupLR(opt, 0.0, 0.1, 10, "linear"), opt, steps=12)
    assert lin[1] == 0.0
    assert lin[2] == pytest.approx(0.01)
    assert lin[10] == pytest.approx(0.09)  # linear stops one step short of the top...
    assert lin[11] == 0.1  # ...and jumps there at batch 10


def test_warmup_lr_defaults_to_each_groups_lr_and_one_step_acts_as_two():
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.4}], lr=1.0)
    sched = WarmupLR(opt, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    sched.step(), sched.step()
    assert sched.get_last_lr() == [pytest.approx(0.1), pytest.approx(0.2)]  # 1/2 of the way
    sched.step()
    assert sched.get_last_lr() == [0.2, 0.4]


# --- WarmupDecayLR ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_follows_formula_for_both_warmup_types(kind):
    opt = sgd()
    sched = WarmupDecayLR(opt, total_num_steps=25, warmup_min_lr=0.0, warmup_max_lr=0.1,
                          warmup_num_steps=10, warmup_type=kind)
    got = run(sched, opt)
    want = [expected_warmup_decay(k, 0.0, 0.1, 10, 25, kind) for k in range(STEPS + 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_warmup_decay_lr_hand_checked_values():
    opt = sgd()
    got = run(WarmupDecayLR(opt, 20, 0.0, 0.1, 10, "linear"), opt, steps=26)
    assert got[11] == pytest.approx(0.1)  # batch 10: (20 - 10) / (20 - 10)
    assert got[16] == pytest.approx(0.05)  # batch 15: (20 - 15) / 10
    assert got[21] == 0.0 and got[26] == 0.0  # batch 20 and beyond: clamped at the minimum
    assert isinstance(WarmupDecayLR(sgd(), 2000), WarmupLR)


# --- WarmupCosineLR ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_follows_formula_for_both_warmup_types(kind):
    opt = sgd(lr=0.1)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_min_ratio=0.05, warmup_num_steps=8,
                           cos_min_ratio=0.01, warmup_type=kind)
    got = run(sched, opt)
    want = [expected_cosine(k, 0.1, 20, 8, 0.05, 0.01, kind) for k in range(STEPS + 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_warmup_cosine_lr_hand_checked_values():
    opt = sgd(lr=0.1)
    got = run(WarmupCosineLR(opt, 20, 0.0, 10, 0.0001, "linear"), opt, steps=25)
    assert got[0] == 0.0  # before the first step the optimizer holds 0
    assert got[1] == 0.0 and got[6] == pytest.approx(0.05)
    # batch 10: progress 1/10, (1 + cos(0.1 pi)) / 2 = 0.9755283, ratio 0.0001 + 0.9999 * that
    assert got[11] == pytest.approx(0.1 * 0.9755308, rel=1e-6)
    assert got[15] == pytest.approx(0.1 * 0.50005)  # batch 14: halfway down the cosine
    assert got[20] == pytest.approx(1e-5) and got[25] == pytest.approx(1e-5)  # stays on the floor


# --- OneCycle ---------------------------------------------------------------------------------


def test_one_cycle_lr_and_betas_follow_formula_then_decay():
    opt = adam()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5,
                     cycle_first_step_size=6, cycle_second_step_size=4, decay_step_size=2,
                     cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.01)
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)  # set at construction, as DeepSpeed does
    lrs, betas = [opt.param_groups[0]["lr"]], []
    for _ in range(STEPS):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(opt.param_groups[0]["betas"])
    want = [expected_one_cycle_lr(k, 0.01, 0.1, 6, 4, 0.5, 2) for k in range(STEPS + 1)]
    assert lrs == pytest.approx(want, rel=1e-12)
    for k, (beta1, beta2) in enumerate(betas, start=1):
        assert beta2 == 0.99
        if k - 1 < 10:
            assert beta1 == pytest.approx(0.95 - 0.1 * triangle(k, 6, 4))
        else:
            assert beta1 == pytest.approx(0.95 * (1 + 0.01 * (k - 10) / 2))


def test_one_cycle_hand_checked_values_and_staircase():
    opt = adam()
    got = run(OneCycle(opt, 0.01, 0.1, cycle_first_step_size=5), opt, steps=14)
    assert got[0] == 0.01
    assert got[1] == pytest.approx(0.028)  # position 1 of 5 up: 0.01 + 0.09 * 0.2
    assert got[5] == pytest.approx(0.1) and got[10] == pytest.approx(0.01)
    assert got[14] == 0.01  # no decay configured: stays at the minimum
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)

    opt = adam()
    stairs = run(OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2), opt, steps=8)
    assert stairs[1:] == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


def test_one_cycle_leaves_optimizers_without_betas_alone(caplog):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="zero.lr_schedules"):
        sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=5)
    assert "cycle_momentum is off" in caplog.text
    sched.step()
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9
    assert sched.get_mom() is None


def test_one_cycle_get_last_lr_needs_a_step():
    sched = OneCycle(adam(), 0.01, 0.1)
    with pytest.raises(RuntimeError, match="call step"):
        sched.get_last_lr()


# --- LRRangeTest ------------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_follows_formula(staircase):
    opt = sgd()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=7,
                        lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase)
    got = run(sched, opt)
    interval = [k / 7 for k in range(STEPS + 1)]
    if staircase:
        interval = [math.floor(i) for i in interval]
    assert got == pytest.approx([0.01 * (1 + 2.0 * i) for i in interval], rel=1e-12)


def test_lr_range_test_hand_checked_values():
    opt = sgd()
    got = run(LRRangeTest(opt, 0.01, 10, 1.0), opt, steps=10)
    assert got[0] == 0.01 and got[1] == pytest.approx(0.011) and got[10] == pytest.approx(0.02)
    opt = sgd()
    got = run(LRRangeTest(opt, 0.01, 10, 1.0, lr_range_test_staircase=True), opt, steps=10)
    assert got[9] == 0.01 and got[10] == pytest.approx(0.02)


# --- shared behaviour -------------------------------------------------------------------------

FACTORIES = {
    "WarmupLR": lambda o, **kw: WarmupLR(o, 0.0, 0.1, 8, "log", **kw),
    "WarmupDecayLR": lambda o, **kw: WarmupDecayLR(o, 20, 0.0, 0.1, 8, "linear", **kw),
    "WarmupCosineLR": lambda o, **kw: WarmupCosineLR(o, 20, 0.1, 8, 0.01, "log", **kw),
    "OneCycle": lambda o, **kw: OneCycle(o, 0.01, 0.1, 0.3, 6, 4, decay_step_size=3, **kw),
    "LRRangeTest": lambda o, **kw: LRRangeTest(o, 0.01, 5, 1.5, **kw),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip_resumes_the_same_sequence(name):
    opt = adam()
    full = run(FACTORIES[name](opt), opt)

    opt = adam()
    first = FACTORIES[name](opt)
    for _ in range(12):
        first.step()
    saved = first.state_dict()
    assert saved == {"last_batch_iteration": 11}

    # a fresh optimizer and a scheduler resumed from the checkpoint continue where it stopped
    opt2 = adam()
    resumed = FACTORIES[name](opt2)
    resumed.load_state_dict(saved)
    assert run(resumed, opt2, steps=STEPS - 12)[1:] == full[13:]

    # building with last_batch_iteration leaves the optimizer alone until the first step
    opt3 = adam()
    by_arg = FACTORIES[name](opt3, last_batch_iteration=11)
    assert opt3.param_groups[0]["lr"] == 0.5  # every schedule here would write something else
    assert run(by_arg, opt3, steps=STEPS - 12)[1:] == full[13:]


@pytest.mark.parametrize("name", list(FACTORIES))
def test_step_with_an_explicit_index_jumps_there(name):
    opt = adam()
    full = run(FACTORIES[name](opt), opt)
    opt = adam()
    sched = FACTORIES[name](opt)
    sched.step(16)
    assert opt.param_groups[0]["lr"] == full[17] and sched.last_batch_iteration == 16


def test_every_param_group_is_scheduled():
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}], lr=1.0)
    warm = WarmupLR(opt, [0.0, 0.01], [0.1, 0.2], 5, "linear")
    seqs = [[], []]
    for _ in range(8):
        warm.step()
        for g in range(2):
            seqs[g].append(opt.param_groups[g]["lr"])
    for g, (lo, hi) in enumerate([(0.0, 0.1), (0.01, 0.2)]):
        assert seqs[g] == pytest.approx([expected_warmup(k, lo, hi, 5, "linear") for k in range(1, 9)])

    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}], lr=1.0)
    cos = WarmupCosineLR(opt, 20, 0.0, 4, 0.01, "linear")
    for _ in range(10):
        cos.step()
    ratio = cos.get_lr_ratio()
    assert cos.get_last_lr() == pytest.approx([0.1 * ratio, 0.3 * ratio])

    rng = LRRangeTest(sgd(groups=2), [0.01, 0.02], 10)
    rng.step()
    assert rng.get_last_lr() == pytest.approx([0.011, 0.022])


def test_tensor_lr_is_updated_in_place():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, 0.0, 0.1, 10, "linear")
    sched.step(), sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.01)
    assert sched.get_last_lr() == [pytest.approx(0.01)]


# --- build_scheduler --------------------------------------------------------------------------


def test_build_scheduler_with_a_deepspeed_name_matches_direct_construction():
    opt_a, opt_b = sgd(), sgd()
    built = build_scheduler("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 0.1,
                                              "warmup_num_steps": 5}, opt_a)
    direct = WarmupDecayLR(opt_b, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=5)
    assert isinstance(built, WarmupDecayLR)
    assert run(built, opt_a) == run(direct, opt_b)


def test_build_scheduler_with_torch_names_matches_torch():
    opt_a, opt_b = sgd(), sgd()
    built = build_scheduler("StepLR", {"step_size": 3, "gamma": 0.5}, opt_a)
    direct = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
    assert type(built) is torch.optim.lr_scheduler.StepLR
    assert run(built, opt_a) == run(direct, opt_b)

    opt = sgd()
    cos = build_scheduler("CosineAnnealingLR", {"T_max": 10, "eta_min": 0.01}, opt)
    assert isinstance(cos, torch.optim.lr_scheduler.CosineAnnealingLR) and cos.T_max == 10
    assert isinstance(build_scheduler("MultiStepLR", {"milestones": [2, 4]}, sgd()),
                      torch.optim.lr_scheduler.MultiStepLR)
    names = valid_scheduler_names()
    assert names[:5] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert "StepLR" in names and "LambdaLR" not in names and "LRScheduler" not in names


def test_build_scheduler_rejects_schedulers_that_need_python_objects():
    with pytest.raises(ValueError, match="LambdaLR.*cannot be built from a config.*function"):
        build_scheduler("LambdaLR", {"lr_lambda": "x"}, sgd())
    with pytest.raises(ValueError, match="SequentialLR"):
        build_scheduler("SequentialLR", {}, sgd())


def test_build_scheduler_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError) as err:
        build_scheduler("WarmupCosine", {}, sgd())
    msg = str(err.value)
    assert "'WarmupCosine'" in msg and "Did you mean 'WarmupCosineLR'" in msg and "StepLR" in msg


@pytest.mark.parametrize("type_name, params, pattern", [
    ("WarmupLR", {"warmup_max_lrr": 0.1}, r"WarmupLR has no parameter 'warmup_max_lrr'; did you mean 'warmup_max_lr'"),
    ("StepLR", {"step_size": 2, "gama": 0.5}, r"StepLR has no parameter 'gama'; did you mean 'gamma'"),
    ("WarmupLR", {"warmup_num_steps": "100"}, r"WarmupLR: parameter 'warmup_num_steps' must be int"),
    ("WarmupLR", {"warmup_num_steps": 10.0}, r"WarmupLR: parameter 'warmup_num_steps' must be int"),
    ("StepLR", {"step_size": 2, "gamma": "0.5"}, r"StepLR: parameter 'gamma' must be float"),
    ("WarmupLR", {"warmup_num_steps": -5}, r"WarmupLR: warmup_num_steps must be positive, got -5"),
    ("WarmupLR", {"warmup_type": "cosine"}, r"WarmupLR: parameter 'warmup_type'|warmup_type must be"),
    ("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 100},
     r"WarmupDecayLR: total_num_steps \(50\) is less than warmup_num_steps \(100\)"),
    ("WarmupDecayLR", {"warmup_num_steps": 10}, r"WarmupDecayLR: missing required parameter.*total_num_steps"),
    ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, r"WarmupLR: warmup_max_lr has 2 values but the optimizer has 1"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
     r"OneCycle: cycle_first_step_size must be positive"),
    ("LRRangeTest", {"lr_range_test_step_size": -1}, r"LRRangeTest: lr_range_test_step_size must be positive"),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": None}, r"WarmupCosineLR: parameter 'cos_min_ratio'"),
    ("WarmupLR", {"optimizer": 1}, r"WarmupLR: 'optimizer' cannot be set in params"),
])
def test_build_scheduler_bad_params_raise_before_the_lr_is_touched(type_name, params, pattern):
    opt = adam(lr=0.5)
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    with pytest.raises(ValueError, match=pattern):
        build_scheduler(type_name, params, opt)
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == before


def test_direct_construction_checks_values_too():
    opt = sgd(lr=0.5)
    with pytest.raises(ValueError, match="WarmupLR: warmup_num_steps must be positive"):
        WarmupLR(opt, warmup_num_steps=0)
    with pytest.raises(ValueError, match="WarmupLR: warmup_type must be 'log' or 'linear'"):
        WarmupLR(opt, warmup_type="exp")
    with pytest.raises(ValueError, match="WarmupDecayLR: total_num_steps"):
        WarmupDecayLR(opt, total_num_steps=5, warmup_num_steps=10)
    with pytest.raises(TypeError, match="WarmupLR: optimizer must be a torch.optim.Optimizer"):
        WarmupLR(object())
    assert opt.param_groups[0]["lr"] == 0.5


def test_failed_torch_construction_leaves_param_groups_as_they_were():
    opt = sgd(lr=0.5)
    with pytest.raises(ValueError, match="ConstantLR: invalid params"):
        build_scheduler("ConstantLR", {"factor": 5.0}, opt)  # torch requires factor in [0, 1]
    assert opt.param_groups[0]["lr"] == 0.5 and "initial_lr" not in opt.param_groups[0]

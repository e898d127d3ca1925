"""zero.estimate_memory against the formulas and against memory_report() of real runs."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import zero
from zero.config import ConfigWarning, load_config
from zero.estimate import estimate_memory, format_bytes
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
    qwz = estimate_memory(psi, n, stage=3, offload="none", largest_layer=1_000_000,
                          config={"zero_optimization": {"zero_quantized_weights": True}})[0]
    flight = 1_000_000 + 50_000_000  # the unit waited for, and stage3_prefetch_bucket_size ahead
    # qwZ's int8 messages (a scale per 256) from the 8 ranks and its own, for the gathers in flight
    assert qwz.buffers - small.buffers == pytest.approx(flight * (1 + 4 / 256) * (n + 1) / n, rel=1e-5)


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
    assert cli(["--params", "7e9", "--gpus", "8", "--stage", "3", "--offload", "none", "--state-formats"]) == 0
    out = capsys.readouterr().out
    assert "every state format" in out and "state format" in out.splitlines()[1]
    assert [line.split("  ")[0] for line in out.splitlines()[3:7]] == ["stage 3", "", "", ""]  # the option once
    for label in ("fp32 master + fp32 moments", "bf16 master + bf16 moments", "fp32 master + 8-bit moments",
                  "bf16 master + 8-bit moments"):
        assert out.count(label) == 1, label
    assert cli(["--params", "7e9", "--master-dtype", "bf16", "--state-dtype", "int8"]) == 0
    assert "bf16, bf16 master + 8-bit moments, 1 rank(s)" in capsys.readouterr().out
    for argv, says in ((["--params", "7e9", "--gpus", "0"], "--gpus must be at least 1"),
                       (["--params", "7e9", "--dtype", "fp16", "--master-dtype", "bf16"], "needs bf16 training"),
                       (["--params", "7e9", "--state-dtype", "int4"], "invalid choice"),
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
    for _ in range(2 * engine.config.gradient_accumulation_steps):
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
    muon = {"optimizer": {"type": "Muon"}}  # one fp32 momentum per matrix, whole on its owner (balanced here)
    cases += [(0, "none", "fp32", muon, True), (1, "none", "bf16", muon, True), (2, "optimizer", "bf16", muon, False),
              (3, "none", "fp32", muon, True), (3, "optimizer+param", "bf16", muon, False)]
    # other optimizers keep the state their rule declares: SGD's momentum (none without), Lion's
    # exp_avg, Adagrad's sum and step
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    cases += [(1, "none", "bf16", sgd, False), (3, "optimizer", "bf16", sgd, False),
              (2, "optimizer", "fp32", {"optimizer": {"type": "Lion", "params": {"lr": 1e-3}}}, False),
              (3, "none", "bf16", {"optimizer": {"type": "Adagrad", "params": {"lr": 1e-2}}}, False),
              (2, "none", "bf16", {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, False)]
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


# ---------------------------------------------------------------------------------------------- state formats

FORMATS = (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8"))  # (master, moments)


def _moment_bytes(state: str, numel: int) -> int:
    """m and v of one optimizer slot as the engine allocates them (8-bit: a byte each and one fp32
    scale per 256-element block of each)."""
    return {"fp32": 8 * numel, "bf16": 4 * numel, "int8": 2 * numel + 2 * 4 * -(-numel // 256)}[state]


def _format_config(stage: int, offload: str, master: str, state: str) -> dict:
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": master == "bf16"}
    params = {}
    if state == "bf16":
        bf16["bf16_optimizer_states"] = True  # DeepSpeed's spelling; the others through zero's key
    else:
        params["state_dtype"] = state
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,  # fp32 master: fp32 gradients
            "bf16": bf16, "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": {"stage": stage, "stage3_module_granularity_threshold": 10_000,
                                  "stage3_param_persistence_threshold": 200,
                                  **({"reduce_bucket_size": 20_000} if stage < 3 else {}),
                                  "offload_optimizer": {"device": "cpu" if "optimizer" in offload else "none"},
                                  "offload_param": {"device": "cpu" if "param" in offload else "none"}}}


def measure_state_formats(world: int, cases, monitored):
    """On each rank, for each (stage, offload, master, state): the estimate, memory_report() after two
    optimizer steps, the optimizer's slot sizes and the state format it reports; for the case
    `monitored`, also the end table (rank 0)."""
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_embd=48))
        config = _format_config(*case)
        estimate = estimate_memory(model, world, stage=case[0], offload=case[1], config=config)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            engine, *_ = zero.initialize(model=model, config=config)
        monitor = zero.TrainingMonitor(engine, steps=2) if case == monitored else None
        x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(engine.comm.rank))
        for _ in range(4):
            engine.backward(F.cross_entropy(engine(x).float().flatten(0, 1), x.flatten()))
            engine.step()
            if monitor is not None:
                monitor.step()
        table = monitor.report() if monitor is not None else None
        fmt = engine.optimizer.precision.adam
        out.append((case, estimate, engine.memory_report(), [s.master.numel() for s in engine.optimizer.slots()],
                    (fmt.master, fmt.state), table))
    return out


def test_state_formats_are_counted_as_the_engine_stores_them(dist_run):
    psi, n = 7_000_000_000, 8
    master_bytes, moment_bytes = {"fp32": 4, "bf16": 2}, {"fp32": 8, "bf16": 4, "int8": 2 + 8 / 256}
    # the formulas: a master in the training dtype, with the optimizer beside the model, is the parameters
    for master, state in FORMATS + (("bf16", "fp32"), ("fp32", "bf16")):
        table = estimate_memory(psi, n, master_dtype=master, state_dtype=state)
        assert len(table) == 10 and table.state_formats == [table[0].state_format]
        for row in table:
            part = psi / n if row.stage else psi
            apart = master == "fp32" or row.offload != "none"
            assert (row.master_dtype, row.state_dtype) == (master, state)
            assert row.fp32_master == pytest.approx(master_bytes[master] * part if apart else 0, abs=1), row.label
            assert row.optimizer_states == pytest.approx(moment_bytes[state] * part, abs=1), row.label
            assert row.params == pytest.approx(2 * psi / n if row.stage == 3 else 2 * psi, abs=1), row.label
            assert row.grads == pytest.approx(2 * (psi / n if row.stage >= 2 else psi), abs=1), row.label
        per_parameter = table.row(3).model_states_total * n / psi  # stage 3, over all ranks
        assert per_parameter == pytest.approx(2 + 2 + (4 if master == "fp32" else 0) + moment_bytes[state],
                                              rel=1e-6), (master, state)
    stage3 = {f: estimate_memory(psi, n, stage=3, offload="none", master_dtype=f[0], state_dtype=f[1])[0]
              for f in FORMATS}
    assert [round(r.model_states_total * n / psi, 2) for r in stage3.values()] == [16, 8, 10.03, 6.03]
    offloaded = estimate_memory(psi, n, stage=3, offload="optimizer", master_dtype="bf16", state_dtype="bf16")[0]
    assert offloaded.fp32_master == pytest.approx(2 * psi / n, abs=1)  # offloaded: a bf16 master of its own
    assert offloaded.host_bytes == pytest.approx((2 + 4) * psi / n + offloaded.host_staging, abs=2)
    # the config's keys (DeepSpeed's and zero's, a dict or an engine's ZeroConfig) give the same rows
    keys = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    assert estimate_memory(psi, n, config=keys) == estimate_memory(psi, n, master_dtype="bf16", state_dtype="bf16")
    int8 = {"optimizer": {"type": "adamw", "params": {"state_dtype": "int8"}}, "train_micro_batch_size_per_gpu": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        loaded = load_config(int8, n)
    assert estimate_memory(psi, n, config=int8) == estimate_memory(psi, n, config=loaded) == \
        estimate_memory(psi, n, state_dtype="int8")
    assert estimate_memory(psi, n, config=int8, state_dtype="fp32") == estimate_memory(psi, n)  # the argument wins
    # every format beside the config's, the config's first
    both = estimate_memory(psi, n, config=int8, stage=3, state_formats=True)
    assert [r.state_format for r in both if r.offload == "none"] == [
        "fp32 master + 8-bit moments", "fp32 master + fp32 moments", "bf16 master + bf16 moments",
        "bf16 master + 8-bit moments"]
    assert len(both) == 16 and both.row(3, "param", "bf16", "int8").fp32_master == pytest.approx(2 * psi / n, abs=1)
    assert both.row(3) is both[0] and "every state format" in str(both) and "state format" in str(both)
    assert {r.state_format for r in estimate_memory(psi, n, dtype="fp16", state_formats=True)} == {
        "fp32 master + fp32 moments", "fp32 master + bf16 moments", "fp32 master + 8-bit moments"}
    for kwargs, says in ((dict(dtype="fp16", master_dtype="bf16"), "needs bf16 training"),
                         (dict(state_dtype="int4"), "state_dtype must be one of"),
                         (dict(master_dtype="fp16"), "master_dtype must be one of"),
                         (dict(config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, state_formats=True),
                          "state formats of zero's Adam/AdamW"),
                         (dict(dtype="fp16", config=keys), "bf16_master_weights_and_grads")):
        with pytest.raises(ValueError, match=says):
            estimate_memory(psi, n, **kwargs)
    # real runs: memory_report() is the formula's bytes of the engine's own slots, and the estimate is
    # memory_report() (exactly on one rank, up to the padding of buckets and units on two)
    cases = [(s, o, m, st) for s in (0, 1, 2, 3) for o in ("none", "optimizer") for m, st in FORMATS]
    cases += [(3, "param", m, st) for m, st in FORMATS]  # offload_param: the master stays apart on the device
    monitored = (2, "optimizer", "bf16", "int8")
    for world in (1, 2):
        results = [r for rank in dist_run(world, measure_state_formats, world, cases, monitored) for r in rank]
        for case, estimate, measured, numels, fmt, _ in results:
            stage, offload, master, state = case
            assert fmt == (master, state) == (estimate.master_dtype, estimate.state_dtype), case
            assert measured["optimizer_states"] == sum(_moment_bytes(state, k) for k in numels), case
            apart = master == "fp32" or offload != "none"
            assert measured["fp32_master"] == (master_bytes[master] * sum(numels) if apart else 0), case
            grad = 4 if master == "fp32" else 2  # accumulated in fp32, unless the master is bf16
            if stage >= 2:  # (stages 0-1 keep whole gradients)
                assert measured["grads"] == grad * sum(numels), case
            pad = 2 * 16 * (len(numels) + 1) if world > 1 else 0  # elements: each slice pads to ALIGN
            for kind, per_element in (("params", 2), ("grads", grad), ("fp32_master", master_bytes[master]),
                                      ("optimizer_states", 8), ("host_staging", 4)):
                assert abs(getattr(estimate, kind) - measured[kind]) <= per_element * pad, (case, world, kind)
            assert abs(estimate.host_bytes - measured["host_bytes"]) <= 16 * pad, (case, world)
        table = "".join(t for *_, t in results if t)  # rank 0's end table: it names the format and counts it
        assert f"stage 2 + offload optimizer on {world} rank(s), bf16, bf16 master + 8-bit moments" in table
        this = next(e for c, e, *_ in results if c == monitored)
        assert format_bytes(this.model_states_total) in table
        assert "in each state format" in table and "* bf16 master + 8-bit moments" in table
        assert "  fp32 master + fp32 moments" in table


@pytest.mark.parametrize("stage, offload", [(2, "optimizer"), (3, "optimizer+param"), (3, "param")])
def test_nvme_estimates_equal_memory_report_of_real_runs(tmp_path, stage, offload):
    """With nvme=True the states on disk, the buffers and the host bytes are what a run with
    offload to NVMe measures (up to the engine's padding and the 4 KiB page of each region)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_embd=128))
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True},
              "zero_optimization": {
                  "stage": stage, "reduce_bucket_size": 20_000, "sub_group_size": 4096,
                  "stage3_module_granularity_threshold": 60_000, "stage3_param_persistence_threshold": 200,
                  "offload_optimizer": nvme if "optimizer" in offload else {"device": "none"},
                  "offload_param": {**nvme, "max_in_cpu": 0} if "param" in offload else {"device": "none"}}}
    estimate = estimate_memory(model, 1, stage=stage, offload=offload, config=config, nvme=True)[0]
    assert estimate.label == f"stage {stage} + offload {offload} to NVMe"
    engine, *_ = zero.initialize(model=model, config=config)
    monitor = zero.TrainingMonitor(engine, steps=2)
    x = torch.randint(0, 50, (2, 16))
    for _ in range(2):
        engine.backward(F.cross_entropy(engine(x).float().flatten(0, 1), x.flatten()))
        engine.step()
        monitor.step()
    measured = engine.memory_report()
    table = monitor.report()
    engine.destroy()
    # the end table: this option marked, what is on disk and what one step moves
    assert f"* {estimate.label}" in table
    assert ("NVMe offload (rank 0" in table) == ("optimizer" in offload)
    assert ("parameters on NVMe (rank 0" in table) == ("param" in offload)
    assert measured["disk_bytes"] > 0 and estimate.disk_bytes == pytest.approx(measured["disk_bytes"], rel=0.02)
    assert estimate.nvme_buffers == pytest.approx(measured["nvme_buffers"], abs=2 * 3 * 4096)
    assert estimate.host_bytes == pytest.approx(measured["host_bytes"], rel=0.04)
    # and without nvme the same option keeps the states in host memory
    cpu = estimate_memory(model, 1, stage=stage, offload=offload, config=config)[0]
    assert cpu.disk_bytes == 0 and cpu.host_bytes > estimate.host_bytes


def test_the_command_line_with_nvme_has_a_disk_column(capsys):
    assert cli(["--params", "7e9", "--gpus", "8", "--stage", "3", "--offload", "optimizer", "--nvme"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "disk/rank" and "stage 3 + offload optimizer to NVMe" in lines[3]
    assert lines[3].split()[-2:] == ["9.78", "GiB"]  # 12 bytes per parameter / 8 ranks

"""DeepSpeed's monitors (zero/events.py): `csv_monitor` writes what DeepSpeed's engine writes, in
DeepSpeed's files; `tensorboard` without its package is refused at load; wandb warns."""
import csv
import importlib.util
import warnings

import pytest
import torch

import zero
from zero.config import ConfigError, ConfigWarning, load_config


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_monitor_writes_deepspeeds_events_in_deepspeeds_files(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "wall_clock_breakdown": True,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}},
              "fp16": {"enabled": True, "initial_scale_power": 8},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    engine, *_ = zero.initialize(model=model, config=config)
    lrs = []
    for _ in range(3 * 2):
        engine.backward(engine(torch.randn(3, 4, dtype=torch.float16)).float().square().mean())
        engine.step()
        if engine.micro_steps % 2 == 0:  # after an optimizer step: the lr the events hold
            lrs.append(engine.get_lr()[0])
    job = tmp_path / "run"
    lr = _rows(job / "Train_Samples_lr.csv")
    assert lr[0] == ["step", "lr"]
    assert [int(r[0]) for r in lr[1:]] == [6, 12, 18]  # the global sample count of each optimizer step
    assert [float(r[1]) for r in lr[1:]] == pytest.approx(lrs)
    scale = _rows(job / "Train_Samples_loss_scale.csv")
    assert scale[0] == ["step", "loss_scale"] and float(scale[-1][1]) == engine.loss_scale
    for part in ("forward", "backward", "step"):
        times = _rows(job / f"Train_Samples_elapsed_time_ms_{part}.csv")
        assert len(times) == 4 and all(float(r[1]) >= 0 for r in times[1:]), part
    engine.destroy()


def test_without_the_monitors_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, *_ = zero.initialize(model=torch.nn.Linear(4, 2), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert "events" not in engine.components and not any(tmp_path.iterdir())


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed here")
def test_tensorboard_without_its_package_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"tensorboard: tensorboard.enabled is true but the tensorboard package is "
                                          r"not installed \(pip install tensorboard\)"):
        load_config({"train_batch_size": 2, "tensorboard": {"enabled": True}})


def test_wandb_warns_once_naming_the_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"train_batch_size": 2, "wandb": {"enabled": True, "project": "p"}})
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(messages) == 1 and messages[0].startswith("wandb.enabled"), messages

"""DeepSpeed's monitors: the training events DeepSpeed's engine writes, written by zero to the
`csv_monitor` and `tensorboard` the config enables.

[Note: DeepSpeed's monitors]
With `csv_monitor.enabled` or `tensorboard.enabled`, rank 0 writes after every optimizer step what
DeepSpeed 0.19.8's engine writes, each at the step's global sample count: the learning rate of the
first param group ("Train/Samples/lr"), under fp16 the loss scale ("Train/Samples/loss_scale"),
and with `wall_clock_breakdown` the milliseconds of forward, backward and step since the last
step ("Train/Samples/elapsed_time_ms_forward", ...). Files go where DeepSpeed puts them, under
`output_path/job_name/`: for csv one file per event, named after it with "/" as "_", rows
"step,value" under the header "step,<the name's last part>"; for TensorBoard one SummaryWriter's
event file. wandb and comet send to services zero does not talk to: they warn at load. The
"events" component (see [Note: engine components] in zero/components.py) is built from the config.
"""
from __future__ import annotations

import csv
import os

from zero.components import Component


class CsvWriter:
    """DeepSpeed's csv layout: one `<event>.csv` per event under `output_path/job_name/`."""

    def __init__(self, output_path: str, job_name: str):
        self.dir = os.path.join(output_path, job_name)
        os.makedirs(self.dir, exist_ok=True)

    def write(self, name: str, value: float, step: int) -> None:
        path = os.path.join(self.dir, name.replace("/", "_").replace(" ", "_") + ".csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            writer.writerow([step, value])

    def flush(self) -> None:
        pass  # every write opens, appends and closes its file


class TensorBoardWriter:
    """The same events through torch.utils.tensorboard, in `output_path/job_name/`."""

    def __init__(self, output_path: str, job_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_path, job_name))

    def write(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()  # after every step, as DeepSpeed's monitor flushes after its events


class MonitorEvents(Component):
    """Writes DeepSpeed's events after each optimizer step, on rank 0 (see [Note: DeepSpeed's monitors])."""

    name = "events"

    def __init__(self, config, rank: int):
        self.writers = []
        if rank == 0:
            for section, kind in ((config.csv_monitor, CsvWriter), (config.tensorboard, TensorBoardWriter)):
                if section.enabled:
                    self.writers.append(kind(section.output_path, section.job_name))
        self.fp16 = config.fp16.enabled
        self.timed = config.wall_clock_breakdown
        self.last_times: dict[str, float] = {}

    def events(self, engine) -> list[tuple[str, float, int]]:
        samples = engine.global_samples
        out = [("Train/Samples/lr", float(engine.get_lr()[0]), samples)]
        if self.fp16:
            out.append(("Train/Samples/loss_scale", float(engine.loss_scale), samples))
        if self.timed:
            now = engine.wall_clock_report()
            for part in ("forward", "backward", "step"):
                ms = 1000.0 * (now.get(part, 0.0) - self.last_times.get(part, 0.0))
                out.append((f"Train/Samples/elapsed_time_ms_{part}", ms, samples))
            self.last_times = now
        return out

    def after_step(self, engine, applied: bool) -> None:
        if not self.writers:
            return
        for name, value, step in self.events(engine):
            for writer in self.writers:
                writer.write(name, value, step)
        for writer in self.writers:
            writer.flush()

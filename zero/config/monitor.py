"""The `csv_monitor` and `tensorboard` sections: DeepSpeed's monitors, which zero writes (zero/events.py)."""
from __future__ import annotations

import importlib.util

from pydantic import Field, model_validator

from zero.config.sections import _Section


class MonitorConfig(_Section):
    """`csv_monitor` / `tensorboard`: the events DeepSpeed's engine writes, in files under
    `output_path/job_name/` (see [Note: DeepSpeed's monitors] in zero/events.py)."""

    enabled: bool = Field(False, description="Write the training events (rank 0).")
    output_path: str = Field("", description="Directory of the job's directory (\"\": the working directory).")
    job_name: str = Field("DeepSpeedJobName", description="The job's directory, inside output_path.")


class TensorBoardConfig(MonitorConfig):
    """`tensorboard`: as `csv_monitor`, written by torch.utils.tensorboard (the `tensorboard` package)."""

    @model_validator(mode="after")
    def _needs_tensorboard(self) -> TensorBoardConfig:
        if self.enabled and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("tensorboard.enabled is true but the tensorboard package is not installed "
                             "(pip install tensorboard), or use csv_monitor, which needs nothing")
        return self

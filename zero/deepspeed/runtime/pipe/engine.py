"""`deepspeed.runtime.pipe.engine`: `PipelineEngine`, for isinstance checks (see zero/deepspeed/_kinds.py)."""
from zero.deepspeed._kinds import kind
from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.pipe import schedule  # noqa: F401
from zero.deepspeed.runtime.utils import PartitionedTensor  # noqa: F401
from zero.engine import Engine
from zero.pipe.module import PipelineModule  # noqa: F401

PipelineEngine = kind("PipelineEngine", __name__, lambda e: isinstance(e, Engine) and e.pipeline is not None,
                      "an engine built by initialize(model=PipelineModule(...)) owns a pipeline schedule")


def __getattr__(name: str):
    return missing(__name__, name)

"""`deepspeed.runtime.pipe.engine`: `PipelineEngine`, for isinstance checks (see zero/deepspeed/_kinds.py)."""
from zero.deepspeed._kinds import kind
from zero.engine import Engine

PipelineEngine = kind("PipelineEngine", __name__, lambda e: isinstance(e, Engine) and e.pipeline is not None,
                      "an engine built by initialize(model=PipelineModule(...)) owns a pipeline schedule")

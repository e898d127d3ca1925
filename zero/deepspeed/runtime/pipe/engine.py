"""`deepspeed.runtime.pipe.engine`: `PipelineEngine`, for isinstance checks.

zero has one engine class (see [Note: one engine, any mesh] in zero/engine.py); an engine built by
`initialize` for a PipelineModule owns a pipeline schedule. `isinstance(engine, PipelineEngine)`
is true for exactly those engines, as DeepSpeed scripts expect.
"""
from zero.engine import Engine


class _WithSchedule(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, Engine) and obj.pipeline is not None


class PipelineEngine(metaclass=_WithSchedule):
    """A zero Engine that runs a pipeline schedule (`train_batch`, `eval_batch`). Built by
    `initialize(model=PipelineModule(...))`, not directly."""

    def __new__(cls, *args, **kwargs):
        raise TypeError("zero has no separate PipelineEngine class: build the engine with "
                        "initialize(model=PipelineModule(...), config=...), which gives it a pipeline schedule")

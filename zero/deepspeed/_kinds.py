"""DeepSpeed classes that zero has as one class in several configurations, for isinstance checks.

DeepSpeed has a class per configuration (`PipelineEngine(DeepSpeedEngine)`, a ZeRO optimizer per
stage); zero has one engine and one optimizer whose parts differ (see [Note: one engine, any
mesh] in zero/engine/loop.py). Scripts test `isinstance(engine, PipelineEngine)` to choose between
`train_batch` and `backward`/`step`: `kind(...)` makes a class whose isinstance is true for the zero
objects in that configuration, and which cannot be constructed.
"""
from __future__ import annotations

from collections.abc import Callable


def kind(name: str, module: str, test: Callable[[object], bool], build: str) -> type:
    """A class `name` whose instances are the objects passing `test`; `build` says how zero makes one."""

    class _Kind(type):
        def __instancecheck__(cls, obj) -> bool:
            return test(obj)

    def __new__(cls, *args, **kwargs):
        raise TypeError(f"{name} is not a class of its own in zero (it is for isinstance checks): {build}")

    return _Kind(name, (), {"__new__": __new__, "__module__": module,
                            "__doc__": f"DeepSpeed's {name}, for isinstance checks: {build}"})

"""The engine: the training loop (`loop.py`), the Engine a user holds (`engine.py`), the optimizer it
builds (`build.py`), `zero.initialize` (`launch.py`), the counters a checkpoint saves (`progress.py`)
and the checks made when an engine is built (`guards.py`). Its components' protocol is
zero/components.py."""


def __getattr__(name: str):  # the rooms the engine uses import `zero.components` without the engine
    if name == "Engine":
        from zero.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'zero.engine' has no attribute {name!r}")


__all__ = ["Engine"]

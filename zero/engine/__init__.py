"""The engine: the training loop (`loop.py`), the Engine a user holds (`engine.py`),
`zero.initialize` (`launch.py`), the counters a checkpoint saves (`progress.py`) and the checks
made when an engine is built (`guards.py`)."""
from zero.engine.engine import Engine

__all__ = ["Engine"]

"""DeepSpeed's engine as a facade over zero's: `DeepSpeedEngine` is zero's `Engine` with DeepSpeedEngine's
config accessors (zero/deepspeed/engine_accessors.py) and its other methods (zero/deepspeed/engine_methods.py),
each with DeepSpeed's name, signature and meaning. `import zero.deepspeed as deepspeed;
deepspeed.initialize(...)` returns one; zero's own `zero.initialize` returns the plain `Engine`,
which holds the same training state and has zero's methods only. zero's core never imports this room.
"""
from __future__ import annotations

from zero.deepspeed.engine_accessors import ConfigAccessors
from zero.deepspeed.engine_methods import DeepSpeedMethods
from zero.engine import Engine


class DeepSpeedEngine(ConfigAccessors, DeepSpeedMethods, Engine):
    """zero's Engine with DeepSpeedEngine's accessors and methods (see the module's docstring)."""

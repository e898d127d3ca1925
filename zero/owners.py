"""Which engine owns each parameter: the registry zero.initialize fills (zero/engine/guards.py) and the
accessors, zero.Init's leaf marks and a second initialize read.

Parameter -> (a weak reference to the optimizer whose hooks take its gradient, whether it is
stage 3, which shards every parameter); weak both ways, and kept off the parameter so the model
stays picklable.
"""
from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

OWNERS = WeakIdKeyDictionary()

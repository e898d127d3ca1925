"""Optimizers on shards: the step every stage shares (`step.py`), the update rules and the state
each declares (`rules.py`), which optimizer a run gets (`choice.py`), Muon (`muon.py`), Lion
(`lion.py`) and fp16 loss scaling (`loss_scale.py`)."""
from zero.optim.lion import Lion

__all__ = ["Lion"]

"""Model states in host memory: where the optimizer state lives (`policy.py`: on the device or
offloaded) and the store that keeps it (`store.py`), optimizer offload's host step (`host.py`) and
`engine.offload_states()` (`relocation.py`)."""

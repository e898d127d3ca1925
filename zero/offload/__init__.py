"""Model states in host memory: optimizer offload's host step (`host.py`) and
`engine.offload_states()` (`relocation.py`)."""

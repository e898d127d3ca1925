"""ZeRO stages: where parameters, gradients and optimizer state are kept, and how they move.

Rooms: `policies.py` (what the config asks, decided once), `storage.py` (what the step sees of a
stage's storage), `readiness.py` (when gradients are final, stages 2 and 3), `buckets.py` (stages
0-2: FlatParams), `unit.py`, `planning.py`, `unit_params.py` and `stage3.py` (stage 3: UnitParams and its
runtime), `placement.py` and `owned.py` (how parameters lie over the ranks),
`memory.py` (bytes measured from the storages). The step over them is zero/optim/step.py; the
optimizer is built by zero/engine/build.py.
"""

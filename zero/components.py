"""Components: the parts of a run that act at fixed points of the training loop.

[Note: engine components]
The loop (zero/engine/loop.py) keeps the optimizer step, the accumulation counters and the loss
scale; everything else a run may have is a component it holds by name (`engine.components`) and
calls at fixed points:
    before_step(engine)           before an optimizer step's first collective
    after_step(engine, applied)   after an accumulation boundary's step and its bookkeeping
A component that holds training state has `state_dict()` / `load_state_dict()` too, and a
checkpoint saves and loads it under its name (in "components"), as it does the engine's other
stateful parts (`stateful_parts`: the progress counters, the optimizer, the lr scheduler, the data
loader).
The components zero builds from the config: "sequence" (Ulysses' first-step check and traffic,
zero/sequence/ulysses.py), "periodic_saves" (zero/checkpoint/periodic.py), "activations" (ZeRO-R,
zero/activations.py), "pipeline" (the schedule, zero/pipe/schedule.py), "mesh_traffic" (the
pipeline and tensor traffic, zero/parallel/mesh.py), "events" (DeepSpeed's csv and TensorBoard
monitors, zero/events.py); a `zero.TrainingMonitor` adds itself as
"monitor". A new part of a run is one component here, not a branch in the loop.
"""
from __future__ import annotations


class Component:
    """A part of a run the loop calls at its points (see [Note: engine components]); each method
    does nothing unless a component overrides it."""

    name = "component"

    def before_step(self, engine) -> None:
        """Before an optimizer step's first collective (every rank calls it at the same step)."""

    def after_step(self, engine, applied: bool) -> None:
        """After an accumulation boundary's step (`applied`: the weights changed, the step was not
        skipped) and the loop's bookkeeping (counters, scheduler, comm report)."""


ENGINE_PARTS = ("progress", "optimizer", "lr_scheduler", "dataloader")  # saved at a checkpoint's top level


def stateful_parts(engine) -> dict[str, object]:
    """The parts of an engine whose state a checkpoint saves, by name: the progress counters, the
    optimizer, the lr scheduler, the data loader initialize made (None where the engine has no
    such part; these are ENGINE_PARTS), and every component with a `state_dict` (a checkpoint
    keeps those under "components", so a component's name never meets a key of the format)."""
    parts = {"progress": engine.progress, "optimizer": engine.optimizer, "lr_scheduler": engine.lr_scheduler,
             "dataloader": engine.training_dataloader}
    parts.update({name: c for name, c in engine.components.items() if hasattr(c, "state_dict")})
    return parts

"""Where training stands: the engine's counters, and the count of backward passes.

`TrainingProgress` is what a checkpoint restores besides tensors; `BackwardCounter` counts each
backward that reaches the model's outputs, whoever calls it (see [Note: backward from PyTorch] in
zero/engine.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from zero.stages.readiness import in_backward, tensors_in


@dataclasses.dataclass
class TrainingProgress:
    """Where training stands, besides tensors: the engine's counters. A DCP `Stateful`
    (`state_dict` / `load_state_dict`), which checkpoints save and restore.

    Args:
        accumulation: micro-batches per optimizer step (the config's gradient_accumulation_steps).
        micro_steps: `engine.step()` calls (micro-batches) so far.
        global_steps: optimizer steps (accumulation boundaries) so far, skipped ones included.
        skipped_steps: steps skipped for a non-finite gradient.
        global_samples: samples seen by all data-parallel ranks together.
        backwards: backward passes since the last optimizer step (ranks must agree).
        last_step_applied: whether the last `step()` updated the weights.
        last_step_skipped: whether the last boundary step was skipped.
    """

    accumulation: int = 1
    micro_steps: int = 0
    global_steps: int = 0
    skipped_steps: int = 0
    global_samples: int = 0
    backwards: int = 0
    last_step_applied: bool = False
    last_step_skipped: bool = False

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps: the steps and samples so far (a window of accumulated
        micro-batches is not in a checkpoint)."""
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "global_samples": self.global_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`, at the beginning of an accumulation window."""
        self.global_steps, self.skipped_steps = int(state["global_steps"]), int(state["skipped_steps"])
        self.global_samples = int(state["global_samples"])
        self.micro_steps = self.global_steps * self.accumulation
        self.backwards = 0
        self.last_step_applied = self.last_step_skipped = False


class BackwardCounter:
    """A forward hook on the model that counts backward passes into `progress.backwards`: each
    backward once, at the first gradient of one of the model's outputs (a forward re-run inside
    backward, for activation checkpointing, adds no count). With fp16 it refuses a backward that
    did not pass through a loss from `mark_scaled` (the engine's `scale`), before any parameter
    gradient is taken. It holds nothing but the counters, so a model pickles with it.

    Args:
        progress: where the count goes.
        fp16: whether losses must carry the fp16 loss scale.
    """

    def __init__(self, progress: TrainingProgress, fp16: bool):
        self.progress, self.fp16 = progress, fp16
        self._counted = -1  # the backward (graph task) counted last
        self._scaled = -1  # the backward that last passed through a scaled loss

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or in_backward():
            return
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(self._output_grad)

    def mark_scaled(self, scaled: torch.Tensor) -> None:
        """`scaled` is a loss times the fp16 loss scale: a backward from it is a scaled one."""
        if scaled.requires_grad:
            scaled.register_hook(self._scaled_grad)

    def _scaled_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self._scaled = torch._C._current_graph_task_id()
        return grad

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task == self._counted:
            return grad
        if self.fp16 and task != self._scaled:
            raise RuntimeError(
                "zero: backward of a loss without the fp16 loss scale: with fp16, gradients of the unscaled loss "
                "underflow. Call engine.backward(loss), or engine.scale(loss).backward(), instead of loss.backward(). "
                "No gradient of this backward was taken.")
        self._counted = task
        self.progress.backwards += 1
        return grad

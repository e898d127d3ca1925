"""Where training stands: the engine's counters, and the count of backward passes.

`TrainingProgress` is what a checkpoint restores besides tensors; `BackwardCounter` counts each
backward that gives the model's parameters gradients, whoever calls it (see [Note: backward from
PyTorch] in zero/engine/loop.py).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from zero.graph import graph_outputs, in_backward


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


class _Window:
    """The lifetime of one backward pass, as an object: the callback queued at its end holds it.
    When the backward ends the callback runs; when it raises, autograd drops its callbacks unrun
    and the window goes with them. So a weak reference to it says whether that backward is still
    running, with nothing to reset after a failure."""

    __slots__ = ("grads", "__weakref__")

    def __init__(self) -> None:
        self.grads = False  # the backward gave a parameter a gradient


def _open(on_end: Callable[[_Window], None]) -> weakref.ref:
    """A window on the running backward (queue `on_end(window)` at its end); a weak reference to it."""
    window = _Window()
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(on_end, window))
    return weakref.ref(window)


def _alive(ref: weakref.ref | None) -> _Window | None:
    return ref() if ref is not None else None


class _ScaledBackward:
    """The backward from a loss that carries the fp16 loss scale, while it runs. One record for
    every engine of the process: a GAN's generator loss runs through the discriminator's model."""

    window: weakref.ref | None = None

    @classmethod
    def running(cls) -> bool:
        return _alive(cls.window) is not None

    @classmethod
    def begins(cls, grad: torch.Tensor) -> torch.Tensor:
        """The scaled loss's own hook: the first thing its backward runs (the outermost one)."""
        if not cls.running():
            cls.window = _open(cls.ends)
        return grad

    @classmethod
    def ends(cls, window: _Window) -> None:
        cls.window = None


def mark_scaled(loss: torch.Tensor) -> None:
    """`loss` carries the fp16 loss scale: a backward from it is a scaled one (see BackwardCounter)."""
    if loss.requires_grad:
        loss.register_hook(_ScaledBackward.begins)


def _gone() -> None:
    return None


class BackwardCounter:
    """Counts the backward passes that give a model's parameters their gradients into
    `progress.backwards`, however backward is called (see [Note: backward from PyTorch] in
    zero/engine/loop.py), and with fp16 refuses one whose loss did not carry the loss scale.

    - A hook on each trainable parameter, ahead of the stage's own, sees every gradient that
      accumulates into a parameter (`torch.autograd.grad` accumulates none, so a gradient
      penalty is neither counted nor refused). A backward is counted once, at its end, if it
      gave a parameter a gradient.
    - Its end is a callback queued on the backward that first reaches the model's outputs (a
      forward hook marks them), so the nested backward passes of reentrant activation
      checkpointing are part of it. A backward that never reaches the outputs (a loss on the
      parameters alone, or outputs hidden where `zero.graph.tensors_in` does not look) ends
      where its first parameter gradient arrives: inside a reentrant checkpoint that is the
      nested backward, and the pass counts more than once (the same on every rank, so the
      step's rank-agreement check still holds).
    - fp16: a parameter gradient from a backward that did not start at a loss marked by
      `mark_scaled` (the engine's `scale`) is dropped and refused, before the stage takes it.

    It holds its engine's counters weakly (once the engine is gone it does nothing) and pickles
    inert with the model.

    Args:
        progress: where the count goes.
        fp16: whether losses must carry the fp16 loss scale.
        names: parameter -> name, for messages.
    """

    def __init__(self, progress: TrainingProgress, fp16: bool, names: dict[nn.Parameter, str]):
        self._progress = weakref.ref(progress)
        self.fp16 = fp16
        self._names = WeakIdKeyDictionary(names)
        self._window: weakref.ref | None = None  # the backward running through this model, if any

    def install(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """Hook `module`'s outputs and `params` (before any other gradient hook of theirs)."""
        module.register_forward_hook(self._forward, prepend=True)
        for p in params:
            p.register_post_accumulate_grad_hook(self._param_grad)

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward() or self._progress() is None:  # a forward re-run inside backward (activation
            return  # checkpointing), or the engine is gone
        if torch.is_grad_enabled():
            for t in graph_outputs(output):
                t.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self._running()
        return grad

    def _running(self) -> _Window:
        window = _alive(self._window)
        if window is None:
            self._window = _open(self._end)
            window = self._window()
        return window

    def _param_grad(self, param: nn.Parameter) -> None:
        if self._progress() is None:
            return
        if self.fp16 and not _ScaledBackward.running():
            param.grad = None
            raise RuntimeError(
                f"zero: a backward of a loss without the fp16 loss scale reached parameter "
                f"{self._names.get(param, '?')!r}: with fp16, gradients of the unscaled loss underflow. Call "
                f"engine.backward(loss), or engine.scale(loss).backward(), instead of loss.backward(). No gradient "
                f"of this backward was taken.")
        self._running().grads = True

    def _end(self, window: _Window) -> None:
        self._window = None
        progress = self._progress()
        if window.grads and progress is not None:
            progress.backwards += 1

    def __getstate__(self) -> dict:
        return {"_progress": _gone, "fp16": False, "_names": {}, "_window": None}

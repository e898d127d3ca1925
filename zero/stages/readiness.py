"""When a group's gradients are final, reduce them: the one mechanism of stages 2 and 3.

[Note: gradient readiness]
Stages 2 and 3 reduce gradients during backward, one group at a time (a stage-2 bucket, a stage-3
unit):
- A post-accumulate-grad hook on each trainable parameter hands its gradient to its group
  (`take`) and counts it. Autograd accumulates a parameter once per backward, after every use of
  it has added its part, so when every parameter of a group has its gradient, the group's
  gradient is final and its reduction is launched.
- Launch order: `ordered` groups launch strictly in index order (stage 2: every rank issues the
  same collectives in the same order even if gradients arrive in another order on another rank);
  otherwise groups launch as they complete (stage 3, whose collectives carry rank-divergence tags).
- In flight: after each launch, the oldest reductions are finished while more than two are in
  flight or their buffers hold more than `in_flight_bytes`. So the reduce buffers alive during
  backward are bounded by the config (`reduce_bucket_size`), not by the model. On NCCL finishing
  only orders the stream, so this costs no CPU stall.
- A callback queued on the autograd engine with the first gradient runs at the end of backward:
  it launches groups that got no (or only part of their) gradients, as zeros, so every rank issues
  the same collectives; it re-sends gradients that arrived after their group was launched (a
  parameter reached twice, as with reentrant activation checkpointing: reduction is linear, so
  sending the late part separately is exact); and it finishes everything.
- A backward that raised never reaches that callback. The next forward or `zero_grad` notices and
  drops what it left (`recover`), so one failed batch does not silence every later one.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

MAX_IN_FLIGHT = 2  # reductions in flight at once (double buffering)


class UnusedParameterError(RuntimeError):
    """A trainable parameter got no gradient while `ignore_unused_parameters` is false."""


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class GradReadiness:
    """Counts arriving gradients per group and launches each group's reduction when it is complete.

    Args:
        groups: the trainable parameters of each group, in group index order.
        take: `take(group, param)` receives `param.grad` as soon as autograd has it.
        launch: `launch(group)` starts the group's reduction; returns the bytes it keeps in flight.
        finish: `finish(group)` waits for it and accumulates the result.
        ordered: launch strictly in group order (see [Note: gradient readiness]).
        in_flight_bytes: finish the oldest reductions when more than this is in flight.
        names: parameter names for messages.
        ignore_unused: False raises UnusedParameterError at the end of a backward in which a
            trainable parameter got no gradient.
        on_end: called at the end of each backward, after every reduction has finished.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], *, take: Callable[[int, nn.Parameter], None],
                 launch: Callable[[int], int], finish: Callable[[int], None], ordered: bool, in_flight_bytes: int,
                 names: Mapping[nn.Parameter, str], ignore_unused: bool = True, on_end: Callable[[], None] | None = None):
        self.groups = [list(g) for g in groups]
        self._take, self._launch_fn, self._finish_fn, self._on_end = take, launch, finish, on_end
        self.ordered = ordered
        self.in_flight_limit = in_flight_bytes
        self.names = names
        self.ignore_unused = ignore_unused
        self._group_of = {p: gi for gi, g in enumerate(self.groups) for p in g}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._group_of]
        self.active = False  # a backward has started and its end-of-backward callback is queued
        self._reset()

    def _reset(self) -> None:
        self._waiting = [set(g) for g in self.groups]
        self._launched = [False] * len(self.groups)
        self._late: set[int] = set()
        self._next = 0  # ordered: the next group to launch
        self._in_flight: deque[tuple[int, int]] = deque()
        self.active = False

    # -- during backward ----------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Queue the end-of-backward callback (once per backward; idempotent)."""
        if not self.active:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.active = True

    def _on_grad(self, param: nn.Parameter) -> None:
        gi = self._group_of[param]
        self.begin_backward()
        self._take(gi, param)
        if self._launched[gi]:
            self._late.add(gi)  # its group was already sent in this backward: send again at the end
            return
        waiting = self._waiting[gi]
        waiting.discard(param)
        if waiting:
            return
        if not self.ordered:
            self._launch(gi)
            return
        while self._next < len(self.groups) and not self._waiting[self._next]:
            self._launch(self._next)
            self._next += 1

    def _launch(self, gi: int) -> None:
        while len(self._in_flight) >= MAX_IN_FLIGHT:  # room for this one first
            self._finish_fn(self._in_flight.popleft()[0])
        self._launched[gi] = True
        self._in_flight.append((gi, self._launch_fn(gi)))
        while len(self._in_flight) > 1 and sum(b for _, b in self._in_flight) > self.in_flight_limit:
            self._finish_fn(self._in_flight.popleft()[0])

    def _finish_all(self) -> None:
        while self._in_flight:
            self._finish_fn(self._in_flight.popleft()[0])

    def _end_of_backward(self) -> None:
        with record_function("zero::end_of_backward"):
            unused = [p for g in self._waiting for p in g] if not self.ignore_unused else []
            for gi in range(len(self.groups)):
                if not self._launched[gi]:
                    self._launch(gi)
            self._finish_all()
            for gi in sorted(self._late):
                self._launch(gi)
            self._finish_all()
            self._reset()
            if self._on_end is not None:
                self._on_end()
        if unused:
            names = ", ".join(repr(self.names.get(p, "?")) for p in unused[:8])
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise UnusedParameterError(
                f"{len(unused)} trainable parameter(s) got no gradient in this backward: {names}{more}. They were "
                f"not used to compute the loss. Set zero_optimization.ignore_unused_parameters to true to train "
                f"them as if their gradient were zero, or freeze them (requires_grad=False) before zero.initialize.")

    # -- recovery -------------------------------------------------------------------------------

    def recover(self) -> bool:
        """Drop the state a backward left when it raised before its end (see [Note: gradient
        readiness]); reductions it had launched are finished first. Returns True if there was
        anything to drop."""
        if not self.active or in_backward():
            return False
        self._finish_all()
        self._reset()
        return True


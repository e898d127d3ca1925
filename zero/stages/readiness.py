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
- In flight: before a launch, the previous reduction is finished (with `overlap_comm`; without
  it each one is finished as soon as it is launched). So at most one reduction runs while the
  next is prepared, and the reduce buffers alive during backward are bounded by one or two
  groups (a stage-2 bucket is at most `reduce_bucket_size` elements), not by the model. On NCCL
  finishing only orders the stream, so this costs no CPU stall.
- Ordered groups wait for the parameters that had a gradient in the previous backward (all of
  them at first): a parameter left unused does not hold back its bucket and, in order, every
  later one.
- A callback queued on the autograd engine with the first gradient runs at the end of backward:
  it launches groups that got no (or only part of their) gradients, as zeros, so every rank issues
  the same collectives; it re-sends gradients that arrived after their group was launched (a
  parameter reached twice, as with reentrant activation checkpointing, or one unused in the
  previous backward: reduction is linear, so sending the late part separately is exact), for the
  groups any rank has late gradients for (the ranks exchange one rank-agreement tag carrying their
  count of late groups, and only when some rank has any, the groups themselves, on the control
  group); and it finishes everything. The callback is queued from a hook on the model's
  outputs, so it belongs to the outermost backward even when the first gradient arrives inside a
  nested one.
- A backward that raised never reaches that callback. The next forward or `zero_grad` notices and
  forgets its bookkeeping (`recover`), so one failed batch does not silence every later one; the
  gradients it produced stay until `zero_grad()`, as with plain torch.
"""
from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zero.errors import ZeroRuntimeError
from zero.graph import graph_outputs, in_backward
from zero.parallel.comm import Comm
from zero.parallel.tags import Tag


class UnusedParameterError(ZeroRuntimeError, AssertionError):
    """A trainable parameter got no gradient while `ignore_unused_parameters` is false (also an
    AssertionError, the exception DeepSpeed raises there)."""


class GradReadiness:
    """Counts arriving gradients per group and launches each group's reduction when it is complete.

    Args:
        groups: the trainable parameters of each group, in group index order.
        take: `take(group, param)` receives `param.grad` as soon as autograd has it (the group's
            reduction, if any, has finished by then).
        launch: `launch(group)` starts the group's reduction.
        finish: `finish(group)` waits for it and accumulates the result.
        comm: the data-parallel group (ranks agree on late gradients through its control group).
        ordered: launch strictly in group order, and let a group wait only for the parameters
            that had a gradient in the previous backward (see [Note: gradient readiness]);
            otherwise launch a group once all its parameters have their gradients (stage 3
            releases a unit then, so its gradients must really be complete).
        overlap: leave one reduction in flight while the next is prepared (`overlap_comm`);
            False finishes each one as soon as it is launched.
        names: parameter names for messages.
        ignore_unused: False raises UnusedParameterError at the end of a backward in which a
            trainable parameter got no gradient.
        on_end: called at the end of each backward, after every reduction has finished.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], *, take: Callable[[int, nn.Parameter], None],
                 launch: Callable[[int], None], finish: Callable[[int], None], comm: Comm, ordered: bool,
                 overlap: bool, names: Mapping[nn.Parameter, str], ignore_unused: bool = True,
                 on_end: Callable[[], None] | None = None):
        self.groups = [list(g) for g in groups]
        self._take, self._launch_fn, self._finish_fn, self._on_end = take, launch, finish, on_end
        self.ordered = ordered
        self.on_signal: set[int] = set()  # groups launched by `launch_now`, not by their gradients
        self.max_in_flight = 1 if overlap else 0
        self.names = names
        self.ignore_unused = ignore_unused
        self._comm = comm
        self._control = comm.control()
        self._group_of = {p: gi for gi, g in enumerate(self.groups) for p in g}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._group_of]
        # parameters whose gradient a group waits for: those that got one in the previous backward
        # (all, at first), so a parameter unused last time does not hold back its group
        self._expected = [set(g) for g in self.groups]
        self.active = False  # a backward has started and its end-of-backward callback is queued
        self._reset()

    def _reset(self) -> None:
        self._waiting = [set(g) for g in self._expected]
        self._arrived: set[nn.Parameter] = set()
        self._launched = [False] * len(self.groups)
        self._late: set[int] = set()
        self._next = 0  # ordered: the next group to launch
        self._in_flight: deque[int] = deque()
        self._task = None
        self.active = False

    # -- during backward ----------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Queue the end-of-backward callback on the running backward (once; idempotent)."""
        if not self.active:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.active = True

    def hook_outputs(self, output) -> None:
        """Begin the backward from a hook on the model's outputs: the first thing any backward of
        them reaches, so the end-of-backward callback lands on that backward, not on a nested one
        (reentrant activation checkpointing runs backward passes inside it)."""
        tensors = graph_outputs(output) if torch.is_grad_enabled() else []
        if tensors:
            this = weakref.proxy(self)
            for t in tensors:
                t.register_hook(lambda grad: (this.begin_backward(), grad)[1])

    def __getstate__(self) -> dict:
        return {}  # a pickled or deep-copied model's hooks do nothing (see ParamStorage.__getstate__)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.__dict__:
            return
        gi = self._group_of[param]
        self.begin_backward()
        self._arrived.add(param)
        if self._launched[gi]:  # its group was already sent in this backward: send again at the end
            if gi in self._in_flight:  # first finish what uses the group's buffers
                self._in_flight.remove(gi)
                self._finish_fn(gi)
            self._late.add(gi)
            self._take(gi, param)
            return
        self._take(gi, param)
        waiting = self._waiting[gi]
        waiting.discard(param)
        if not waiting and gi not in self.on_signal:
            self._ready(gi)

    def launch_now(self, gi: int) -> None:
        """Launch group `gi` now, with whatever gradients it has (missing ones count as zero; any
        that arrive later are re-sent at the end of backward). For groups in `on_signal`."""
        if self.active and not self._launched[gi]:
            self._launch(gi)

    def _ready(self, gi: int) -> None:
        if not self.ordered:
            self._launch(gi)
            return
        while self._next < len(self.groups) and not self._waiting[self._next]:
            if not self._launched[self._next]:
                self._launch(self._next)
            self._next += 1

    def _launch(self, gi: int) -> None:
        while self._in_flight and len(self._in_flight) >= self.max_in_flight:  # room for this one first
            self._finish_fn(self._in_flight.popleft())
        self._launched[gi] = True
        self._launch_fn(gi)
        self._in_flight.append(gi)
        if len(self._in_flight) > self.max_in_flight:  # no overlap: finish it at once
            self._finish_fn(self._in_flight.popleft())

    def _finish_all(self) -> None:
        while self._in_flight:
            self._finish_fn(self._in_flight.popleft())

    def _agreed_late(self) -> list[int]:
        """The groups any rank has late gradients for: every rank re-sends the same groups."""
        if self._comm.world_size == 1:
            return sorted(self._late)
        work, tags = self._comm.start_tag(Tag.END_OF_BACKWARD, len(self._late), len(self.groups))  # one tag exchange per backward
        rows = self._comm.check_tags(work, tags, "the end of a backward pass", key=lambda row: (row[0], row[2], row[3]))
        if not any(row[1] for row in rows):
            return []
        flags = torch.zeros(len(self.groups), dtype=torch.float32)
        flags[list(self._late)] = 1.0
        self._control.all_reduce(flags, "max")
        return [gi for gi, f in enumerate(flags.tolist()) if f]

    def _end_of_backward(self) -> None:
        with record_function("zero::end_of_backward"):
            unused = [p for g in self.groups for p in g if p not in self._arrived] if not self.ignore_unused else []
            for gi in range(len(self.groups)):
                if not self._launched[gi]:
                    self._launch(gi)
            self._finish_all()
            for gi in self._agreed_late():
                self._launch(gi)
            self._finish_all()
            if self.ordered:
                self._expected = [{p for p in g if p in self._arrived} for g in self.groups]
            self._reset()
            self._comm.check_deferred()  # the tags of this backward's collectives (NCCL)
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
        """Forget the bookkeeping of a backward that raised before its end (see [Note: gradient
        readiness]). Reductions it had launched are completed first (every rank issued them); the
        gradients that backward produced stay where they are until `zero_grad()`, as they would
        with plain torch. Returns True if there was anything to forget."""
        if not self.active or in_backward():
            return False
        self._finish_all()
        self._reset()
        self._comm.check_deferred()
        return True

"""`deepspeed.runtime.pipe.schedule`: DeepSpeed's pipeline schedules as descriptions, the lists of
instructions each stage runs at each step of one batch.

zero's pipeline runs on torch.distributed.pipelining (zero/pipe/schedule.py); these classes are
not its engine. They are what DeepSpeed users read and subclass to see what a stage does, and they
yield the same instructions, step for step, as DeepSpeed's.

[Note: the 1F1B clock]
TrainSchedule runs 2 * (M + S - 1) steps for M micro-batches on S stages. Stage s runs the
forward of micro-batch m at step 2m + s and its backward at step 2m + 2S - 1 - s: forwards
reach stage s one step after stage s - 1, backwards one step after stage s + 1, and the last
stage runs each backward right after its forward. So at any step a stage computes at most one
thing, forwards and backwards alternating (1F1B) once the pipeline is full. Whatever a step
computed is sent at the next step (SendActivation after a forward, SendGrad after a backward), in
the same step as the receive of that step's own input, ordered so that neighbouring stages'
blocking sends and receives pair up. Micro-batch m lives in buffer m mod B, B = max(2, min(S - s,
M)): the forwards stage s has in flight at once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.utils import call_to_str

# ---------------------------------------------------------------------------------------------
# Instructions
# ---------------------------------------------------------------------------------------------

class PipeInstruction:
    """One thing a pipeline stage does; its keyword arguments become attributes.

    `repr` reads like the call that made it (`ForwardPass(buffer_id=0)`). Two instructions are equal
    when they are of the same class with the same arguments (DeepSpeed's compare by identity).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.kwargs == self.kwargs

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after ReduceGrads and ReduceTiedGrads)."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients over the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied modules over the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one of the stage's pipeline buffers.

    Args:
        buffer_id: the buffer's index.
        **kwargs: further arguments (DeepSpeed's DualPipe schedule adds `phase`).
    """

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch from the data iterator into the buffer (first and last stages:
    inputs and labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs and keep the outputs there."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's outputs (the loss on the last stage, the received gradient
    elsewhere), accumulating parameter gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (pairs with its RecvActivation)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as the buffer's inputs (pairs with its SendActivation)."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the previous stage (pairs with its RecvGrad)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's outputs from the next stage (pairs with its SendGrad)."""


class CommitP2P(PipeInstruction):
    """Start the sends and receives queued since the last CommitP2P, as one batch, and wait for them
    (for schedules whose send/receive instructions only queue, as DeepSpeed's DualPipeV)."""


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------

class PipeSchedule(ABC):
    """The instructions one stage runs for one batch, as a generator of steps.

    Each step (a list of PipeInstruction) can be separated from the next by a barrier without
    deadlock. Iterating the schedule (`for cmds in schedule`) runs `steps()` from the start.

    Args:
        micro_batches: micro-batches in the batch.
        stages: pipeline stages.
        stage_id: the stage this schedule is for.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__()
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each step."""

    def num_pipe_buffers(self) -> int:
        """Buffers the stage needs (default: one per micro-batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer that holds `micro_batch_id` (buffers are reused cyclically)."""
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is not in 0..{self.micro_batches - 1}")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class TrainSchedule(PipeSchedule):
    """Train one batch with the synchronous 1F1B schedule (see [Note: the 1F1B clock]); the last
    step reduces tied and data-parallel gradients and steps the optimizer."""

    def num_pipe_buffers(self) -> int:
        """The forwards in flight on this stage at once: max(2, min(stages - stage_id, micro_batches))."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) that this stage computes at `step_id`; the micro-batch may be
        out of range, when the stage idles."""
        if (step_id - self.stage_id) % 2 == 0:
            return (step_id - self.stage_id) // 2, True
        return (step_id - (2 * self.stages - 1 - self.stage_id)) // 2, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        previous = -1  # the micro-batch the previous step computed (in the other direction)
        for step_id in range(total_steps):
            current, forward = self._step_to_micro_batch(step_id)
            has_previous, has_current = self._valid_micro_batch(previous), self._valid_micro_batch(current)
            cmds: list[PipeInstruction] = []
            if forward:
                if has_previous and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(self._buffer_idx(previous)))
                if has_current and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(self._buffer_idx(current)))
            else:
                if has_current and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(self._buffer_idx(current)))
                if has_previous and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(self._buffer_idx(previous)))
            if has_current:
                if forward and (self.is_first_stage or self.is_last_stage):
                    cmds.append(LoadMicroBatch(self._buffer_idx(current)))
                cmds.append((ForwardPass if forward else BackwardPass)(self._buffer_idx(current)))
            if step_id == total_steps - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            previous = current
            yield cmds


class InferenceSchedule(PipeSchedule):
    """Run the forward of one batch: stage s computes micro-batch m at step m + s, in buffer m mod 2,
    and sends it on at the next step (from the other buffer, while the next input arrives)."""

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches + self.stages - 1):
            current = step_id - self.stage_id
            recv_buf, send_buf = current % 2, (current - 1) % 2
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(current):
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if (self._valid_stage(self.next_stage)
                                                  and self._valid_micro_batch(current - 1)) else []
            recv = [RecvActivation(recv_buf)] if (self._valid_stage(self.prev_stage)
                                                  and self._valid_micro_batch(current)) else []
            # even stages send first and odd stages receive first, so the blocking pairs meet
            cmds += send + recv if self.stage_id % 2 == 0 else recv + send
            if self._valid_micro_batch(current):
                cmds.append(ForwardPass(recv_buf))
            yield cmds


class DataParallelSchedule(PipeSchedule):
    """Plain data parallelism with gradient accumulation (one stage): load, forward and backward each
    micro-batch in buffer 0, then reduce and step after the last."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds


def __getattr__(name: str):
    return missing(__name__, name)

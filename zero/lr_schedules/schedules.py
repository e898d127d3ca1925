"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

[Note: DeepSpeed step counting]
DeepSpeed's schedulers count *batches*, not epochs, and keep the index of the last batch in
``last_batch_iteration``:

- A scheduler built with ``last_batch_iteration=-1`` (a fresh run) writes the "before the
  start" value into the optimizer straight away: ``warmup_min_lr`` for WarmupLR/WarmupDecayLR,
  0 for WarmupCosineLR, ``cycle_min_lr`` (and betas ``(cycle_min_mom, 0.99)``) for OneCycle,
  ``lr_range_test_min_lr`` for LRRangeTest.
- Each ``step()`` adds one to ``last_batch_iteration`` and then writes ``get_lr()`` for that
  index. The first ``step()`` therefore uses index 0, the k-th uses index k-1.
- A scheduler built with any other ``last_batch_iteration`` (a resumed run) leaves the
  optimizer alone until the first ``step()``.
- ``state_dict()`` holds only ``last_batch_iteration``; the schedule's shape comes from the
  constructor arguments, exactly as in DeepSpeed, so checkpoints load in either library.

`torch.optim.lr_scheduler.LRScheduler` counts differently (its constructor already performs
one step and moves ``last_epoch`` from -1 to 0), so these classes do not derive from it; they
offer the same methods (``step``, ``get_lr``, ``get_last_lr``, ``state_dict``,
``load_state_dict``) instead.

[Note: where we differ from DeepSpeed]
The numbers of every valid configuration are DeepSpeed's. What differs is how invalid ones fail:

- An unknown ``warmup_type`` raises ValueError (DeepSpeed logs a warning and uses "log").
- ``WarmupDecayLR`` with ``total_num_steps < warmup_num_steps`` raises ValueError (DeepSpeed
  logs a warning and decays to ``warmup_min_lr`` immediately after warmup).
- Wrong types, negative sizes, learning rates that are negative, infinite or beyond the largest
  float32, and per-group lists of the wrong length raise ValueError naming the scheduler and the
  parameter, before the optimizer's learning rate is touched.
- ``WarmupLR(warmup_max_lr=None)`` warms each group up to that group's own lr; DeepSpeed uses
  group 0's lr for every group (the same thing when the groups share one lr).
- A tensor ``lr`` in a param group is updated in place (``fill_``), as torch's schedulers do,
  rather than replaced by a new one-element tensor; ``get_last_lr`` returns Python floats.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from torch.optim import Optimizer

from zero.lr_schedules.checks import (  # noqa: F401 - the package's names
    WARMUP_LINEAR_RATE,
    WARMUP_LOG_RATE,
    check_int,
    check_lr,
    check_number,
    check_warmup_type,
    per_group,
    torch_optimizer,
    warmup_fraction,
    write_lrs,
)

logger = logging.getLogger("zero.lr_schedules")  # the package's name, as before the split


# OneCycle replaces the second Adam beta with this constant while it cycles the first one.
# See [Note: OneCycle momentum].
_ONE_CYCLE_BETA2 = 0.99


class _BatchScheduler:
    """What all DeepSpeed-style schedulers share. See [Note: DeepSpeed step counting]."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: list[float] | None

    def get_lr(self) -> list[float]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _advance(self, batch_iteration: int | None) -> None:
        if batch_iteration is None:
            batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = batch_iteration
        self._last_lr = write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The learning rates last written to the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}: no learning rate computed yet; call step() first "
                f"(a scheduler resumed with last_batch_iteration != -1 writes nothing until then)"
            )
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": ...}``, the same dict DeepSpeed saves."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the next `step()` continues the saved sequence."""
        self.last_batch_iteration = sd["last_batch_iteration"]


# ---------------------------------------------------------------------------------------------
# LRRangeTest
# ---------------------------------------------------------------------------------------------


class LRRangeTest(_BatchScheduler):
    """Learning-rate range test: grow the lr from a base value at a fixed rate.

    At batch index ``i`` the lr is ``min_lr * (1 + step_rate * interval)`` with
    ``interval = (i + 1) / step_size``, floored to an integer when ``staircase`` is set. Used to
    find the largest lr that still trains, e.g. to choose OneCycle's bounds.

    Args:
        optimizer: the optimizer whose param groups are scheduled.
        lr_range_test_min_lr: starting lr, one number or one per param group. Default 1e-3.
        lr_range_test_step_size: batches per unit of ``interval``. Default 2000.
        lr_range_test_step_rate: growth per unit of ``interval``. Default 1.0.
        lr_range_test_staircase: grow in whole steps instead of continuously. Default False.
        last_batch_iteration: index of the last batch already trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        self.optimizer = torch_optimizer(optimizer, name)
        self.min_lr = per_group(name, "lr_range_test_min_lr", lr_range_test_min_lr,
                                 len(self.optimizer.param_groups))
        check_int(name, "lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        check_number(name, "lr_range_test_step_rate", lr_range_test_step_rate)
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(f"{name}: lr_range_test_staircase must be true or false, "
                             f"got {lr_range_test_staircase!r}")
        check_int(name, "last_batch_iteration", last_batch_iteration, minimum=-1)

        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._last_lr = write_lrs(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        """The lr of each param group at batch ``last_batch_iteration``."""
        growth = 1 + self.step_rate * self._interval()
        return [lr * growth for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to ``batch_iteration`` (default: the next batch) and write its lr."""
        self._advance(batch_iteration)


# ---------------------------------------------------------------------------------------------
# OneCycle
# ---------------------------------------------------------------------------------------------

# [Note: OneCycle momentum]
# With cycle_momentum, DeepSpeed cycles the *first Adam beta* inversely to the lr, between
# cycle_max_mom (at the lr minimum) and cycle_min_mom (at the lr peak), and writes
# group["betas"] = (momentum, 0.99): the second beta is replaced by 0.99 whatever the optimizer
# was built with. Optimizers without "betas" in their defaults (SGD, ...) are not cycled at all;
# a warning says so. We keep all of this so that runs match DeepSpeed's numbers.


class OneCycle(_BatchScheduler):
    """1Cycle policy: one triangular lr cycle, then an optional slow decay.

    During the cycle (batch index ``i < first + second``) the lr climbs linearly from
    ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` batches and falls back
    over ``cycle_second_step_size`` batches; the position is measured at ``i + 1``. A stair count
    holds the value flat on that many equal stairs per half. After the cycle the lr is
    ``cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` where ``d`` counts batches past
    the cycle starting at 1, and momentum is ``cycle_max_mom * (1 + decay_mom_rate * d /
    decay_step_size)``; with ``decay_step_size`` 0 or a zero rate the values stay at
    ``cycle_min_lr`` / ``cycle_max_mom``. See [Note: OneCycle momentum].

    Args:
        optimizer: the optimizer whose param groups are scheduled.
        cycle_min_lr: lr at the start and end of the cycle.
        cycle_max_lr: lr at the peak of the cycle.
        decay_lr_rate: post-cycle lr decay rate. Default 0.
        cycle_first_step_size: batches in the rising half. Default 2000.
        cycle_second_step_size: batches in the falling half; None means the same as the first.
        cycle_first_stair_count: stairs in the rising half; 0 means continuous. Default 0.
        cycle_second_stair_count: stairs in the falling half; None means the first's count.
        decay_step_size: batches per unit of post-cycle decay; 0 disables decay. Default 0.
        cycle_momentum: cycle the first Adam beta inversely to the lr. Default True.
        cycle_min_mom: momentum at the lr peak. Default 0.8.
        cycle_max_mom: momentum at the lr minimum. Default 0.9.
        decay_mom_rate: post-cycle momentum growth rate. Default 0.
        last_batch_iteration: index of the last batch already trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        self.optimizer = torch_optimizer(optimizer, name)
        check_lr(name, "cycle_min_lr", cycle_min_lr)
        check_lr(name, "cycle_max_lr", cycle_max_lr)
        for key, value in (("decay_lr_rate", decay_lr_rate), ("cycle_min_mom", cycle_min_mom),
                           ("cycle_max_mom", cycle_max_mom), ("decay_mom_rate", decay_mom_rate)):
            check_number(name, key, value)
        check_int(name, "cycle_first_step_size", cycle_first_step_size, minimum=1)
        if cycle_second_step_size is not None:
            check_int(name, "cycle_second_step_size", cycle_second_step_size, minimum=1)
        check_int(name, "cycle_first_stair_count", cycle_first_stair_count, minimum=0)
        if cycle_second_stair_count is not None:
            check_int(name, "cycle_second_stair_count", cycle_second_stair_count, minimum=0)
        check_int(name, "decay_step_size", decay_step_size, minimum=0)
        if not isinstance(cycle_momentum, bool):
            raise ValueError(f"{name}: cycle_momentum must be true or false, got {cycle_momentum!r}")
        check_int(name, "last_batch_iteration", last_batch_iteration, minimum=-1)

        # Cycle shape (sizes kept as floats: the position within the cycle is fractional).
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size

        num_groups = len(self.optimizer.param_groups)
        self.min_lrs = [cycle_min_lr] * num_groups
        self.max_lrs = [cycle_max_lr] * num_groups
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or math.isclose(decay_lr_rate, 0)

        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in getattr(self.optimizer, "defaults", {}):
            logger.warning("OneCycle: cycle_momentum is off because %s has no 'betas' to cycle",
                           type(self.optimizer).__name__)
            self.cycle_momentum = False
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = [(cycle_min_mom, _ONE_CYCLE_BETA2)] * num_groups
        self.max_moms = [(cycle_max_mom, _ONE_CYCLE_BETA2)] * num_groups
        self.skip_mom_decay = decay_step_size == 0 or math.isclose(decay_mom_rate, 0)

        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            for group, lr in zip(self.optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            if self.cycle_momentum:
                for group, betas in zip(self.optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale_factor(self) -> float:
        """Height within the cycle in [0, 1]: 0 at the ends, 1 at the peak."""
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer batch offset, not from `scale`: at a half-cycle edge the
            # float scale can sit a hair below a stair and flooring it would drop a whole stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        """The lr of each param group at batch ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decayed = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (decayed / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas of each param group at batch ``last_batch_iteration`` (None if not cycling)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decayed = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (decayed / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to ``batch_iteration`` (default: the next batch); write its lr and betas."""
        self._advance(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


# ---------------------------------------------------------------------------------------------
# WarmupLR, WarmupDecayLR
# ---------------------------------------------------------------------------------------------


class WarmupLR(_BatchScheduler):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At batch index ``i < W`` (``W = max(2, warmup_num_steps)``) the lr is
    ``min_lr + (max_lr - min_lr) * g`` with ``g = log(i + 1) / log(W)`` for "log" warmup or
    ``g = i / W`` for "linear"; from ``i = W`` on it is ``max_lr``. Before the first step the
    optimizer holds ``min_lr``.

    Args:
        optimizer: the optimizer whose param groups are scheduled.
        warmup_min_lr: lr at the start of warmup, one number or one per group. Default 0.
        warmup_max_lr: lr at the end of warmup, one number or one per group; None (default)
            means each group's current lr.
        warmup_num_steps: batches of warmup, a positive integer (1 acts as 2). Default 1000.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: index of the last batch already trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        self.optimizer = torch_optimizer(optimizer, name)
        groups = self.optimizer.param_groups
        check_int(name, "warmup_num_steps", warmup_num_steps, minimum=1)
        check_warmup_type(name, warmup_type)
        check_int(name, "last_batch_iteration", last_batch_iteration, minimum=-1)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]
        own = sorted({float(group["lr"]) for group in groups})
        if isinstance(warmup_max_lr, (int, float)) and len(own) > 1:  # e.g. Muon's muon_lr and adam_lr
            warnings.warn(f"{name}: warmup_max_lr={warmup_max_lr} becomes the lr of every param group, replacing "
                          f"their own lrs {own}; leave warmup_max_lr unset (WarmupLR then warms each group up to its "
                          f"own lr), or use WarmupCosineLR, which scales each group's own lr", stacklevel=3)
        self.min_lrs = per_group(name, "warmup_min_lr", warmup_min_lr, len(groups))
        self.max_lrs = per_group(name, "warmup_max_lr", warmup_max_lr, len(groups))
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._validate_extra(name)

        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._last_lr = write_lrs(groups, self.get_lr())

    def _validate_extra(self, name: str) -> None:
        """Checks a subclass adds; runs before the optimizer is written."""

    def _gamma(self) -> float:
        """Fraction of ``max_lr - min_lr`` to add at batch ``last_batch_iteration`` (>= 0)."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """The lr of each param group at batch ``last_batch_iteration`` (``min_lr`` before 0)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and write its lr."""
        self._advance(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    """WarmupLR followed by a linear decay that reaches ``warmup_min_lr`` at ``total_num_steps``.

    Warmup is WarmupLR's. From batch index ``i = W`` on the lr is
    ``min_lr + (max_lr - min_lr) * max(0, (T - i) / max(1, T - W))`` with ``T = total_num_steps``.

    Args:
        optimizer: the optimizer whose param groups are scheduled.
        total_num_steps: batches in the whole run; must be >= warmup_num_steps.
        warmup_min_lr: lr at the start of warmup and the end of decay. Default 0.
        warmup_max_lr: lr at the end of warmup, one number or one per group. Default 0.001.
        warmup_num_steps: batches of warmup, a positive integer (1 acts as 2). Default 1000.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: index of the last batch already trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _validate_extra(self, name: str) -> None:
        check_int(name, "total_num_steps", self.total_num_steps, minimum=1)
        if self.total_num_steps < self.warmup_num_steps:
            raise ValueError(
                f"{name}: total_num_steps ({self.total_num_steps}) is less than warmup_num_steps "
                f"({self.warmup_num_steps}); the decay would have no room. Raise total_num_steps "
                f"or use WarmupLR"
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


# ---------------------------------------------------------------------------------------------
# WarmupCosineLR
# ---------------------------------------------------------------------------------------------


class WarmupCosineLR(_BatchScheduler):
    """Warm up as a fraction of each group's lr, then follow a half cosine down to a floor.

    Each group's lr at construction is its peak ``lr0``; the scheduler writes ``lr0 * ratio``.
    At batch index ``i < W`` (``W = max(2, warmup_num_steps)``) the ratio is
    ``warmup_min_ratio + (1 - warmup_min_ratio) * g`` with WarmupLR's ``g``. From ``i = W`` on,
    with ``p = min(1, (i - W + 1) / max(1, T - W))``, it is
    ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``, which stays at
    ``cos_min_ratio`` once ``p`` reaches 1. Before the first step the optimizer holds lr 0.

    Args:
        optimizer: the optimizer whose param groups are scheduled; its lrs are the peaks.
        total_num_steps: batches in the whole run.
        warmup_min_ratio: ratio at the start of warmup. Default 0.
        warmup_num_steps: batches of warmup, a positive integer (1 acts as 2). Default 1000.
        cos_min_ratio: ratio at the end of the cosine. Default 0.0001.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: index of the last batch already trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        self.optimizer = torch_optimizer(optimizer, name)
        check_int(name, "total_num_steps", total_num_steps, minimum=1)
        check_number(name, "warmup_min_ratio", warmup_min_ratio)
        check_int(name, "warmup_num_steps", warmup_num_steps, minimum=1)
        check_number(name, "cos_min_ratio", cos_min_ratio)
        check_warmup_type(name, warmup_type)
        check_int(name, "last_batch_iteration", last_batch_iteration, minimum=-1)

        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]

        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._last_lr = write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The multiplier applied to every group's peak lr at batch ``last_batch_iteration``."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            g = warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        past_warmup = self.last_batch_iteration - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, past_warmup / decay_steps)
        half_cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self) -> list[float]:
        """The lr of each param group at batch ``last_batch_iteration`` (0 before the start)."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr0 * ratio for lr0 in self.org_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and write its lr."""
        self._advance(last_batch_iteration)

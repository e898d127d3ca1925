"""Loss scaling for fp16 training: static, or dynamic with DeepSpeed's hysteresis rules."""
from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """Training cannot go on: fp16 gradients overflow even at the minimum loss scale."""


class LossScaler:
    """The factor the loss is multiplied by before backward, and how it reacts to overflow.

    Dynamic scaling (`static_scale == 0`) starts at 2**initial_scale_power. An overflowing step
    is skipped; after `hysteresis` overflows (counted since the last time the counter was
    refilled) the scale is halved, never below `min_scale`. After `window` steps without
    overflow the scale doubles. With `consecutive_hysteresis`, every good step refills the
    hysteresis counter; otherwise it is refilled only when the scale doubles. These are
    DeepSpeed's rules, so a DeepSpeed fp16 run sees the same scales.

    Args:
        static_scale: a fixed scale (> 0), or 0 for dynamic scaling.
        initial_scale_power: dynamic scaling starts at 2**this.
        window: good steps before the scale doubles.
        hysteresis: overflows tolerated before the scale is halved.
        consecutive_hysteresis: refill the hysteresis counter on every good step.
        min_scale: lower bound of the dynamic scale.
        accumulation: micro-batches per optimizer step: the loss is multiplied by scale /
            accumulation (`loss_factor`), as DeepSpeed scales fp16 losses, so fp16 gradients keep
            the headroom a DeepSpeed run has and a static scale tuned there behaves the same.
    """

    def __init__(
        self,
        static_scale: float = 0.0,
        initial_scale_power: int = 16,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        accumulation: int = 1,
    ):
        self.dynamic = static_scale == 0
        self.scale = float(2**initial_scale_power) if self.dynamic else float(static_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self._hysteresis_left = hysteresis
        self._iteration = 0
        self._last_overflow = -1
        self.exhausted = False  # an overflow came when the scale could not be lowered any more
        self.accumulation = accumulation

    @property
    def loss_factor(self) -> float:
        """What a micro-batch's loss is multiplied by before backward: scale / accumulation."""
        return self.scale / self.accumulation

    @classmethod
    def disabled(cls) -> LossScaler:
        """A scale of exactly 1 that never changes (bf16 and fp32 training)."""
        return cls(static_scale=1.0)

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step that did (or did not) overflow."""
        self.exhausted = False
        if self.dynamic:
            if overflow:
                if self._hysteresis_left <= 1:
                    self.exhausted = self.scale <= self.min_scale
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self._hysteresis_left -= 1
                self._last_overflow = self._iteration
            else:
                if self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                if (self._iteration - self._last_overflow) % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self._hysteresis_left = self.hysteresis
                    self.scale *= 2
        self._iteration += 1

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)

    def load_progress(self, state: dict) -> None:
        """Take a saved dynamic scaler's progress (scale and counters), keeping this scaler's own
        settings; a static or disabled scaler (or a saved one that was) keeps its own state."""
        if self.dynamic and state.get("dynamic"):
            for key in ("scale", "_hysteresis_left", "_iteration", "_last_overflow", "exhausted"):
                if key in state:
                    setattr(self, key, state[key])

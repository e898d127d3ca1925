"""`deepspeed.runtime.zero.utils`."""


class ZeRORuntimeException(Exception):
    """Raised by DeepSpeed's ZeRO runtime; zero raises its own errors (RankDivergenceError, ...)."""

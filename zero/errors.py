"""The base of the errors zero's runtime raises while training (not for bad config or input, which
are ValueError/TypeError subclasses naming the key or argument)."""


class ZeroRuntimeError(RuntimeError):
    """Ranks diverged, a collective timed out, a parameter got no gradient, a checkpoint is broken.

    `deepspeed.runtime.zero.utils.ZeRORuntimeException` is this class, so a DeepSpeed script's
    `except ZeRORuntimeException` catches zero's runtime errors.
    """

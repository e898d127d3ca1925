"""Rank-agreement tags: what each rank says it is about to do before a collective whose place in
the program could differ between ranks (checked by `Comm.tagged`, zero/parallel/comm.py)."""
from __future__ import annotations

import enum
from collections.abc import Callable

from zero.errors import ZeroRuntimeError


class RankDivergenceError(ZeroRuntimeError):
    """Ranks reached different collectives (different modules, a skipped backward, an extra step)."""


# [Note: rank-agreement tags]
# Before a collective whose place in the program could differ between ranks, every rank
# all-gathers a small tag saying where it is, on the control group (`Comm.control`): four int64s,
# (what, a, b, engine), where `what` is a `Tag` and `engine` numbers the engines of the process in
# the order they were built (the same on every rank; 0 outside an engine), so two engines'
# collectives (a GAN's generator and discriminator) never pass for each other. Every
# control-group message has this one size, so a rank that is somewhere else shows up as a
# different tag, never as a size mismatch (which aborts gloo without a word). A mismatch raises
# RankDivergenceError on every rank, naming where each rank was.
#
# When: on gloo a tag is checked before its data collective is issued (mismatched sizes abort gloo
# without a word). On NCCL the collectives of a backward (bucket and unit reductions, unit
# gathers) are deferred: their tags are checked together at the end of the backward
# (`Comm.check_deferred`), so the CPU never waits for the other ranks per collective; NCCL does not
# check sizes, so there the check is best effort, and `enable_sanity_checks` (or
# TORCH_DISTRIBUTED_DEBUG=DETAIL) checks every tag before its collective. `Comm.tagged` is the one
# place that decides.
class Tag(enum.IntEnum):
    """What a rank-agreement tag says a rank is about to do (its `a` and `b` in `TAG_WORDS`)."""

    UNIT_FORWARD = 0  # a: the stage-3 unit
    UNIT_BACKWARD = 1
    UNIT_REDUCE = 2
    BUCKET_REDUCE = 3  # a: the bucket, b: its elements
    STEP = 4  # a: the optimizer step, b: backward passes since the last one
    GATHERED_PARAMETERS = 5  # a: parameters, b: their elements
    SAVE_16BIT_MODEL = 6
    END_OF_BACKWARD = 7  # a: groups with late gradients, b: groups
    INITIALIZE = 8  # a, b: a digest of the model and config
    SAVE_CHECKPOINT = 9  # b: a checksum of the tag name


TAG_WORDS = {
    Tag.UNIT_FORWARD: "forward of unit {a}",
    Tag.UNIT_BACKWARD: "backward of unit {a}",
    Tag.UNIT_REDUCE: "gradient reduction of unit {a}",
    Tag.BUCKET_REDUCE: "gradient reduction of bucket {a} ({b} elements)",
    Tag.STEP: "optimizer step {a} after {b} backward pass(es)",
    Tag.GATHERED_PARAMETERS: "GatheredParameters over {a} parameter(s) of {b} elements",
    Tag.SAVE_16BIT_MODEL: "saving the 16-bit model",
    Tag.END_OF_BACKWARD: "the end of a backward pass",
    Tag.INITIALIZE: "zero.initialize",
    Tag.SAVE_CHECKPOINT: "save_checkpoint (tag checksum {b})",
}
TAG_SIZE = 4
UNIT_TAGS = (Tag.UNIT_FORWARD, Tag.UNIT_BACKWARD, Tag.UNIT_REDUCE)  # tags whose `a` is a stage-3 unit


def describe_tag(row: list[int], unit_label: Callable[[int], str] | None = None, engine: bool = False) -> str:
    """Words for one rank's tag (see [Note: rank-agreement tags]); `engine` adds the engine number."""
    what, a, b, number = row
    if what in UNIT_TAGS and unit_label is not None:
        a = unit_label(a)
    words = TAG_WORDS[Tag(what)].format(a=a, b=b) if what in Tag._value2member_map_ else f"unknown tag {row}"
    return f"{words} of engine {number}" if engine else words

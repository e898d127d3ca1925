"""Bucket pack/unpack: many tensors into one contiguous bucket and back, with a dtype cast.

The bucketed reduce-scatter packs gradients into a bucket; the all-gather unpacks gathered
parameters out of one. CPU tensors use the C kernel (csrc/comm/pack.c), CUDA tensors the CUDA
kernel (csrc/comm/pack.cu): one launch for the whole list.

Non-contiguous tensors are handled, not refused: `pack` reads them through a contiguous copy,
and `unpack` writes into them through a contiguous temporary and `copy_`. The fast path is for
contiguous tensors, which is what the engine's flat buffers always give.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zero.ops.builder import load

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packed_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Element offsets that lay `tensors` back to back, in order, from element 0."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    return offsets


def _num_threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else int(num_threads)


def _check(tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int]) -> None:
    """Raise ValueError naming the offending tensor before any memory is touched."""
    if len(offsets) != len(tensors):
        raise ValueError(f"offsets has {len(offsets)} entries but there are {len(tensors)} tensors")
    if not bucket.is_contiguous():
        raise ValueError("bucket must be contiguous")
    bucket_is_float = bucket.dtype in FLOAT_DTYPES
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
        if t.device != bucket.device:
            raise ValueError(f"tensors[{i}] is on {t.device} but the bucket is on {bucket.device}")
        if (t.dtype in FLOAT_DTYPES) != bucket_is_float or (not bucket_is_float and t.dtype != bucket.dtype):
            raise ValueError(
                f"tensors[{i}] has dtype {t.dtype}, which cannot be cast to the bucket dtype {bucket.dtype}: "
                f"float32/float16/bfloat16 convert among themselves, other dtypes need an identical bucket dtype"
            )
        if off < 0 or off + t.numel() > bucket.numel():
            raise ValueError(
                f"tensors[{i}] ({t.numel()} elements at offset {off}) does not fit a bucket of {bucket.numel()} elements"
            )


def _op_for(device: torch.device):
    return load("pack_cuda") if device.type == "cuda" else load("pack")


def pack(
    tensors: Sequence[torch.Tensor],
    bucket: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    offsets: Sequence[int] | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Copy `tensors` into one contiguous 1-D bucket, converting each to the bucket's dtype.

    Args:
        tensors: tensors of any shape on one device; float32/float16/bfloat16 may be mixed.
        bucket: the destination; a new one is allocated when None.
        dtype: dtype of a newly allocated bucket (default: the first tensor's dtype).
        offsets: element offset of each tensor in the bucket (default: back to back from 0).
            Elements of the bucket not covered by a tensor are left as they are.
        num_threads: CPU threads to use (default: torch.get_num_threads()).

    Returns:
        The bucket.
    """
    tensors = list(tensors)
    offsets = packed_offsets(tensors) if offsets is None else list(offsets)
    if bucket is None:
        if not tensors:
            raise ValueError("pack() needs at least one tensor, or an explicit bucket")
        total = max((o + t.numel() for o, t in zip(offsets, tensors)), default=0)
        bucket = torch.empty(total, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
    _check(tensors, bucket, offsets)
    if not tensors:
        return bucket
    op = _op_for(bucket.device)
    op.pack([t.contiguous() for t in tensors], offsets, bucket.view(-1), _num_threads(num_threads))
    return bucket


def unpack(
    bucket: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    offsets: Sequence[int] | None = None,
    num_threads: int | None = None,
) -> None:
    """Copy slices of `bucket` into `tensors` in place, converting to each tensor's dtype.

    Args:
        bucket: contiguous source bucket.
        tensors: destinations; tensor i receives elements [offsets[i], offsets[i] + numel).
        offsets: as for `pack` (default: back to back from 0).
        num_threads: CPU threads to use (default: torch.get_num_threads()).
    """
    tensors = list(tensors)
    offsets = packed_offsets(tensors) if offsets is None else list(offsets)
    _check(tensors, bucket, offsets)
    if not tensors:
        return
    targets = [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    _op_for(bucket.device).unpack(bucket.view(-1), offsets, targets, _num_threads(num_threads))
    for t, tmp in zip(tensors, targets):
        if tmp is not t:
            t.copy_(tmp)

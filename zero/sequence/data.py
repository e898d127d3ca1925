"""Batches and losses for sequence parallelism: slice each batch's sequence over the group, and
average the loss over the whole sequence's tokens.

[Note: labels across slices]
A causal LM predicts token t+1 at position t. Slicing the sequence first and shifting inside each
slice would lose the prediction across every slice boundary, so the labels are shifted over the
whole sequence first (`shift_labels`: labels[t+1] at t, -100 at the end), padded to a multiple of
the group with -100 (ignored), and sliced with the inputs. Padding at the end changes nothing before
it under causal attention. `position_ids` keep each token's place in the whole sequence.

[Note: the loss over a group]
Each rank sees a slice. The whole sequence's mean loss is sum over ranks of (this slice's summed
token losses) / (valid tokens of the whole sequence). ZeRO averages gradients over all ranks, data
and sequence alike, so each rank's loss is that share times the group size: averaging over the group
then gives the whole-sequence mean, with slices of any number of valid tokens (padding and -100
labels included).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def sequence_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the whole sequence's mean cross-entropy (see [Note: the loss over a
    group]); `logits` [b, s_local, vocab], `shift_labels` [b, s_local] (-100: ignored). Collective
    over `group` (one all-reduce of the valid-token count)."""
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), shift_labels.reshape(-1),
                             ignore_index=IGNORE, reduction="sum")
    valid = (shift_labels != IGNORE).sum().to(torch.float32).reshape(1)
    size = 1
    if group is not None:
        from zero.sequence.ulysses import _comm

        _comm(group).all_reduce(valid, "sum", label="all_reduce (sequence loss tokens)")
        size = dist.get_world_size(group)
    return summed * size / valid.clamp(min=1).squeeze(0)


def shard_batch(batch: dict, rank: int, size: int) -> dict:
    """One rank's slice of a batch of [b, s] tensors (input_ids, labels, attention_mask,
    position_ids, ...): labels become `shift_labels`, shifted over the whole sequence; every [b, s]
    tensor is padded to a multiple of `size` and sliced; `position_ids` are the tokens' places in the
    whole sequence (see [Note: labels across slices])."""
    if "input_ids" not in batch:
        raise ValueError(f"a sequence-parallel batch needs input_ids; got keys {sorted(batch)}")
    ids = batch["input_ids"]
    b, s = ids.shape[:2]
    padded = -(-s // size) * size
    out = dict(batch)
    if "labels" in out:
        labels = out.pop("labels")
        out["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(s, device=ids.device).expand(b, s)
    elif s > 1 and bool((out["position_ids"].diff(dim=-1) != 1).any()):
        raise ValueError("shard_batch: position_ids restart inside a row (packed sequences), which sequence "
                         "parallelism does not support: the attention over the whole row is one causal sequence")
    part = slice(rank * padded // size, (rank + 1) * padded // size)
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (b, s):
            fill = IGNORE if key == "shift_labels" else 0
            if key == "position_ids" and padded != s:  # the padding continues each row's positions
                value = torch.cat([value, value[:, -1:] + torch.arange(1, padded - s + 1, device=value.device)], dim=1)
            elif padded != s:
                value = F.pad(value, (0, 0) * (value.dim() - 2) + (0, padded - s), value=fill)
            out[key] = value[:, part]
    return out


def _refuse_shared_batches(batches: list[dict]) -> None:
    """Each rank of a group must load its own batches: identical ones would be trained sp times."""
    ids = [b.get("input_ids") for b in batches]
    if all(isinstance(t, torch.Tensor) and t.shape == ids[0].shape and torch.equal(t, ids[0]) for t in ids[1:]):
        raise ValueError(
            "UlyssesSPDataLoaderAdapter: every rank of the sequence-parallel group loaded the same batch. The adapter "
            "trains each rank's batch in turn, so each would be trained sequence_parallel_size times: give each rank "
            "its own batches (a sampler over all ranks, e.g. DistributedSampler(dataset, num_replicas=world_size, "
            "rank=rank)). A loader that gives the group one shared batch (zero's initialize(training_data=...) and "
            "deepspeed_io shard by data-parallel rank) is sliced with zero.sequence.shard_batch instead")


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's `ulysses_sp.UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size,
    device)`: every rank's `dl` gives its own batches (a sampler over all ranks, as usual); for each
    of them the adapter gathers the batches of the whole sequence-parallel group and yields, one
    after the other in rank order, this rank's slice of each (`shard_batch`). The group trains each
    rank's batch together, so one pass over `dl` is sp_world_size x len(dl) micro-batches."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device=None):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size, self.device = dl, sp_rank, sp_group, sp_world_size, device

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        first = True
        for batch in self.dl:
            if not isinstance(batch, dict):
                raise TypeError(f"UlyssesSPDataLoaderAdapter slices dict batches (input_ids, labels, ...), got "
                                f"{type(batch).__name__}")
            group_batches = [batch]
            if self.sp_world_size > 1:
                from zero.sequence.ulysses import _comm

                on_host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                group_batches = _comm(self.sp_group).all_gather_object(on_host)
                if first:
                    _refuse_shared_batches(group_batches)
                first = False
            for each in group_batches:
                shard = shard_batch(each, self.sp_rank, self.sp_world_size)
                device = self.device if self.device is not None else batch["input_ids"].device
                yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}

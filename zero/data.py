"""The data loader `zero.initialize(training_data=...)` returns: a torch DataLoader over a
DistributedSampler that remembers where it is, so a checkpoint resumes mid-epoch.

[Note: resumable loader]
The sampler is a DistributedSampler on every world size (also a world of one), so each epoch's
order depends only on the seed and the epoch (`loader.sampler.set_epoch(epoch)`, as with torch).
The loader counts the batches it has handed out in the current pass; a checkpoint saves (epoch,
batches) and a resumed loader skips that many samples of the same epoch's order at its next pass.
"""
from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start its next pass `skip` samples in."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableLoader(DataLoader):
    """A DataLoader whose position in the epoch is saved with the checkpoint."""

    def __init__(self, dataset, *, batch_size: int, num_replicas: int, rank: int, collate_fn=None,
                 drop_last: bool = False):
        sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
        self.batches = 0  # batches handed out in the current pass (including skipped ones)

    def __iter__(self):
        start, self.batches = self.batches, self.batches
        self.sampler.skip = start * self.batch_size
        for batch in super().__iter__():
            self.batches += 1
            yield batch
        self.batches = 0  # the pass is complete: the next one starts at the beginning

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches": self.batches, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.sampler.seed = state["seed"]
        self.batches = state["batches"]


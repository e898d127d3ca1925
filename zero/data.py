"""The data loader `zero.initialize(training_data=...)` returns: a torch DataLoader over a
DistributedSampler that remembers where it is, so a checkpoint resumes mid-epoch.

[Note: resumable loader]
The sampler is a DistributedSampler on every world size (also a world of one), so each epoch's
order depends only on the seed and the epoch (`loader.sampler.set_epoch(epoch)`, as with torch).
The loader counts the batches it has handed out in the current pass; a checkpoint saves (epoch,
batches) and the samples all ranks took in the pass, and a resumed loader skips that many samples
of the same epoch's order at its next pass. Rank r of W takes the samples at r, r + W, r + 2W, ...
of the epoch's order, so after S samples in all each rank has taken S / W: a loader on another
number of ranks (an elastic restart) resumes where the whole job was, and each of its steps takes
the next train_batch_size samples of the order, the same ones the old ranks would have taken
(except in the epoch's last step, where DistributedSampler pads the order to a multiple of W).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator

from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start its next pass `skip` samples in, and that moves to the next
    epoch by itself after a complete pass unless `set_epoch` is called (so a world of one reshuffles
    every epoch, as a plain shuffling DataLoader does)."""

    skip = 0
    _epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._epoch_set = True

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
        self._resume_at = 0  # set by load_state_dict: where the next pass starts, in this rank's samples
        self.post_process_func = None  # DeepSpeed's: applied to each batch (engine.set_data_post_process_func)

    def __iter__(self):
        skip, self._resume_at = self._resume_at, 0
        self.batches, self.sampler.skip, self._skipped = skip // self.batch_size, skip, skip
        chosen, self.sampler._epoch_set = self.sampler._epoch_set, False
        for batch in super().__iter__():
            self.batches += 1
            yield batch if self.post_process_func is None else self.post_process_func(batch)
        self.batches = self._skipped = 0
        if not chosen and not self.sampler._epoch_set:  # a complete pass: the next one is the next epoch
            self.sampler.epoch += 1

    _skipped = 0  # samples of this rank skipped at the pass's start (a resumed position)

    def taken(self) -> int:
        """Samples of the pass this rank has taken: those skipped at its start and those of the
        batches handed out since (the last one may be short)."""
        handed = self.batches - self._skipped // self.batch_size
        return min(self._skipped + handed * self.batch_size, self.sampler.num_samples)

    def state_dict(self) -> dict:
        """The position: (epoch, seed) and this rank's batches of the pass, and the samples of the
        pass all ranks took together, which a loader on another number of ranks resumes from."""
        taken = self._resume_at or self.taken()  # loaded but not iterated yet: the loaded position
        return {"epoch": self.sampler.epoch, "batches": taken // self.batch_size if self._resume_at else self.batches,
                "seed": self.sampler.seed, "samples": taken * self.sampler.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position; on another number of ranks or batch size (an elastic
        restart, see [Note: resumable loader]) at the same sample of the epoch's order."""
        self.sampler.epoch = state["epoch"]  # not set_epoch: the pass's end still moves on to the next epoch
        self.sampler.seed = state["seed"]
        samples = state.get("samples")
        if samples is None:  # a checkpoint from before the samples were saved: same ranks and batch size
            self._resume_at = state["batches"] * self.batch_size
            return
        ranks = self.sampler.num_replicas
        if samples % ranks:
            warnings.warn(f"the checkpoint's data loader had taken {samples} samples of the epoch, which the "
                          f"{ranks} ranks of this run cannot split evenly: it resumes at sample "
                          f"{samples // ranks * ranks}, so {samples % ranks} sample(s) are seen twice", stacklevel=2)
        self._resume_at = samples // ranks


class RepeatingLoader:
    """Iterate `loader` forever, starting it again (a new epoch) when it runs out: the endless
    micro-batch stream a pipeline engine's `train_batch` draws from (DeepSpeed's RepeatingLoader)."""

    def __init__(self, loader):
        self.loader = loader
        self._epoch = 0
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self._epoch)
            self._it = iter(self.loader)
            return next(self._it)

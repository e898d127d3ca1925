"""Loading only a rank's slab (zero/spatial/data.py, docs/spatial.md): `slab_bounds` is the split
`shard_volume` cuts, `SlabCollate` hands each rank `shard_volume` of the whole batch (in worker
processes too), `read_slab` asks a file for the rank's planes only, and the engine's loaders give
every rank of a spatial group the same samples."""
import pickle

import numpy as np
import pytest
import torch

import zero.spatial as sp
from zero.spatial import SpatialRank


def _bounds_against_shard_volume(lengths):
    from zero.parallel.comm import Comm

    comm = Comm()
    out = []
    for length in lengths:
        full = torch.arange(length * 6, dtype=torch.float32).view(1, 2, length, 3)
        start, stop = sp.slab_bounds(length, comm)
        out.append(((start, stop), torch.equal(full[:, :, start:stop], sp.shard_volume(full, comm))))
    return comm.world_size, comm.rank, out


@pytest.mark.parametrize("ranks", [2, 3])
def test_slab_bounds_are_the_planes_shard_volume_cuts_even_and_uneven(dist_run, ranks):
    lengths = [12, 13, 7, ranks]
    results = sorted(dist_run(ranks, _bounds_against_shard_volume, lengths))
    for length_index, length in enumerate(lengths):
        slabs = [r[2][length_index] for r in results]
        assert all(same for _, same in slabs), (ranks, length)
        bounds = [b for b, _ in slabs]
        assert bounds[0][0] == 0 and bounds[-1][1] == length  # the slabs tile the dimension in rank order
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_a_rank_without_a_plane_is_refused_by_name():
    assert sp.slab_bounds(5, SpatialRank(0, 1)) == (0, 5)  # a group of one: everything
    with pytest.raises(sp.SpatialError, match=r"2 plane\(s\) cannot give each of the 3 spatial ranks.*rank 2"):
        sp.slab_bounds(2, SpatialRank(2, 3))
    with pytest.raises(sp.SpatialError, match=r"batch\['image'\] of shape \(1, 1, 2, 4\)"):
        sp.SlabCollate(comm=SpatialRank(2, 3))([{"image": torch.zeros(1, 2, 4)}])


def test_slab_collate_cuts_only_volumes_or_only_the_keys_asked_for():
    place = SpatialRank(1, 2)
    samples = [{"image": torch.randn(1, 5, 4, 3), "label": torch.randn(1, 5, 4, 3), "id": i, "size": torch.ones(3)}
               for i in range(2)]
    batch = sp.SlabCollate(comm=place)(samples)
    assert batch["image"].shape == (2, 1, 2, 4, 3) and batch["label"].shape == (2, 1, 2, 4, 3)
    assert torch.equal(batch["image"], torch.stack([s["image"] for s in samples])[:, :, 3:])
    assert batch["size"].shape == (2, 3) and batch["id"].tolist() == [0, 1]  # not volumes: as collated
    only = sp.SlabCollate(keys=["image"], comm=place)(samples)
    assert only["image"].shape == (2, 1, 2, 4, 3) and only["label"].shape == (2, 1, 5, 4, 3)
    with pytest.raises(sp.SpatialError, match=r"the batch has no \['mask'\]"):
        sp.SlabCollate(keys=["mask"], comm=place)(samples)
    with pytest.raises(sp.SpatialError, match=r"batch\['size'\] has shape \(2, 3\), no dimension 2"):
        sp.SlabCollate(keys=["size"], comm=place)(samples)
    with pytest.raises(sp.SpatialError, match="not a dict"):
        sp.SlabCollate(keys=["image"], comm=place)([(torch.zeros(1, 4, 4), 0)])


def test_slab_collate_without_a_group_is_refused_until_there_is_one(monkeypatch):
    import zero.spatial

    monkeypatch.setattr(zero.spatial, "_current", None)  # no group in this process (an earlier test's goes back after)
    collate = sp.SlabCollate()  # before initialize: built, the group looked up at first use
    with pytest.raises(sp.SpatialError, match="no spatial group yet.*SpatialRank.of"):
        collate([torch.zeros(1, 4, 4)])


def _whole_and_slabs(collate, comm, num_workers=0):
    """(every batch equals shard_volume of the whole batch, its labels are whole, its storage is the slab's own)"""
    from torch.utils.data import DataLoader, TensorDataset

    full = torch.randn(6, 1, 7, 4, 5, generator=torch.Generator().manual_seed(0))  # 7 planes: uneven slabs
    labels = torch.arange(6)
    loader = DataLoader(TensorDataset(full, labels), batch_size=3, collate_fn=collate, num_workers=num_workers,
                        multiprocessing_context="spawn" if num_workers else None)  # spawn: pickled, no group inherited
    out = []
    for i, (x, y) in enumerate(loader):
        out.append(torch.equal(x, sp.shard_volume(full[3 * i:3 * i + 3], comm)) and torch.equal(y, labels[3 * i:3 * i + 3])
                   and x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * x.element_size())
    return out


def _loader_slabs():
    from zero.parallel.comm import Comm

    comm = Comm()
    return _whole_and_slabs(sp.SlabCollate(comm=comm), comm)


def test_a_loader_with_slab_collate_gives_each_rank_shard_volume_of_the_batch(dist_run):
    for slabs in dist_run(2, _loader_slabs):
        assert slabs == [True, True]


def test_slab_collate_takes_its_ranks_place_into_a_worker_process(monkeypatch):
    import zero.spatial

    place = SpatialRank(1, 2)  # stands for the group initialize made (gloo ranks cannot start loader workers)
    from zero.spatial.layers import Plan

    monkeypatch.setattr(zero.spatial, "_current", Plan(place, (2,), (place,)))  # what parallelize keeps
    collate = sp.SlabCollate()
    assert pickle.loads(pickle.dumps(collate)).place == place
    assert _whole_and_slabs(collate, place, num_workers=1) == [True, True]


class _Recording:
    """A lazily read array that records what it is asked for."""

    def __init__(self, array):
        self.array, self.asked = array, []

    @property
    def shape(self):
        return self.array.shape

    def __getitem__(self, index):
        self.asked.append(index)
        return self.array[index]


def _read_slabs(path):
    from zero.parallel.comm import Comm

    comm = Comm()
    disk = _Recording(np.load(path, mmap_mode="r"))
    slab = sp.read_slab(disk, 1, comm)  # a (C, D, H, W) file: D is dimension 1
    last = sp.read_slab(np.load(path, mmap_mode="r"), -3, comm)  # the same, counted from the end
    whole = torch.from_numpy(np.load(path))
    expected = sp.shard_volume(whole[None], comm)[0]  # dimension 2 of the batch
    mapped = disk.array.ctypes.data, disk.array.ctypes.data + disk.array.nbytes
    own = slab.is_contiguous() and not mapped[0] <= slab.data_ptr() < mapped[1]  # a copy, not a view of the file
    return torch.equal(slab, expected) and torch.equal(last, expected) and own, disk.asked, sp.slab_bounds(7, comm)


def test_read_slab_reads_only_the_ranks_planes_of_a_memmapped_file(dist_run, tmp_path):
    path = tmp_path / "volume.npy"
    np.save(path, np.random.default_rng(0).standard_normal((2, 7, 3, 4)).astype(np.float32))
    for same, asked, (start, stop) in dist_run(2, _read_slabs, str(path)):
        assert same
        assert asked == [(slice(None), slice(start, stop))]  # one request, for the slab's planes only


def test_read_slab_converts_big_endian_and_refuses_a_dimension_the_source_lacks(tmp_path):
    path = tmp_path / "big.npy"
    data = np.arange(2 * 5 * 3, dtype=">i2").reshape(2, 5, 3)
    np.save(path, data)
    slab = sp.read_slab(np.load(path, mmap_mode="r"), 1, SpatialRank(0, 2))
    assert slab.dtype == torch.int16 and slab.tolist() == data[:, :3].tolist()
    assert torch.equal(sp.read_slab(torch.arange(10).view(2, 5), 1, SpatialRank(1, 2)), torch.tensor([[3, 4], [8, 9]]))
    with pytest.raises(sp.SpatialError, match=r"dim 3 is not a dimension of a source of shape \(2, 5, 3\)"):
        sp.read_slab(data, 3, SpatialRank(0, 2))


def _engine_samples():
    from torch.utils.data import TensorDataset

    import zero
    import zero.deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "spatial_parallel_size": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    data = TensorDataset(torch.arange(10))
    out = {}
    engine, _, loader, _ = zero.initialize(model=torch.nn.Conv3d(1, 1, 3, padding=1), config=config, training_data=data)
    out["initialize"] = [b[0].tolist() for b in loader]
    engine.destroy()
    engine, _, _, _ = zero.deepspeed.initialize(model=torch.nn.Conv3d(1, 1, 3, padding=1), config=config)
    out["deepspeed_io"] = [b[0].tolist() for b in engine.deepspeed_io(data)]
    engine.destroy()
    return out


def test_the_ranks_of_a_spatial_group_load_the_same_samples(dist_run):
    first, second = dist_run(2, _engine_samples)
    for name in ("initialize", "deepspeed_io"):
        assert first[name] == second[name], name
        assert sorted(i for batch in first[name] for i in batch) == list(range(10))  # the group takes every sample


def _docs_example(folder):
    import os
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "spatial.md").read_text()
    code = text.split("## Loading only a rank's slab", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    here = os.getcwd()
    os.chdir(folder)
    try:
        space = {"__name__": "slabs"}
        exec(compile(code, "docs/spatial.md", "exec"), space)
    finally:
        os.chdir(here)
    space["engine"].destroy()
    return tuple(space["x"].shape), space["loss"].item()


def test_the_docs_example_reads_each_ranks_slab(dist_run, tmp_path):
    (shape, loss), (other_shape, other_loss) = dist_run(2, _docs_example, str(tmp_path))
    assert shape == other_shape == (2, 1, 8, 8, 8)  # half of the 16 planes each
    assert loss == other_loss  # the whole volume's loss on both ranks

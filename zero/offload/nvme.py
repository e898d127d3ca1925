"""NVMe offload (ZeRO-Infinity): the optimizer state in files, the host step on tiles read ahead of
it and written back behind it.

[Note: NVMe data path]
Each rank keeps one swap file in `nvme_path` (`zero-swap-<host>-r<rank>-<pid>-<n>/state.bin`).
Every state tensor the store allocates (a master, a moment, 8-bit scales) is a 4 KiB-aligned
region of it, reserved with fallocate when the tensor is made (a full disk fails there, naming the
file, before training starts) and mapped into memory: the tensor the storages, checkpoints and
accessors hold is that mapping, so they read and write it like any host tensor, through the page
cache, without knowing where it lives. Nothing in the step goes through the mapping:
1. The host step (zero/offload/host.py) walks the rank's slots in tiles of `sub_group_size`
   elements (`walk` below). Each tile's master and states are read with the aio op
   (zero/ops/aio.py: threads doing pread/pwrite, O_DIRECT where the request is aligned) into one of
   `buffer_count` host buffers, ahead of the tile being stepped (`pipeline_read`).
2. The CPU Adam updates the tile in its buffer, exactly as in host memory: the same kernel on the
   same numbers and tiles, so a run equals its CPU-offload twin bit for bit.
3. The buffer is written back to the same regions (`pipeline_write`: while the next tile is
   stepped) and reused once the write finished. The walk ends when every write has.
O_DIRECT transfers bypass the page cache, so the step holds `buffer_count` tiles of host memory,
not the state. The kernel keeps the mapping and direct transfers coherent (a direct read writes
back dirty mapped pages first; a direct write drops cached ones). Reads and writes that are not
4 KiB aligned (a tensor's tail, small tiles) and filesystems without O_DIRECT go through the page
cache, which also stays coherent.

Files are scratch: they live while the store does and are removed with it, and a restarted run
resumes from its checkpoint (which holds the state like any other: zero/checkpoint/), never from a
swap file. Swap directories of processes that no longer run are removed when a new store starts.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import errno
import mmap
import os
import shutil
import socket
import time
import weakref
from collections.abc import Iterator
from itertools import count

import torch

from zero.offload.policy import NVMeOffload
from zero.offload.store import STATE_KINDS, StateStore
from zero.ops.aio import ALIGNMENT, AsyncIO, DataFile, aligned_empty

_stores = count()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


REGION = max(ALIGNMENT, mmap.ALLOCATIONGRANULARITY)  # a region's offset: a direct-I/O block, and mappable (64 KiB
# pages on some aarch64 kernels)


def _aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def region_bytes(nbytes: int) -> int:
    """Bytes a tensor of `nbytes` takes in a swap file (its region starts where a direct transfer and
    a mapping may)."""
    return _aligned(nbytes, REGION)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(root: str, host: str) -> None:
    """Remove swap directories this host's processes left behind when they were killed."""
    prefix = f"zero-swap-{host}-"
    for name in os.listdir(root):
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-")[1])
        except (IndexError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still write on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def state_bytes(elements: dict[int, int], specs, master_dtype: torch.dtype) -> int:
    """Bytes the optimizer state of this rank takes in its swap file.

    Args:
        elements: param group -> elements of it this rank keeps state for.
        specs: param group -> the state its rule declares (see [Note: declared state] in
            zero/optim/rules.py).
        master_dtype: the master weights' dtype.
    """
    return sum(_nbytes(n, master_dtype) + sum(_nbytes(spec.numel(n), spec.dtype) for spec in specs(g)
                                              if spec.per != "scalar") for g, n in elements.items() if n)


def _nbytes(n: int, dtype: torch.dtype) -> int:
    return region_bytes(n * torch.empty((), dtype=dtype).element_size())


def check_room(needs: list[tuple[str, int, str, str]]) -> None:
    """Refuse a run whose swap files do not fit their drives, before anything is built.

    Args:
        needs: (directory, bytes this rank keeps there, what they are, the config key naming the
            directory), for the optimizer state and the parameters; directories on one filesystem
            share its free space, and the ranks of this host share the drive.
    """
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    by_fs: dict[int, list[tuple[str, int, str, str]]] = {}
    for need in needs:
        by_fs.setdefault(os.stat(need[0]).st_dev, []).append(need)
    for group in by_fs.values():
        total, free = sum(need[1] for need in group), free_bytes(group[0][0])
        if total * ranks > free:
            what = " and ".join(f"{n / 2**30:.2f} GiB for this rank's {w} in {path} ({key})" for path, n, w, key in group)
            raise OSError(errno.ENOSPC, f"zero: NVMe offload needs {what} (x {ranks} ranks on this host), and "
                                        f"{free / 2**30:.2f} GiB are free there: free space, or choose another drive")


def _close(f: DataFile, io: AsyncIO, directory: str) -> None:
    io.close()
    f.close()
    shutil.rmtree(directory, ignore_errors=True)


class SwapFile:
    """One swap file of this rank in `root` (its own directory,
    `zero-swap-<host>-r<rank>-<pid>-<n>/<name>`), the tensors mapped from its regions, and the I/O
    threads that read and write them (see [Note: NVMe data path]).

    Args:
        root: the directory (`nvme_path`).
        name: the file's name in its directory.
        threads, queue_depth, block_size: the `aio` section (zero/ops/aio.py).
    """

    def __init__(self, root: str, name: str, threads: int, queue_depth: int, block_size: int):
        host = socket.gethostname().replace("-", "_")
        _remove_stale(root, host)
        self.directory = os.path.join(root, f"zero-swap-{host}-r{_rank()}-{os.getpid()}-{next(_stores)}")
        os.makedirs(self.directory)
        self.file = DataFile(os.path.join(self.directory, name))
        self.io = AsyncIO(threads, queue_depth, block_size)
        self.size = 0  # bytes reserved in the file
        self._starts: list[int] = []  # address of each mapped region, sorted
        self._regions: list[tuple[int, int, int]] = []  # (address, bytes, file offset), in that order
        self._finalizer = weakref.finalize(self, _close, self.file, self.io, self.directory)

    def close(self) -> None:
        """Stop the I/O threads and remove the file; mapped tensors stay readable until dropped."""
        self._finalizer()

    def new(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero tensor in a new region of the file: reserved on disk now (a full disk fails here,
        naming the file) and mapped into memory."""
        numel = 1
        for n in shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,):
            numel *= int(n)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        offset, size = self.size, region_bytes(nbytes)
        self.file.reserve(offset, size)  # zeros, on disk now
        self.size += size
        region = mmap.mmap(self.file.fd, size, offset=offset)
        t = torch.frombuffer(region, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
        at = bisect.bisect(self._starts, t.data_ptr())
        self._starts.insert(at, t.data_ptr())
        self._regions.insert(at, (t.data_ptr(), nbytes, offset))
        return t

    def _region(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """(address, bytes, file offset) of the mapped region `t` lies in, or None."""
        i = bisect.bisect(self._starts, t.data_ptr()) - 1
        return self._regions[i] if i >= 0 and t.data_ptr() < self._regions[i][0] + self._regions[i][1] else None

    def holds(self, t: torch.Tensor) -> bool:
        """Is `t` (a view of) one of this file's mapped regions?"""
        return self._region(t) is not None

    def offset(self, t: torch.Tensor) -> int:
        """The file offset of tensor `t` (a view of a mapped region)."""
        region, addr = self._region(t), t.data_ptr()
        if region is None or addr + t.numel() * t.element_size() > region[0] + region[1]:
            raise RuntimeError(f"zero: a tensor at {addr:#x} is not in the swap file {self.file.path}")
        return region[2] + addr - region[0]

    def read(self, buf: torch.Tensor, t: torch.Tensor):
        """Start reading the values of mapped tensor `t` into `buf` (a Request)."""
        return self.io.read(self.file, buf, self.offset(t))

    def write(self, buf: torch.Tensor, t: torch.Tensor):
        """Start writing `buf` to where mapped tensor `t` lies in the file (a Request)."""
        return self.io.write(self.file, buf, self.offset(t))


class FileStore(StateStore):
    """The optimizer state of one storage in a swap file (see [Note: NVMe data path])."""

    policy: NVMeOffload

    def __init__(self, policy: NVMeOffload, device: torch.device, owner: object, step_number):
        super().__init__(policy, device, owner, step_number)
        self.swap = SwapFile(policy.path, "state.bin", policy.threads, policy.queue_depth, policy.block_size)
        self._buffers: list[torch.Tensor] = []
        self.times = {"read_wait": 0.0, "write_wait": 0.0}
        self.bytes = {"read": 0, "written": 0}  # since the start
        self.step_bytes = {"read": 0, "written": 0}  # in the last walk (one optimizer step)

    @property
    def io(self) -> AsyncIO:
        return self.swap.io

    @property
    def size(self) -> int:
        """Bytes reserved in the swap file."""
        return self.swap.size

    def close(self) -> None:
        """Stop the I/O threads and remove the swap files (`engine.destroy()`; else when the store is
        collected, or at exit). The mapped state stays readable until it is dropped."""
        self.swap.close()

    def host_kinds(self) -> set[str]:
        return set(STATE_KINDS)

    def disk_kinds(self) -> set[str]:
        return set(STATE_KINDS)

    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def in_files(self, t: torch.Tensor) -> bool:
        return self.swap.holds(t)

    def new(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero tensor of state in a new region of the swap file (see [Note: NVMe data path])."""
        return self.swap.new(shape, dtype)

    # -- the host step's walk

    def _segments(self, view) -> list[tuple[str | None, torch.Tensor]]:
        """(state name or None for the master, mapped tensor) of one tile that live in the file."""
        out = [(None, view.master)]
        out += [(spec.name, view.state[spec.name]) for spec in view.specs if spec.per != "scalar"]
        return [(name, t) for name, t in out if t.numel() > 0]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A tile buffer of `nbytes` (aligned for O_DIRECT; page-locked for the GPU copies when asked)."""
        buf = aligned_empty(nbytes)
        if self.policy.pin_memory:
            self.memory.register(buf)
        return buf

    def _tile_bytes(self, slot, lo: int, hi: int) -> int:
        view = slot.tile(lo, hi, slot.grad, None)
        return sum(_aligned(t.numel() * t.element_size()) for _, t in self._segments(view))

    def walk(self, work: list[tuple]) -> Iterator[tuple]:
        """See StateStore.walk and [Note: NVMe data path]."""
        if not work:
            return
        before = dict(self.bytes)
        need = max(self._tile_bytes(slot, lo, hi) for slot, lo, hi in work)
        count_ = max(1, self.policy.buffer_count)
        if len(self._buffers) != count_ or self._buffers[0].numel() < need:
            self._buffers = [self._buffer(need) for _ in range(count_)]
        free = list(self._buffers)
        reads: collections.deque = collections.deque()  # (view, tile tensors, requests)
        writes: collections.deque = collections.deque()  # (buffer, requests)
        ahead = 0  # index of the next tile to read
        try:
            for i, (slot, lo, hi) in enumerate(work):
                while ahead < len(work) and (ahead == i or self.policy.pipeline_read):
                    if not free:
                        if ahead > i:
                            break  # no buffer to read further ahead: go on
                        self._finish(writes.popleft(), free)  # the oldest write frees its buffer
                        continue
                    reads.append(self._read(*work[ahead], free.pop()))
                    ahead += 1
                view, segments, buf, requests = reads.popleft()
                self.times["read_wait"] += _wait_all(requests)
                tile = dataclasses.replace(view, master=segments.get(None, view.master),
                                           state={**view.state, **{k: v for k, v in segments.items() if k}})
                yield slot, lo, hi, lambda grad, out16, tile=tile: dataclasses.replace(tile, grad=grad, out16=out16)
                start = time.perf_counter()
                mapped = self._segments(view)
                writes.append((buf, [self.swap.write(segments[name], t) for name, t in mapped]))
                self.bytes["written"] += sum(t.numel() * t.element_size() for _, t in mapped)
                self.times["write_wait"] += time.perf_counter() - start  # submitting: never waits for the drive
                if not self.policy.pipeline_write:
                    self._finish(writes.popleft(), free)
                while writes and all(r.done() for r in writes[0][1]):
                    self._finish(writes.popleft(), free)
            while writes:
                self._finish(writes.popleft(), free)
            self.step_bytes = {k: self.bytes[k] - before[k] for k in self.bytes}
        finally:  # an error (or an update that raised): no transfer may outlive its buffer
            for _, _, _, requests in reads:
                _settle(requests)
            for _, requests in writes:
                _settle(requests)

    def _read(self, slot, lo: int, hi: int, buf: torch.Tensor):
        """Start reading tile [lo, hi) of `slot` into `buf`: (the tile's mapped view, its buffer
        segments by state name, the buffer, the requests)."""
        view = slot.tile(lo, hi, slot.grad, None)
        segments, requests, at = {}, [], 0
        for name, t in self._segments(view):
            nbytes = t.numel() * t.element_size()
            seg = buf[at:at + nbytes].view(t.dtype).view(t.shape)
            segments[name] = seg
            requests.append(self.swap.read(seg, t))
            self.bytes["read"] += nbytes
            at += _aligned(nbytes)
        return view, segments, buf, requests

    def _finish(self, write: tuple, free: list) -> None:
        buf, requests = write
        self.times["write_wait"] += _wait_all(requests)
        free.append(buf)


def _wait_all(requests) -> float:
    """Wait for every request (all of them, also after one failed) and return the seconds waited."""
    start = time.perf_counter()
    try:
        for r in requests:
            r.wait()
    except OSError:
        _settle(requests)
        raise
    return time.perf_counter() - start


def _settle(requests) -> None:
    """Wait for every request, keeping quiet about their errors (one is already being raised)."""
    for r in requests:
        try:
            r.wait()
        except OSError:
            pass

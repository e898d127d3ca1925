"""Asynchronous reads and writes of file ranges into host tensors: the I/O of NVMe offload.

`AsyncIO` is a pool of I/O threads (the native op, csrc/aio/aio.c; Python threads where it cannot
be built, see [Note: native-op fallback] in zero/ops/fallback.py). `DataFile` is one file open
twice: with O_DIRECT where the filesystem allows it (no page cache: the disk's own speed, no host
memory taken by cached pages) and buffered for what O_DIRECT refuses (unaligned tails, tmpfs on
older kernels). `aligned_empty` makes host buffers whose address O_DIRECT takes.

    io = AsyncIO(threads=4, queue_depth=32, block_size=1 << 20)
    f = DataFile.create(path, nbytes)          # preallocated: a full disk fails here, not mid-run
    io.write(f, buf, offset).wait()            # raises OSError naming the file and the offset

Every request is waited for before its buffer is reused or freed; an error surfaces at `wait` as
an OSError with the errno, the file, the offset and the direction.
"""
from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zero.ops.builder import load
from zero.ops.fallback import run_native

ALIGNMENT = 4096  # O_DIRECT's buffer, offset and length granularity on every common device and filesystem
EOF_CODE = -1  # csrc/aio/aio.h ZERO_AIO_EOF


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> torch.Tensor:
    """An uninitialised uint8 host tensor of `nbytes` whose first byte is `alignment`-aligned."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    skip = -raw.data_ptr() % alignment
    return raw[skip:skip + nbytes]


def _error(code: int, what: str, path: str, offset: int, nbytes: int, at: int) -> OSError:
    where = f"{what} {nbytes} bytes at offset {offset} of {path}"
    if code == EOF_CODE:
        return OSError(errno.EIO, f"zero aio: {where}: the file ends at {at}, before them (it was truncated or "
                                  f"replaced while the run used it)")
    return OSError(code, f"zero aio: {where} failed at offset {at}: {os.strerror(code)}")


class DataFile:
    """A file open for positioned I/O: `fd_direct` (O_DIRECT, or -1 where the filesystem refuses
    it) and `fd` (buffered).

    Args:
        path: the file (created if missing).
        direct: try O_DIRECT (False: buffered only).
    """

    def __init__(self, path: str | os.PathLike, direct: bool = True):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.fd_direct = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd_direct = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError:  # EINVAL: this filesystem has no O_DIRECT (older tmpfs, some FUSE)
                self.fd_direct = -1

    @classmethod
    def create(cls, path: str | os.PathLike, nbytes: int, direct: bool = True) -> DataFile:
        """A new file of `nbytes` bytes, reserved on disk now (a full disk fails here with ENOSPC
        naming the file and the size, not in the middle of a step)."""
        f = cls(path, direct)
        f.reserve(0, nbytes)
        return f

    def reserve(self, offset: int, nbytes: int) -> None:
        """Allocate [offset, offset + nbytes) on disk (zeros where new)."""
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
        except OSError as exc:
            free = _free_bytes(os.path.dirname(self.path) or ".")
            raise OSError(exc.errno, f"zero: reserving {nbytes} bytes at offset {offset} of {self.path} failed: "
                                     f"{os.strerror(exc.errno)} ({free / 2**30:.2f} GiB free there)",
                          self.path) from None

    def close(self) -> None:
        for fd in (self.fd_direct, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.fd_direct = -1

    def __del__(self):
        if getattr(self, "fd", -1) >= 0:
            self.close()


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Request:
    """One read or write in flight; `wait()` blocks until it is over and raises its error."""

    def __init__(self, io: AsyncIO, handle, what: str, path: str, offset: int, nbytes: int, keep):
        self.io, self.handle, self.what, self.path, self.offset, self.nbytes = io, handle, what, path, offset, nbytes
        self.keep = keep  # the buffer, alive until the request is over

    def done(self) -> bool:
        if self.handle is None:
            return True
        if isinstance(self.handle, Future):
            return self.handle.done()
        return bool(self.io.lib.c.zero_aio_done(self.io.pool, self.handle))

    def wait(self) -> None:
        handle, self.handle = self.handle, None
        if handle is None:
            return
        if isinstance(handle, Future):
            code, at = handle.result()
        else:
            at = ctypes.c_int64(0)
            code = self.io.lib.c.zero_aio_wait(self.io.pool, handle, ctypes.byref(at))
            at = at.value
        self.keep = None
        if code:
            raise _error(code, self.what, self.path, self.offset, self.nbytes, at)


class AsyncIO:
    """A pool of I/O threads.

    Args:
        threads: transfers in parallel (the `aio` section's `intra_op_parallelism`).
        queue_depth: blocks queued at most (`queue_depth`).
        block_size: bytes per transfer (`block_size`).
    """

    def __init__(self, threads: int = 1, queue_depth: int = 8, block_size: int = 1 << 20):
        if threads < 1 or queue_depth < 1 or block_size < 1:
            raise ValueError(f"AsyncIO needs threads, queue_depth and block_size >= 1, got {threads}, "
                             f"{queue_depth}, {block_size}")
        self.threads, self.queue_depth, self.block_size = threads, queue_depth, block_size
        self.pool, self._python = None, None
        self.lib = run_native("aio", lambda: load("aio"), lambda: None, what="NVMe offload's file I/O")
        if self.lib is not None:
            self.pool = self.lib.c.zero_aio_create(threads, queue_depth)
            if not self.pool:
                raise OSError(errno.EAGAIN, f"zero aio: could not start {threads} I/O threads")
        else:
            self._python = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zero-aio")
        self._closed = False

    @property
    def native(self) -> bool:
        return self.lib is not None

    def read(self, f: DataFile, buf: torch.Tensor, offset: int) -> Request:
        """Start reading `buf.nbytes` bytes at `offset` of `f` into `buf` (contiguous, host)."""
        return self._submit(f, buf, offset, write=False)

    def write(self, f: DataFile, buf: torch.Tensor, offset: int) -> Request:
        """Start writing `buf` (contiguous, host) to `f` at `offset`."""
        return self._submit(f, buf, offset, write=True)

    def _submit(self, f: DataFile, buf: torch.Tensor, offset: int, write: bool) -> Request:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"zero aio: the buffer must be a contiguous host tensor, got {buf.device} "
                             f"{'contiguous' if buf.is_contiguous() else 'strided'}")
        if offset < 0:
            raise ValueError(f"zero aio: negative offset {offset} for {f.path}")
        nbytes = buf.numel() * buf.element_size()
        what = "writing" if write else "reading"
        if nbytes == 0:
            return Request(self, None, what, f.path, offset, 0, None)
        if self.pool is None and self._python is None or self._closed:
            raise RuntimeError(f"zero aio: {what} {f.path} after the I/O threads were stopped (engine.destroy())")
        if self._python is not None:
            fut = self._python.submit(_python_transfer, f.fd, buf, offset, write)
            return Request(self, fut, what, f.path, offset, nbytes, buf)
        handle = self.lib.c.zero_aio_submit(self.pool, f.fd_direct, f.fd, int(write), buf.data_ptr(), nbytes, offset,
                                            self.block_size, ALIGNMENT)
        if not handle:
            raise OSError(errno.ENOMEM, f"zero aio: could not queue {what} {nbytes} bytes of {f.path}")
        return Request(self, handle, what, f.path, offset, nbytes, buf)

    def stats(self) -> dict[str, int]:
        """Bytes moved by direct and by buffered transfers, and transfers continued after a short one."""
        if self.lib is None:
            return {"direct_bytes": 0, "buffered_bytes": 0, "continued": 0}
        out = (ctypes.c_int64 * 3)()
        self.lib.c.zero_aio_stats(self.pool, out)
        return {"direct_bytes": out[0], "buffered_bytes": out[1], "continued": out[2]}

    def close(self) -> None:
        if self.pool:
            self.lib.c.zero_aio_destroy(self.pool)
            self.pool = None
        if self._python is not None:
            self._python.shutdown(wait=True)
        self._closed = True

    def __del__(self):
        if getattr(self, "pool", None) or getattr(self, "_python", None) is not None:
            self.close()


def _python_transfer(fd: int, buf: torch.Tensor, offset: int, write: bool) -> tuple[int, int]:
    """The fallback's transfer (buffered), short transfers continued: (0 or an errno or EOF, offset)."""
    view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            return exc.errno, offset + done
        if n == 0:
            return (errno.EIO if write else EOF_CODE), offset + done
        done += n
    return 0, offset

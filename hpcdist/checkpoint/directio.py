"""Checkpoint shards streamed past the page cache (``O_DIRECT``), so a save or a load costs the disk's time and
leaves the CPU to the sha256 that runs beside it.

Why: a buffered write or read of a multi-GB shard copies every byte through the kernel's page cache. On the
machine measured (tools/bench/checkpoint.py, ``dd conv=fdatasync`` against ``dd oflag=direct``), that costs about
one CPU-second per GB in the kernel, as much as hashing the same bytes, so on 2 cores a 4.2 GB save was CPU-bound
below the disk's speed. Direct I/O moves the bytes by DMA from a few reused, page-aligned buffers (the one copy left
is user space's, into or out of those buffers, at memory speed, with the GIL released), keeps the requests in flight
on threads of the file's own, and leaves the page cache to the job's other files. DeepSpeed's DeepNVMe (libaio,
under its FastPersist checkpoints) moves checkpoint bytes the same way, from aligned buffers with ``O_DIRECT``.

Every request is a whole ``CHUNK`` at a chunk-aligned offset; a written file's last chunk is padded to the alignment,
then the file is truncated to its true size. A file under ``DIRECT_MIN`` bytes goes through the page cache (its copy
costs little), and so does every file in memory (tmpfs, ramfs: ``/dev/shm``, where newer kernels take ``O_DIRECT``
but copy through the page cache anyway: a bounce buffer would only add a copy). A file system without ``O_DIRECT``
refuses the flag at open, and the file is written or read buffered: the same bytes either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import stat
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

import torch

__all__ = ["CHUNK", "DirectReader", "DirectWriter", "open_read", "open_write"]

CHUNK = 32 << 20  # one request: deep enough for the device's queue (the kernel splits it), cheap to keep in flight
WRITE_DEPTH = 3  # a writer's buffers: one filling, two in flight
READ_DEPTH = 4  # a reader's: one being consumed, three read ahead (96 MiB)
IO_THREADS = 2  # requests in flight per file
# smaller files go through the page cache: its copy costs little there, and a small checkpoint read back soon after
# its save (a test, a restart) is served from memory instead of the disk
DIRECT_MIN = 64 << 20
ALIGN = 4096  # a multiple of every logical block size (512 on virtio, 4096 on NVMe) and of the page size
_GIL_FREE_COPY = 1 << 16  # copies this big go through torch, which releases the GIL; smaller ones are a slice
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every file is buffered


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; a big one through torch's copy, which releases the GIL (the other file's thread and the
    hash threads run on)."""
    if len(src) < _GIL_FREE_COPY or src.readonly:
        dst[:] = src
        return
    torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


def _buffers(n: int) -> list[mmap.mmap]:
    return [mmap.mmap(-1, CHUNK) for _ in range(n)]  # anonymous mappings: page-aligned, as O_DIRECT needs


def _free(views: list[memoryview], bufs: list[mmap.mmap]) -> None:
    """Unmap the buffers now; one still exported (a failed request's traceback holds a slice) goes with its last
    reference instead."""
    for view in views:
        with contextlib.suppress(BufferError):
            view.release()
    for buf in bufs:
        with contextlib.suppress(BufferError):
            buf.close()


_IN_MEMORY = {0x01021994, 0x858458F6}  # TMPFS_MAGIC, RAMFS_MAGIC (statfs f_type)
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _in_memory(fd: int) -> bool:
    """Whether ``fd``'s file system keeps its files in memory (statfs f_type: the first field, a C long)."""
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        return False
    kind = int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder, signed=True) & 0xFFFFFFFF
    return kind in _IN_MEMORY


def _direct_fd(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int | None:
    """``path`` opened with ``O_DIRECT``, or None where that moves the bytes no faster: a file system that refuses
    the flag (EINVAL), or one in memory."""
    try:
        fd = os.open(path, flags | _O_DIRECT, mode)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None
    if _in_memory(fd):
        os.close(fd)
        return None
    return fd


def _drop_direct(fd: int) -> None:
    """A file system that took ``O_DIRECT`` at open but refuses a request (EINVAL): the file goes on buffered."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


_F = TypeVar("_F", bound="_ChunkedFile")


class _ChunkedFile:
    """What a direct writer and reader share: the file, ``depth`` reused page-aligned buffers, the threads their
    requests run on, and the fallback to buffered I/O when a request is refused."""

    def __init__(self, fd: int, depth: int):
        self._fd, self.direct = fd, True
        self._bufs = _buffers(depth)
        self._views = [memoryview(b) for b in self._bufs]
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="hpcdist-dio")

    def _request(self, call: Any, view: memoryview, offset: int) -> int:
        """``call(fd, view, offset)`` (a pwrite or preadv); a file system that took ``O_DIRECT`` at open but refuses
        the request (EINVAL) has the flag dropped, and the request runs again buffered."""
        while True:
            try:
                return call(self._fd, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                _drop_direct(self._fd)
                self.direct = False

    def fileno(self) -> int:
        return self._fd

    def _release(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self._fd)
        _free(self._views, self._bufs)

    def close(self) -> None:
        self._release()

    def __enter__(self: _F) -> _F:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectWriter(_ChunkedFile):
    """A new file written in ``CHUNK`` requests from ``WRITE_DEPTH`` reused buffers, on ``IO_THREADS`` threads of
    its own:
    ``write`` copies into the current buffer and returns; a full buffer is written while the next one fills.
    ``flush`` writes the tail and waits for every request (call it before fdatasync). A failed request (ENOSPC,
    EIO) is raised by the next ``write`` or ``flush`` that reuses its buffer, at the latest by ``flush``."""

    def __init__(self, fd: int):
        super().__init__(fd, WRITE_DEPTH)
        self._pending: list[Future[None] | None] = [None] * WRITE_DEPTH
        self._cur = self._fill = self._size = self._sent = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(CHUNK - self._fill, len(view) - done)
            _copy(self._views[self._cur][self._fill : self._fill + n], view[done : done + n])
            self._fill += n
            done += n
            if self._fill == CHUNK:
                self._send(CHUNK)
        self._size += len(view)
        return len(view)

    def _send(self, length: int) -> None:
        """The current buffer's first ``length`` bytes to the file at the next chunk's offset; then the next buffer,
        once its previous request is done."""
        cur = self._cur
        self._pending[cur] = self._pool.submit(self._pwrite, self._views[cur][:length], self._sent)
        self._sent += length
        self._cur, self._fill = (cur + 1) % WRITE_DEPTH, 0
        self._settle(self._cur)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while len(view):
            n = self._request(os.pwrite, view, offset)
            view, offset = view[n:], offset + n

    def _settle(self, i: int) -> None:
        fut, self._pending[i] = self._pending[i], None
        if fut is not None:
            fut.result()

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        """Everything written so far is in the file (not yet on the disk: that is fdatasync's)."""
        if self._fill:
            tail = self._fill
            padded = -(-tail // ALIGN) * ALIGN
            self._views[self._cur][tail:padded] = bytes(padded - tail)
            self._send(padded)
        for i in range(WRITE_DEPTH):
            self._settle(i)
        if self._sent != self._size:  # the tail's padding
            os.ftruncate(self._fd, self._size)
            self._sent = self._size

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._release()


class DirectReader(_ChunkedFile):
    """A file read in ``CHUNK`` requests into ``READ_DEPTH`` reused buffers, the next chunks read ahead on
    ``IO_THREADS`` threads of its own while ``readinto`` copies out of the current one. Reads and seeks anywhere
    (a seek out of the chunks in hand starts over there); the file's size is taken at open (``size``)."""

    def __init__(self, fd: int):
        super().__init__(fd, READ_DEPTH)
        self.size = os.fstat(fd).st_size
        self._held: list[int] = [-1] * READ_DEPTH  # the chunk each buffer holds or is being read into
        self._pending: list[Future[int] | None] = [None] * READ_DEPTH
        self._pos = 0

    def _pread(self, slot: int, k: int) -> int:
        view, got = self._views[slot], 0
        while got < CHUNK:
            n = self._request(lambda fd, v, at: os.preadv(fd, [v], at), view[got:], k * CHUNK + got)
            if n == 0:  # the end of the file
                break
            got += n
        return got

    def _want(self, k: int) -> None:
        """Chunk ``k`` read (or being read) into its buffer."""
        slot = k % READ_DEPTH
        if self._held[slot] == k or k * CHUNK >= self.size:
            return
        fut = self._pending[slot]
        if fut is not None:
            fut.result()  # its buffer is about to be overwritten (a read in flight, or one never consumed)
        self._held[slot] = k
        self._pending[slot] = self._pool.submit(self._pread, slot, k)

    def _chunk(self, k: int) -> tuple[memoryview, int]:
        for j in range(k, k + READ_DEPTH):  # this chunk, and the next ones read ahead
            self._want(j)
        slot = k % READ_DEPTH
        fut = self._pending[slot]
        return self._views[slot], fut.result() if fut is not None else 0

    def readinto(self, dest: Any) -> int:
        view = memoryview(dest).cast("B")
        done = 0
        while done < len(view) and self._pos < self.size:
            k, start = divmod(self._pos, CHUNK)
            buf, n = self._chunk(k)
            # never past the size taken at open: a file grown since returns its new bytes in the last chunk
            m = min(n - start, len(view) - done, self.size - self._pos)
            if m <= 0:  # the file shrank under us: what we have is all there is
                break
            _copy(view[done : done + m], buf[start : start + m])
            done += m
            self._pos += m
        return done

    def read(self, n: int = -1) -> bytes:
        out = bytearray(self.size - self._pos if n < 0 else max(0, min(n, self.size - self._pos)))
        return bytes(memoryview(out)[: self.readinto(out)])

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "seek before the start of the file")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def open_write(path: str | os.PathLike[str], size: int) -> DirectWriter | BinaryIO:
    """A new file at ``path`` (an existing one truncated; mode 0666 minus the umask, as ``open(path, "wb")``) for
    about ``size`` bytes: a :class:`DirectWriter` when that is ``DIRECT_MIN`` or more and the file system allows
    ``O_DIRECT``, else the plain buffered file."""
    if _O_DIRECT and size >= DIRECT_MIN:
        fd = _direct_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        if fd is not None:
            return DirectWriter(fd)
    return open(path, "wb")


def open_read(path: str | os.PathLike[str]) -> DirectReader | BinaryIO:
    """``path`` for reading: a :class:`DirectReader` when it has ``DIRECT_MIN`` bytes or more and its file system
    allows ``O_DIRECT``, else the plain unbuffered file (the page cache's own read-ahead serves it). OSError for
    anything but a regular file: a FIFO planted in its place would block the open, and every read after it, forever
    (O_NONBLOCK makes the open return; the file type is checked before a byte is read)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    fd = _direct_fd(path, flags) if _O_DIRECT else None
    direct = fd is not None
    if fd is None:
        fd = os.open(path, flags)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file (a FIFO, device or directory): not read", str(path))
    os.set_blocking(fd, True)
    if direct and st.st_size >= DIRECT_MIN:
        return DirectReader(fd)
    if direct:
        _drop_direct(fd)
    return os.fdopen(fd, "rb", buffering=0)

"""Checkpoint shards written and read past the page cache (hpcdist.checkpoint.directio). The bytes
are the same as a buffered file's at any length, read and seek pattern; a small file, and any file in memory
(tmpfs: /dev/shm), is written and read buffered; a failed request is raised, not lost; and a real save and load
leave none of a big shard's pages in the page cache (a buffered save left all of them: the copy through the page
cache was what made the save CPU-bound)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import resource
import signal
from pathlib import Path

import pytest
import torch

from hpcdist.checkpoint import directio
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.state import Checkpointable

CHUNK = directio.CHUNK


def _direct_ok(directory: Path) -> bool:
    """Whether ``directory``'s file system takes O_DIRECT and keeps its files on a disk (not tmpfs: /dev/shm)."""
    probe = directory / ".probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600))
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False
    finally:
        probe.unlink(missing_ok=True)
    return hasattr(os, "O_DIRECT") and not str(directory).startswith("/dev/shm")


def _resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore on a mapping that touches none)."""
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m,
    ):
        libc = ctypes.CDLL(None, use_errno=True)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)


def _pattern(n: int, seed: int = 0) -> bytes:
    return (
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    )


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_written_and_read_bytes_equal_a_buffered_files_at_any_length_read_and_seek(tmp_path: Path, where: str) -> None:
    """Writes of every size (small read-only bytes, slices across chunk boundaries, one over two chunks) and a tail
    that is no multiple of the alignment; reads in odd sizes, a seek back, a seek far ahead, a read at the end."""
    if where == "shm":
        if not Path("/dev/shm").is_dir():
            pytest.skip("no /dev/shm on this machine: the tmpfs fallback cannot be shown")
        base = Path(os.environ.get("TMPDIR_SHM", "/dev/shm")) / f"hpcdist-dio-{os.getpid()}"
        base.mkdir(exist_ok=True)
    else:
        base = tmp_path
    try:
        data = _pattern(2 * CHUNK + CHUNK // 2 + 4097)
        path = base / "f"
        with directio.open_write(path, len(data)) as w:
            assert isinstance(w, directio.DirectWriter) == _direct_ok(base)
            pieces = [3, 5000, CHUNK - 5003, 2 * CHUNK + 1, len(data)]
            start = 0
            for end in pieces:
                w.write(bytes(data[start:end]) if end - start < 10000 else memoryview(data)[start:end])
                start = end
            assert w.tell() == len(data)
        assert path.read_bytes() == data

        small = base / "small"
        with directio.open_write(small, 100) as w:
            assert not isinstance(w, directio.DirectWriter)  # under DIRECT_MIN: the page cache's
            w.write(data[:100])
        with directio.open_read(small) as r:
            assert not isinstance(r, directio.DirectReader) and r.read() == data[:100]

        r = directio.open_read(path)
        with r:
            assert isinstance(r, directio.DirectReader) == _direct_ok(base)
            got = bytearray()
            for n in (1, 100, CHUNK, 7, CHUNK + 3):
                buf = bytearray(n)
                got += buf[: r.readinto(buf)]
            assert bytes(got) == data[: len(got)]
            r.seek(10)  # back, inside a chunk read earlier
            assert r.read(20) == data[10:30]
            r.seek(2 * CHUNK + 99)  # ahead, past the chunks read ahead
            assert r.read(50) == data[2 * CHUNK + 99 : 2 * CHUNK + 149]
            r.seek(-5, os.SEEK_END)
            assert r.read(100) == data[-5:]
            assert r.readinto(bytearray(8)) == 0  # at the end
    finally:
        if where == "shm":
            for p in base.iterdir():
                p.unlink()
            base.rmdir()


def test_a_failed_write_request_is_raised_not_lost(tmp_path: Path) -> None:
    """A write past the file-size limit fails on the file's own thread (EFBIG): the writer raises it by its flush
    at the latest, so the save fails instead of leaving a short shard with a digest."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ ends the process
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * CHUNK, limits[1]))
    try:
        w = directio.open_write(tmp_path / "big", 5 * CHUNK)
        assert isinstance(w, directio.DirectWriter) == _direct_ok(tmp_path)
        with pytest.raises(OSError) as raised:
            for _ in range(5):
                w.write(bytes(CHUNK))
            w.flush()
        assert raised.value.errno == errno.EFBIG
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    with contextlib.suppress(OSError):
        w.close()


def test_a_save_and_a_load_leave_the_shards_out_of_the_page_cache(tmp_path: Path) -> None:
    """A big shard is written and read direct: after the save (which fdatasyncs it) and after a verified load, none
    of its pages is in the page cache (a buffered save left every page there). A small one (under DIRECT_MIN) goes
    through the page cache, where a load soon after finds it."""
    if not _direct_ok(tmp_path):
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT: its shards are written buffered (same bytes)")
    g = torch.Generator().manual_seed(0)
    saved = {
        "model": {"w": torch.randn(directio.DIRECT_MIN // 4 + 13, generator=g)},
        "optim": {"m": torch.randn(999, generator=g)},
    }
    state = Checkpointable(
        dcp_state=lambda: saved,
        load_dcp_state=lambda s: None,
        trainer_state=lambda: {"step": 1},
        load_trainer_state=lambda s: None,
    )
    path = CheckpointManager(tmp_path, rank=0, world_size=1, write_threads=2).save(1, state)
    assert path is not None
    small, big = sorted(path.glob("*.distcp"), key=lambda p: p.stat().st_size)  # a file per write thread
    assert big.stat().st_size > directio.DIRECT_MIN > small.stat().st_size
    assert _resident_pages(big) == 0 and _resident_pages(small) > 0

    dest = {"model": {"w": torch.zeros_like(saved["model"]["w"])}, "optim": {"m": torch.zeros(999)}}
    state = Checkpointable(
        dcp_state=lambda: dest,
        load_dcp_state=lambda s: None,
        trainer_state=lambda: {"step": 1},
        load_trainer_state=lambda s: None,
    )
    assert CheckpointManager(tmp_path, rank=0, world_size=1, write_threads=2).restore("auto", state) == path
    assert torch.equal(dest["model"]["w"], saved["model"]["w"]) and torch.equal(dest["optim"]["m"], saved["optim"]["m"])
    assert _resident_pages(big) == 0


def test_a_reader_never_returns_bytes_past_the_size_it_took_at_open(tmp_path: Path) -> None:
    """A file that grows while it is read (someone appends): the reader keeps to the size it took at open, in the
    last chunk too, where a read request returns the new bytes with the old."""
    path = tmp_path / "grows"
    data = _pattern(CHUNK + 100)
    path.write_bytes(data)
    reader = directio.DirectReader(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    try:
        with open(path, "ab") as f:
            f.write(b"\xff" * 5000)
        assert reader.size == len(data)
        reader.seek(len(data) - 10)
        assert reader.read(4096) == data[-10:]  # the 10 bytes of the file as it was opened, none of the new ones
        reader.seek(0)
        assert reader.read() == data and reader.read(1) == b""
        reader.seek(CHUNK + 50)
        buf = bytearray(1000)
        assert reader.readinto(buf) == 50 and bytes(buf[:50]) == data[-50:]
    finally:
        reader.close()


def test_open_read_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    """A FIFO planted as a shard (checkpoint.verify=none reads without a size check first): an error, not a hang."""
    from tests.unit.hostile_rundirs import time_bound

    fifo = tmp_path / "shard.distcp"
    os.mkfifo(fifo)
    with time_bound(10.0), pytest.raises(OSError, match="not a regular file"):
        directio.open_read(fifo)
    regular = tmp_path / "small"
    regular.write_bytes(b"abc")
    with directio.open_read(regular) as f:
        assert f.read() == b"abc"

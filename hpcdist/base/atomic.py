"""One atomic file write for every file hpcdist replaces in place (config, manifests, markers, records, heartbeats),
and one append for every file it only appends to (metrics.jsonl, failures.jsonl, jobs.jsonl).

Readers (other ranks, a resumed job, a login-node watcher) see the old file or the whole new one, never a part.
The temporary file sits in the target's directory (``os.replace`` is atomic only within one file system), has an
unpredictable name and is created with ``O_EXCL | O_NOFOLLOW``: a name another user planted in a shared run
directory (a symlink pointing elsewhere) makes the write fail instead of writing through it. It is created with
mode 0666 minus the umask, like ``open(path, "w")``, so results follow the user's umask.

An append-only file cannot be replaced, so it is opened in place: never through a link (``O_NOFOLLOW``), never a
FIFO or device (``O_NONBLOCK`` for the open, then it must be a regular file), and only a file of this user's (a file
another user made in the run dir is theirs: appending would mix our records into it, or theirs into ours).
A small record read back (jobs.jsonl, a task's result) is read the same way and only when nobody else could have
written it (:func:`read_trusted`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from hpcdist.base.owners import user_name, writer_problem

__all__ = [
    "UntrustedFile",
    "append_line",
    "atomic_write",
    "atomic_writer",
    "file_sha256",
    "follow_umask",
    "open_append",
    "open_regular_file",
    "read_head",
    "read_tail",
    "read_trusted",
]


def _umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it: a set-and-restore would race with
    other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc (macOS): the classic way
    os.umask(old)
    return old


def follow_umask(path: str | os.PathLike[str]) -> None:
    """Give a file another library created (safetensors writes 0600) the mode ``open(path, "w")`` would have: 0666
    minus the umask, as every other file of a run."""
    os.chmod(path, 0o666 & ~_umask())


def atomic_write(path: str | os.PathLike[str], data: str | bytes | memoryview, *, durable: bool = True) -> Path:
    """Replace ``path`` with ``data`` atomically; ``durable`` fsyncs the file before the rename.

    ``durable=False`` is for files rewritten every few seconds whose loss in a crash costs nothing (heartbeats):
    an fsync per write would load a shared file system for no gain. The parent directory is created if needed.
    """
    with atomic_writer(path, durable=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` atomically once the block ends without an error (an error removes it,
    ``path`` stays as it was): :func:`atomic_write` for a writer that streams (``torch.save``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_append(path: str | os.PathLike[str]) -> int:
    """A descriptor for appending to ``path`` (created with mode 0666 minus the umask if missing, its parent too).

    Raises OSError naming the file and the fix when it is a link, not a regular file, or another user's.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a link (dangling or not)
            raise OSError(
                errno.ELOOP,
                f"{path} is a link: hpcdist appends to its own files only, never through a link (remove the link)",
                str(path),
            ) from None
        if e.errno == errno.ENXIO:  # a FIFO nobody reads: O_NONBLOCK refused it instead of blocking forever
            raise _not_regular(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path)
        if st.st_uid != os.geteuid():
            raise OSError(
                errno.EPERM,
                f"{path} belongs to {user_name(st.st_uid)}, not to you "
                f"({user_name(os.geteuid())}): it is not this run's file (remove it or choose another "
                "run.dir)",
                str(path),
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(path: Path) -> OSError:
    return OSError(
        errno.EINVAL,
        f"{path} is not a regular file (a FIFO, device or directory): hpcdist appends "
        "only to its own regular files (remove it)",
        str(path),
    )


def append_line(path: str | os.PathLike[str], line: str | bytes) -> None:
    """Append one line to ``path`` (checked as :func:`open_append` does) in one ``write`` on an O_APPEND
    descriptor: lines of concurrent writers (ranks, the supervisor, after-step) do not interleave."""
    data = line.encode() if isinstance(line, str) else line
    fd = open_append(path)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class UntrustedFile(OSError):
    """A file hpcdist will not read: a link, not a regular file, too large, or writable by someone untrusted."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _open_regular(path: Path) -> int:
    """A read descriptor of the regular file ``path``: never through a link, never blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedFile(
                errno.ELOOP, f"{path} is a link: not read (hpcdist reads its records only directly)", str(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedFile(errno.EINVAL, f"{path} is not a regular file: not read", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_file(path: str | os.PathLike[str]) -> BinaryIO:
    """The regular file ``path`` opened to read, whoever wrote it (a file inside a tree its caller checked
    already): never through a link, never a FIFO (no hang), each refused with UntrustedFile naming it."""
    return os.fdopen(_open_regular(Path(path)), "rb")


def read_trusted(path: str | os.PathLike[str], max_bytes: int) -> bytes | None:
    """The contents of ``path`` (None when it does not exist), read only if nobody but this user or root could
    have written it: the rule checkpoints are loaded by (hpcdist.base.owners, without checkpoint.trusted_owners),
    checked on the open descriptor, so the file cannot be swapped between check and read. A link, a FIFO (no
    hang: O_NONBLOCK), another user's file, one writable by others, or one over ``max_bytes`` raises
    UntrustedFile naming it."""
    path = Path(path)
    try:
        fd = _open_regular(path)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        why = writer_problem(st, {os.getuid(), 0})
        if why:
            raise UntrustedFile(
                errno.EPERM, f"{path} {why}: another user could have written it, so it is not read", str(path)
            )
        if st.st_size > max_bytes:
            raise UntrustedFile(
                errno.EFBIG,
                f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} such a record can be: not read",
                str(path),
            )
        return _read_at_most(fd, max_bytes)
    finally:
        os.close(fd)


def read_bounded(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole regular file ``path``, whoever wrote it (a record inside a tree its caller checked already, such as
    a checkpoint's manifest): never through a link, never a FIFO, and never more than ``max_bytes``: a larger file
    raises UntrustedFile (EFBIG) before anything is read. OSError as ``open`` raises it."""
    fd = _open_regular(Path(path))
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UntrustedFile(
                errno.EFBIG, f"{path} is {size:,} bytes, more than the {max_bytes:,} such a record can be", str(path)
            )
        return _read_at_most(fd, max_bytes)
    finally:
        os.close(fd)


def read_head(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the regular file ``path``, whoever wrote it (a log read from its start, such as a
    preparation's progress.jsonl): never through a link, never a FIFO, never more than ``max_bytes`` however large
    the file is. OSError as ``open`` raises it; UntrustedFile for a link or a file that is not regular."""
    fd = _open_regular(Path(path))
    try:
        return _read_at_most(fd, max_bytes)
    finally:
        os.close(fd)


def read_tail(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The last ``max_bytes`` of the regular file ``path``, whoever wrote it (plain data such as metrics.jsonl of
    a run dir given on the command line): never through a link, never a FIFO (which would block), never more
    than ``max_bytes`` however large the file is. OSError as ``open`` raises it; UntrustedFile for a link or a
    file that is not regular."""
    fd = _open_regular(Path(path))
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            os.lseek(fd, size - max_bytes, os.SEEK_SET)
        return _read_at_most(fd, max_bytes)
    finally:
        os.close(fd)


def _read_at_most(fd: int, max_bytes: int) -> bytes:
    with os.fdopen(fd, "rb", closefd=False) as f:
        return f.read(max_bytes)  # a file growing meanwhile is cut, never read without end


_HASH_CHUNK = 1 << 20  # bytes read per step when hashing a file


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file (a checkpoint's file, a tokenizer's), read in chunks into one reused buffer
    (hashlib.file_digest is 3.11+; we support 3.10)."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()

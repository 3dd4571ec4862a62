"""One atomic file write for every file hpcdist replaces in place (config, manifests, markers, records, heartbeats).

Readers (other ranks, a resumed job, a login-node watcher) see the old file or the whole new one, never a part.
The temporary file sits in the target's directory (``os.replace`` is atomic only within one file system), has an
unpredictable name and is created with ``O_EXCL | O_NOFOLLOW``: a name another user planted in a shared run
directory (a symlink pointing elsewhere) makes the write fail instead of writing through it. It is created with
mode 0666 minus the umask, like ``open(path, "w")``, so results follow the user's umask.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike[str], data: str | bytes | memoryview, *, durable: bool = True) -> Path:
    """Replace ``path`` with ``data`` atomically; ``durable`` fsyncs the file before the rename.

    ``durable=False`` is for files rewritten every few seconds whose loss in a crash costs nothing (heartbeats):
    an fsync per write would load a shared file system for no gain. The parent directory is created if needed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

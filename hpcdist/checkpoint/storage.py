"""Where the shared tier's step directories live, as the manager sees them: list the steps, create one, write and
read its records (the trainer state, each rank's RNG and own state, the manifest, the marker), mark one complete or
damaged, set one aside, remove one, prune the old ones, say how much room is left and whether a tree can be trusted.
:class:`Storage` is that surface, so another backend (an object store) is one class; :class:`PosixStorage` is a
directory of a POSIX file system; :class:`MemoryStorage` keeps the same facts and bytes in a dict, for tests of the
manager's decisions. Not through it yet: the DCP shards and ``.metadata`` (DCP's file system writer and reader at
the step's path, past the page cache where they can: hpcdist.checkpoint.directio), the files the manifest lists and
hashes (found at that path), and an async save's manifest parts (written by the checkpoint process).

Renames are atomic on POSIX, so a step directory is either complete (its marker written last, atomically) or not,
and a record is either the old one or the whole new one; the trust check is lstat only (nothing of a tree is opened
before it passed), and a record is never read through a link or from a FIFO.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from hpcdist.base.atomic import UntrustedFile, atomic_write, atomic_writer, open_regular_file
from hpcdist.base.logging_utils import get_logger
from hpcdist.checkpoint.names import DAMAGED, MARKER, list_checkpoints, parse_step, step_of, warn_skipped
from hpcdist.config.dirs import tree_trust_problems
from hpcdist.config.loader import ConfigError

log = get_logger(__name__)
NEARLY_FULL = 64 << 20  # bytes free: below this an error is the storage's (a percentage means nothing on a petabyte)
# the most a checkpoint's JSON record (MANIFEST.json, trainer_state.json, a rank's manifest part) is read of: a manifest
# holds ~150 bytes per file (a 1024-rank checkpoint with 8 writer threads each: ~1.3 MB); a larger one is damage
RECORD_MAX = 64 << 20


class Storage(Protocol):
    """The shared tier's step directories under ``root``."""

    root: Path

    def steps(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        """(complete steps sorted, incomplete step directories: crashed, in flight, or demoted)."""
        ...

    def exists(self, path: Path) -> bool:
        """A step directory (of any name: a set-aside one too) is at ``path``."""
        ...

    def create(self, path: Path) -> None:
        """A new, empty step directory at ``path``; FileExistsError when something is there already."""
        ...

    def has(self, path: Path, rel: str) -> bool:
        """The step at ``path`` holds the file ``rel`` (MARKER, DAMAGED, ``rng/rank-00003.pt``...)."""
        ...

    def open_writer(self, path: Path, rel: str) -> AbstractContextManager[BinaryIO]:
        """The file ``rel`` of the step at ``path``, written through the stream this yields: in place, whole, once
        the block ends without an error (an error leaves the file as it was); never seen half-written."""
        ...

    def open_reader(self, path: Path, rel: str) -> AbstractContextManager[BinaryIO]:
        """The file ``rel`` of the step at ``path``, to read (seekable): FileNotFoundError when it is absent,
        UntrustedFile when it is no plain file (a link, a FIFO: refused, never waited on)."""
        ...

    def write_marker(self, path: Path, record: dict[str, Any]) -> None:
        """Make ``path`` complete: its MARKER written last, atomically."""
        ...

    def demote(self, path: Path) -> None:
        """``path`` failed verification: its MARKER becomes DAMAGED (nothing else changes)."""
        ...

    def set_aside(self, path: Path, why: str) -> Path:
        """Rename ``path`` to ``<name>.<why>-<time>``: kept, never listed as a step again."""
        ...

    def remove(self, path: Path) -> None: ...

    def free_bytes(self) -> int | None:
        """Bytes free where ``root`` is; None when the storage cannot say (it is failing)."""
        ...

    def trust_problems(self, path: Path, trusted: Iterable[int]) -> list[tuple[str, str]]:
        """(entry, why) of everything in the tree at ``path`` someone else could have written."""
        ...


def read_step_record(storage: Storage, path: Path, rel: str, limit: int = RECORD_MAX) -> bytes:
    """A step's JSON record (the trainer state, the marker, the manifest), read only up to ``limit``: a larger one
    (however its size came about), a link or a FIFO is damage, a ValueError, found before anything is read."""
    try:
        with storage.open_reader(path, rel) as f:
            size = f.seek(0, os.SEEK_END)
            if size > limit:
                raise ValueError(f"{path / rel} is {size:,} bytes, more than the {limit:,} such a record can be")
            f.seek(0)
            return f.read(limit)  # a file growing meanwhile is cut, never read without end
    except UntrustedFile as e:
        raise ValueError(str(e)) from None


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def newest(storage: Storage, *, warn: bool = True) -> Path | None:
    """The newest complete step (:func:`hpcdist.checkpoint.names.latest` of the storage); ``warn``: say which newer
    directories are skipped (interrupted saves, demoted steps)."""
    complete, incomplete = storage.steps()
    if warn:
        warn_skipped(complete, incomplete, lambda d: storage.has(d, DAMAGED))
    return complete[-1][1] if complete else None


def prune(storage: Storage, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete steps; remove crashed saves older than the newest complete one.
    Damaged (demoted) steps are evidence: never removed."""
    complete, incomplete = storage.steps()
    for _, d in complete[:-keep_last]:
        storage.remove(d)
    newest = complete[-1][0] if complete else -1
    for d in incomplete:
        if step_of(d) < newest and not storage.has(d, DAMAGED):
            storage.remove(d)


def set_aside_newer(storage: Storage, step: int, resumed: Path | str) -> None:
    """Set aside every complete step newer than ``step`` (-1: all of them), each said: the run resumed ``resumed``
    (an explicit step, or ``none``) and turned back from them."""
    for newer_step, d in storage.steps()[0]:
        if newer_step > step:
            aside = storage.set_aside(d, "abandoned")
            what = "starts from step 0" if step < 0 else f"turned back from step {newer_step}"
            log.warning(
                "checkpoint.resume=%s %s: the %s %s is set aside as %s (kept, never resumed or pruned; rename it "
                "back to resume that line)",
                resumed,
                what,
                "earlier run's" if step < 0 else "newer",
                d.name,
                aside.name,
            )


def nearly_full(storage: Storage) -> bool:
    """Whatever an error said, a full checkpoint disk makes it a storage problem."""
    free = storage.free_bytes()
    return free is None or free < NEARLY_FULL


def damaged_steps(storage: Storage) -> list[Path]:
    return [d for d in storage.steps()[1] if storage.has(d, DAMAGED)]


def refuse_if_only_damaged(storage: Storage) -> None:
    """resume=auto found no intact checkpoint: refuse while damaged ones exist, since starting from step 0 would
    silently drop the progress they hold (none is ever deleted)."""
    damaged = damaged_steps(storage)
    if damaged:
        raise ConfigError(
            [
                f"checkpoint.resume=auto: no intact checkpoint in {storage.root}, only damaged ones ("
                f"{', '.join(d.name for d in damaged)}; the warnings above say which file); nothing was deleted. "
                "Set checkpoint.resume=none to start from step 0 anyway (they are kept), or repair one, rename "
                f"its {DAMAGED} file back to {MARKER} and set checkpoint.resume=<its path>"
            ]
        )


class PosixStorage:
    """Step directories in a directory of a POSIX file system."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def steps(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        return list_checkpoints(self.root)

    def exists(self, path: Path) -> bool:
        return path.is_dir()

    def create(self, path: Path) -> None:
        path.mkdir(parents=True)

    def has(self, path: Path, rel: str) -> bool:
        return (path / rel).is_file()

    def open_writer(self, path: Path, rel: str) -> AbstractContextManager[BinaryIO]:
        return atomic_writer(path / rel)

    def open_reader(self, path: Path, rel: str) -> AbstractContextManager[BinaryIO]:
        return open_regular_file(path / rel)

    def write_marker(self, path: Path, record: dict[str, Any]) -> None:
        atomic_write(path / MARKER, json.dumps(record))

    def demote(self, path: Path) -> None:
        (path / MARKER).rename(path / DAMAGED)

    def set_aside(self, path: Path, why: str) -> Path:
        aside = path.with_name(f"{path.name}.{why}-{stamp()}")
        path.rename(aside)
        return aside

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free
        except OSError:
            return None

    def trust_problems(self, path: Path, trusted: Iterable[int]) -> list[tuple[str, str]]:
        return tree_trust_problems(path, set(trusted))


class MemoryStorage:
    """The same facts in memory: ``dirs`` maps a step directory to its files ({relative path: bytes}). The manager
    runs on it but for the DCP shards, which go to the step's path on disk (see the module): a step removed or set
    aside here leaves them there."""

    def __init__(self, root: Path, *, free: int | None = 1 << 40):
        self.root, self.free = Path(root), free
        self.dirs: dict[Path, dict[str, bytes]] = {}

    def steps(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        complete, incomplete = [], []
        for d, files in self.dirs.items():
            step = parse_step(d.name)
            if d.parent != self.root or step is None:
                continue
            if MARKER in files:
                complete.append((step, d))
            else:
                incomplete.append(d)
        return sorted(complete), sorted(incomplete)

    def exists(self, path: Path) -> bool:
        return path in self.dirs

    def create(self, path: Path) -> None:
        if path in self.dirs:
            raise FileExistsError(path)
        self.dirs[path] = {}

    def has(self, path: Path, rel: str) -> bool:
        return rel in self.dirs.get(path, {})

    @contextlib.contextmanager
    def open_writer(self, path: Path, rel: str) -> Iterator[BinaryIO]:
        stream = io.BytesIO()
        yield stream
        self.dirs.setdefault(path, {})[rel] = stream.getvalue()  # only once the block ended without an error

    def open_reader(self, path: Path, rel: str) -> AbstractContextManager[BinaryIO]:
        files = self.dirs.get(path, {})
        if rel not in files:
            raise FileNotFoundError(path / rel)
        return io.BytesIO(files[rel])

    def write_marker(self, path: Path, record: dict[str, Any]) -> None:
        self.dirs.setdefault(path, {})[MARKER] = json.dumps(record).encode()

    def demote(self, path: Path) -> None:
        files = self.dirs[path]
        if MARKER not in files:
            raise FileNotFoundError(path / MARKER)
        files[DAMAGED] = files.pop(MARKER)

    def set_aside(self, path: Path, why: str) -> Path:
        aside = path.with_name(f"{path.name}.{why}-{stamp()}")
        if aside in self.dirs:  # as a POSIX rename onto a directory with files refuses: nothing is lost
            raise FileExistsError(aside)
        self.dirs[aside] = self.dirs.pop(path)
        return aside

    def remove(self, path: Path) -> None:
        self.dirs.pop(path, None)

    def free_bytes(self) -> int | None:
        return self.free

    def trust_problems(self, path: Path, trusted: Iterable[int]) -> list[tuple[str, str]]:
        return []

"""Where the shared tier's step directories live, as the manager sees them: list the steps, mark one complete or
damaged, set one aside, remove one, prune the old ones, say how much room is left and whether a tree can be
trusted. :class:`Storage` is that surface; :class:`PosixStorage` is a directory of a POSIX file system (the shards
themselves go through DCP's file system writer, past the page cache where it can: hpcdist.checkpoint.directio);
:class:`MemoryStorage` keeps the same facts in a dict, for tests of the decisions made on them.

Renames are atomic on POSIX, so a step directory is either complete (its marker written last, atomically) or not;
the trust check is lstat only (nothing of a tree is opened before it passed).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from hpcdist.atomic import atomic_write
from hpcdist.checkpoint.names import DAMAGED, MARKER, list_checkpoints, parse_step, step_of
from hpcdist.config.dirs import tree_trust_problems
from hpcdist.config.loader import ConfigError
from hpcdist.logging_utils import get_logger

log = get_logger(__name__)
NEARLY_FULL = 64 << 20  # bytes free: below this an error is the storage's (a percentage means nothing on a petabyte)


class Storage(Protocol):
    """The shared tier's step directories under ``root``."""

    root: Path

    def steps(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        """(complete steps sorted, incomplete step directories: crashed, in flight, or demoted)."""
        ...

    def exists(self, path: Path) -> bool: ...

    def has(self, path: Path, marker: str) -> bool:
        """``path`` holds the file ``marker`` (MARKER, DAMAGED)."""
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


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


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
        return path.exists()

    def has(self, path: Path, marker: str) -> bool:
        return (path / marker).is_file()

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
    """The same facts in memory: ``dirs`` maps a step directory to the names of the files in it. Enough for the
    decisions made on the listing (latest, prune, set aside, demote); shards are never written here."""

    def __init__(self, root: Path, *, free: int | None = 1 << 40):
        self.root, self.free = Path(root), free
        self.dirs: dict[Path, set[str]] = {}

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

    def has(self, path: Path, marker: str) -> bool:
        return marker in self.dirs.get(path, set())

    def write_marker(self, path: Path, record: dict[str, Any]) -> None:
        self.dirs.setdefault(path, set()).add(MARKER)

    def demote(self, path: Path) -> None:
        files = self.dirs[path]
        if MARKER not in files:
            raise FileNotFoundError(path / MARKER)
        files.discard(MARKER)
        files.add(DAMAGED)

    def set_aside(self, path: Path, why: str) -> Path:
        aside = path.with_name(f"{path.name}.{why}-{stamp()}")
        self.dirs[aside] = self.dirs.pop(path)
        return aside

    def remove(self, path: Path) -> None:
        self.dirs.pop(path, None)

    def free_bytes(self) -> int | None:
        return self.free

    def trust_problems(self, path: Path, trusted: Iterable[int]) -> list[tuple[str, str]]:
        return []

"""File-system checks of run.dir and checkpoint.dir, and of who owns a checkpoint: the config rules that look at
the disk.

Separate from :mod:`hpcdist.config.rules` because they depend on where they run (every rank runs them, on its
own node) rather than on the config alone.
"""

from __future__ import annotations

import os
import pwd
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from hpcdist.base.owners import user_name, writer_problem  # user_name: also this module's API
from hpcdist.base.rundir import RunDir
from hpcdist.config.loader import ConfigError
from hpcdist.config.schema import JobConfig

__all__ = ["check_run_dir", "tree_trust_problems", "trusted_uids", "user_name"]


def check_run_dir(cfg: JobConfig) -> None:
    """File-system checks of run.dir and checkpoint.dir, before any process starts: raises ConfigError when one is
    not a directory, belongs to another user (their run: resuming it would mix two users' checkpoints), or cannot
    be written (read-only mount, permissions). Nothing is created."""
    problems = []
    for key, value in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if value is not None:
            problems += _dir_problems(key, Path(value))
    try:  # user names are this host's: here rather than in rules, and before any process group
        trusted_uids(cfg.checkpoint.trusted_owners)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems)


def _dir_problems(key: str, path: Path) -> list[str]:
    link = _foreign_link(path)
    if link is not None:  # checked before anything follows it (the owner check below looks at the target)
        return [f"{key}: {str(path)!r}: {link}; give the real directory or a path of your own"]
    if path.exists() and not path.is_dir():
        return [f"{key}: {str(path)!r} exists and is not a directory; choose another {key}"]
    if path.is_dir() and path.stat().st_uid != os.getuid():
        owner = user_name(path.stat().st_uid)
        return [
            f"{key}: {str(path)!r} belongs to {owner}, not to you ({user_name(os.getuid())}): it is another user's "
            f"run; choose your own {key}"
        ]
    if key == "run.dir" and path.is_dir():
        problems = [f"{key}: {why}" for why in map(_append_only_problem, RunDir(path).append_only()) if why]
        if problems:
            return problems
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:  # os.access says yes to root on a read-only mount: only a real write tells
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".hpcdist-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return [f"{key}: cannot write in {str(existing)!r} ({e.strerror}); make it writable or choose another {key}"]
    return []


def _foreign_link(path: Path) -> str | None:
    """Why ``path`` cannot be trusted to lead where it says: it, or a directory above it, is a symbolic link made by
    another user (who can point it anywhere, at any time: at a directory of yours, so that the owner check of
    the target passes); None when every link on the way is yours or root's."""
    for p in (path, *path.parents):
        try:
            st = os.lstat(p)
        except OSError:
            continue  # not there (yet): nothing to follow
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.getuid(), 0):
            return (
                f"{str(p)!r} is a link made by {user_name(st.st_uid)}, not by you (it leads to {os.path.realpath(p)!r})"
            )
    return None


def _append_only_problem(path: Path) -> str | None:
    """Why hpcdist could not append to ``path`` (metrics.jsonl, failures.jsonl, jobs.jsonl), said before any
    process starts; hpcdist.base.atomic.open_append refuses the same at the write."""
    try:
        st = os.lstat(path)
    except OSError:
        return None  # created at the first write
    if stat.S_ISLNK(st.st_mode):
        return (
            f"{str(path)!r} is a link (to {os.path.realpath(path)!r}): hpcdist appends to its run dir's own "
            "files only, never through a link; remove the link"
        )
    if not stat.S_ISREG(st.st_mode):
        return f"{str(path)!r} is not a regular file (a FIFO, device or directory); remove it"
    if st.st_uid != os.getuid():
        return f"{str(path)!r} belongs to {user_name(st.st_uid)}, not to you; remove it or choose another run.dir"
    return None


# ------------------------------------------------------------------------------------------ checkpoint owners


def trusted_uids(names: Sequence[str]) -> set[int]:
    """Whose checkpoints may be loaded: this user, root (who can change any file anyway) and the users named in
    checkpoint.trusted_owners; ConfigError naming every name that is no user on this host."""
    uids, problems = {os.getuid(), 0}, []
    for name in names:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            problems.append(f"checkpoint.trusted_owners: {name!r} is not a user on this host; list user names")
    if problems:
        raise ConfigError(problems)
    return uids


def tree_trust_problems(top: Path, trusted: set[int]) -> list[tuple[str, str]]:
    """``(path, why)`` for every entry of the tree at ``top`` (a real directory, itself included) that someone
    outside ``trusted`` could have written: owned by another user, writable by others or by a group that is not its
    owner's private one, or a link leading out of the tree. Only lstat: no file is opened (a checkpoint of thousands
    of files costs one stat each)."""
    real_top = os.path.realpath(top)
    problems: list[tuple[str, str]] = []
    for path, st in _walk(top, problems):
        why = _entry_problem(path, st, trusted, real_top)
        if why:
            problems.append((path, why))
    return problems


def _walk(top: Path, problems: list[tuple[str, str]]) -> Iterator[tuple[str, os.stat_result]]:
    """(path, lstat) of ``top`` and everything below it; links are reported, never followed."""
    yield str(top), os.lstat(top)
    todo = [str(top)]
    while todo:
        d = todo.pop()
        try:
            with os.scandir(d) as entries:
                for e in entries:
                    st = e.stat(follow_symlinks=False)
                    yield e.path, st
                    if stat.S_ISDIR(st.st_mode):
                        todo.append(e.path)
        except OSError as e:  # what cannot be listed cannot be checked
            problems.append((d, f"cannot be listed ({e.strerror})"))


def _entry_problem(path: str, st: os.stat_result, trusted: set[int], real_top: str) -> str | None:
    if stat.S_ISLNK(st.st_mode):  # a link's own mode means nothing; where it leads does
        target = os.path.realpath(path)
        inside = target == real_top or target.startswith(real_top + os.sep)
        return None if inside else f"is a link leading out of the checkpoint (to {target})"
    return writer_problem(st, trusted)

"""File-system checks of run.dir and checkpoint.dir: the only config rules that look at the disk.

Separate from :mod:`hpcdist.config.rules` because they depend on where they run (every rank runs them, on its
own node) rather than on the config alone.
"""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

from hpcdist.config.loader import ConfigError
from hpcdist.config.schema import JobConfig

__all__ = ["check_run_dir"]


def check_run_dir(cfg: JobConfig) -> None:
    """File-system checks of run.dir and checkpoint.dir, before any process starts: raises ConfigError when one is
    not a directory, belongs to another user (their run: resuming it would mix two users' checkpoints), or cannot
    be written (read-only mount, permissions). Nothing is created."""
    problems = []
    for key, value in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if value is not None:
            problems += _dir_problems(key, Path(value))
    if problems:
        raise ConfigError(problems)


def _dir_problems(key: str, path: Path) -> list[str]:
    if path.exists() and not path.is_dir():
        return [f"{key}: {str(path)!r} exists and is not a directory; choose another {key}"]
    if path.is_dir() and path.stat().st_uid != os.getuid():
        owner = _user_name(path.stat().st_uid)
        return [
            f"{key}: {str(path)!r} belongs to {owner}, not to you ({_user_name(os.getuid())}): it is another user's "
            f"run; choose your own {key}"
        ]
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:  # os.access says yes to root on a read-only mount: only a real write tells
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".hpcdist-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return [f"{key}: cannot write in {str(existing)!r} ({e.strerror}); make it writable or choose another {key}"]
    return []


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"

"""A frozen copy of the code a job runs (``hpcdist submit --snapshot``, the default): edits on the login node after
submission change neither a queued job nor its requeued attempts.

The copy is the git-tracked files of the checkout hpcdist is imported from, plus new files git does not ignore
(their working-tree content, so local edits are included; edits to tracked files are recorded as dirty), or the
installed package directory when hpcdist is not imported from a git checkout. It goes to
``<run.dir>/code/<time>-<pid>/`` (one per submission: a job still queued from an earlier submission keeps its
own) with ``snapshot.json`` (source, git commit, dirty, files); the batch script puts it first on PYTHONPATH, so
every attempt of the job, its supervisor and its failure policy import it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpcdist.atomic import atomic_write
from hpcdist.rundir import RunDir

__all__ = ["Snapshot", "create_snapshot", "package_source"]


@dataclass(frozen=True)
class Snapshot:
    path: Path
    """The directory to put first on PYTHONPATH (it holds the package ``hpcdist/``)."""
    source: Path
    """What was copied: the checkout's root, or the directory holding the installed package."""
    git_commit: str | None
    dirty: bool | None

    def map(self, path: str | os.PathLike[str]) -> str:
        """``path`` inside the snapshot when it is a file of the copied tree (a config in the checkout), else as is."""
        p = Path(path).expanduser().absolute()
        try:
            rel = p.relative_to(self.source)
        except ValueError:
            return str(p)
        copied = self.path / rel
        return str(copied) if copied.is_file() else str(p)


def _git(root: Path, *args: str) -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        proc = subprocess.run([git, "-C", str(root), *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def package_source() -> tuple[Path, list[str], str | None, bool | None]:
    """(root, files relative to it, git commit, dirty) of the hpcdist being imported."""
    package = Path(__file__).resolve().parents[1]  # hpcdist/ (this file is hpcdist/launch/snapshot.py)
    root = package.parent
    top = _git(root, "rev-parse", "--show-toplevel")
    # tracked files and new ones git does not ignore: a module created but not yet added is imported from the
    # checkout too, so the job must have it
    in_git = top is not None and Path(top.strip()).resolve() == root
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard") if in_git else None
    if listed is not None:
        files = sorted({f for f in listed.split("\0") if f and (root / f).is_file()})  # a deleted file is gone
        commit = (_git(root, "rev-parse", "HEAD") or "").strip() or None
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        return root, files, commit, (bool(status.strip()) if status is not None else None)
    files = [
        str(p.relative_to(root)) for p in sorted(package.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
    ]
    return root, files, None, None


def create_snapshot(run_dir: str | os.PathLike[str]) -> Snapshot:
    """Copy the code into a new ``<run_dir>/code/<time>-<pid>/`` and record it there."""
    root, files, commit, dirty = package_source()
    dest = RunDir(run_dir).code_snapshot(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    dest.mkdir(parents=True, exist_ok=False)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    record = {"source": str(root), "git_commit": commit, "dirty": dirty, "files": len(files), "time": time.time()}
    atomic_write(dest / RunDir.SNAPSHOT_RECORD, json.dumps(record, indent=1) + "\n")
    return Snapshot(dest, root, commit, dirty)

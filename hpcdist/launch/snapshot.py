"""A frozen copy of the code a job runs (``hpcdist submit --snapshot``, the default): edits on the login node after
submission change neither a queued job nor its requeued attempts.

The copy is the git-tracked files of the checkout hpcdist is imported from, plus new files git does not ignore
(their working-tree content, so local edits are included; edits to tracked files are recorded as dirty), or the
installed package directory when hpcdist is not imported from a git checkout. Never data: the top-level ``runs/``,
``data/`` and the like (:data:`IGNORED_DIRS`), virtualenvs, caches and the run dir itself are left out, and a copy
over ``HPCDIST_SNAPSHOT_MAX_MB`` (100 MiB) is refused before anything is copied, naming the largest files. It goes to
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

from hpcdist.base.atomic import atomic_write
from hpcdist.base.errors import LaunchError
from hpcdist.base.rundir import RunDir

__all__ = ["IGNORED_DIRS", "MAX_MB_ENV", "Snapshot", "create_snapshot", "package_source"]

# Not code, even where git does not ignore them: `hpcdist prepare --out data/corpus` (the README's example) and run
# dirs live in the checkout, and one copy per submit of a dataset is terabytes. Only at the checkout's top level
# (hpcdist/data/ is source); a top-level folder holding pyvenv.cfg is a virtualenv whatever its name.
IGNORED_DIRS = frozenset({"runs", "data", "datasets", "checkpoints", "outputs", "wandb", "mlruns", "build", "dist"})
# ...and these anywhere: caches, virtualenvs, other tools' state
_IGNORED_ANYWHERE = frozenset(
    {".venv", "venv", "__pycache__", "node_modules", ".git", ".tox", ".nox", ".mypy_cache", ".pytest_cache"}
    | {".ruff_cache", ".ipynb_checkpoints"}
)
MAX_MB_ENV = "HPCDIST_SNAPSHOT_MAX_MB"
_DEFAULT_MAX_MB = 100  # this package's source is ~3 MiB: a hundred MiB is already something that is not code


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


def package_source(root: Path | None = None) -> tuple[Path, list[str], str | None, bool | None]:
    """(root, files relative to it, git commit, dirty) of the hpcdist being imported (or of the checkout ``root``)."""
    package = Path(__file__).resolve().parents[1]  # hpcdist/ (this file is hpcdist/launch/snapshot.py)
    root = package.parent if root is None else Path(root).resolve()
    package = root / "hpcdist"
    top = _git(root, "rev-parse", "--show-toplevel")
    # tracked files and new ones git does not ignore: a module created but not yet added is imported from the
    # checkout too, so the job must have it
    in_git = top is not None and Path(top.strip()).resolve() == root
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard") if in_git else None
    if listed is not None:
        # a deleted file is gone; data, runs and virtualenvs are not code
        files = sorted({f for f in listed.split("\0") if f and not _ignored(root, f) and (root / f).is_file()})
        commit = (_git(root, "rev-parse", "HEAD") or "").strip() or None
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        return root, files, commit, (bool(status.strip()) if status is not None else None)
    files = [
        str(p.relative_to(root)) for p in sorted(package.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
    ]
    return root, files, None, None


def _ignored(root: Path, rel: str) -> bool:
    parts = Path(rel).parts
    if len(parts) > 1 and (parts[0] in IGNORED_DIRS or (root / parts[0] / "pyvenv.cfg").is_file()):
        return True
    return any(p in _IGNORED_ANYWHERE or p.endswith(".egg-info") for p in parts[:-1])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _max_bytes() -> int:
    text = os.environ.get(MAX_MB_ENV, "").strip()
    if not text:
        return _DEFAULT_MAX_MB << 20
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb > 0 or mb != mb or mb == float("inf"):
        raise LaunchError(f"{MAX_MB_ENV}={text!r} is not a size: give the code snapshot's cap in MiB, e.g. 500")
    return int(mb * (1 << 20))


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.absolute().relative_to(folder)
    except ValueError:
        return False
    return True


def _check_size(root: Path, files: list[str], max_bytes: int) -> None:
    """Refuse, before copying anything, a snapshot over the cap: one line naming the largest files and the ways out."""
    sizes = []
    for rel in files:
        try:
            sizes.append((os.stat(root / rel).st_size, rel))
        except OSError:
            continue  # removed meanwhile: copying will say so
    total = sum(n for n, _ in sizes)
    if total <= max_bytes:
        return
    largest = ", ".join(f"{rel} ({_size(n)})" for n, rel in sorted(sizes, reverse=True)[:5])
    raise LaunchError(
        f"the code snapshot of {root} would copy {_size(total)} in {len(files)} files, over its cap of "
        f"{_size(max_bytes)}; largest: {largest}. Ignore what is not code (.gitignore, or move it under data/ or "
        f"runs/, never copied), raise the cap ({MAX_MB_ENV}=MiB), or submit with --no-snapshot"
    )


def create_snapshot(
    run_dir: str | os.PathLike[str], *, root: Path | None = None, max_bytes: int | None = None
) -> Snapshot:
    """Copy the code into a new ``<run_dir>/code/<time>-<pid>/`` and record it there."""
    root, files, commit, dirty = package_source(root)
    run = Path(run_dir).absolute()
    files = [f for f in files if not _inside(root / f, run)]  # earlier snapshots, logs: a run dir in the checkout
    _check_size(root, files, _max_bytes() if max_bytes is None else max_bytes)
    dest = RunDir(run_dir).code_snapshot(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    dest.mkdir(parents=True, exist_ok=False)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    record = {"source": str(root), "git_commit": commit, "dirty": dirty, "files": len(files), "time": time.time()}
    atomic_write(dest / RunDir.SNAPSHOT_RECORD, json.dumps(record, indent=1) + "\n")
    return Snapshot(dest, root, commit, dirty)

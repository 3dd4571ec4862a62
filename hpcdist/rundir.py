"""The run directory's layout: every file and folder a run keeps in ``run.dir``, named in one place.

README.md's "Run directory" section documents the same tree (tests/unit/test_rundir.py keeps them in step). Every
module that reads or writes one of these asks a ``RunDir`` for the path instead of joining a name itself, so a
rename is one edit and the layout a user reads about is the layout the code writes. Standard library only: the
torch-free config, the scheduler side (launch/) and the per-rank side (fault/, trainer) all use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunDir"]


@dataclass(frozen=True)
class RunDir:
    """``RunDir(cfg.run.dir).metrics`` etc.; the attributes are paths, nothing is created or read here."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        """The resolved config of the run (written by rank 0 once a resume was accepted)."""
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        """One JSON line per logged step (appended across attempts; readers keep the last line per step)."""
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def data(self) -> Path:
        """Token shards of the embedded corpus (data.source=stdlib without data.path)."""
        return self.root / "data"

    @property
    def checkpoints(self) -> Path:
        """step-N/ checkpoint directories (unless checkpoint.dir puts them elsewhere)."""
        return self.root / "checkpoints"

    @property
    def failures(self) -> Path:
        """failures.jsonl: who, where and why, from the trainer, the watchdog and the per-rank supervisor."""
        return self.root / "failures.jsonl"

    @property
    def restarts(self) -> Path:
        """The restart ledger: requeue / preemption / failure budgets and excluded nodes (launch/restarts.py)."""
        return self.root / "restarts.json"

    @property
    def goodput(self) -> Path:
        """Wall time by category across attempts (fault/goodput.py)."""
        return self.root / "goodput.json"

    @property
    def lock(self) -> Path:
        """Held (flock) by rank 0 while a run uses this directory (fault/rundir_lock.py)."""
        return self.root / "run.lock"

    @property
    def ranks(self) -> Path:
        """Which host runs which rank."""
        return self.root / "ranks.json"

    @property
    def heartbeats(self) -> Path:
        """One heartbeat file per rank for the hang watchdog (fault/hang.py)."""
        return self.root / "heartbeats"

    @property
    def profile(self) -> Path:
        """logging.profile: a torch.profiler Chrome trace per rank (trace-rank-<r>.json) and, on CUDA with
        logging.profile.memory, a memory snapshot per rank (memory-rank-<r>.pickle)."""
        return self.root / "profile"

    def error_log(self, when: str, pid: int) -> Path:
        """Where the CLI's last-resort handler keeps an unexpected error's traceback (``when``: a timestamp)."""
        return self.root / f"hpcdist-error-{when}-{pid}.log"

    @property
    def slurm_logs(self) -> Path:
        """Batch jobs' stdout/stderr unless the cluster profile sets log_dir."""
        return self.root / "slurm"

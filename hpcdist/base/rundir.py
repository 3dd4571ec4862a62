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
    SNAPSHOT_RECORD = "snapshot.json"
    """In each code snapshot: source, git commit, dirty flag, file count (launch/snapshot.py)."""

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
    def local_checkpoints(self) -> Path:
        """local_checkpoints.json: the node-local tier's newest step (checkpoint.local; rank 0 after each save)."""
        return self.root / "local_checkpoints.json"

    @property
    def failures(self) -> Path:
        """failures.jsonl: who, where and why, from the trainer, the watchdog and the per-rank supervisor."""
        return self.root / "failures.jsonl"

    @property
    def skipped_samples(self) -> Path:
        """skipped_samples.json: sample ids the NaN triage found bad (train.nonfinite=skip), skipped on resume too."""
        return self.root / "skipped_samples.json"

    @property
    def restarts(self) -> Path:
        """The restart ledger: requeue / preemption / failure budgets and excluded nodes (launch/restarts.py)."""
        return self.root / "restarts.json"

    @property
    def goodput(self) -> Path:
        """Wall time by category across attempts (fault/goodput.py)."""
        return self.root / "goodput.json"

    @property
    def summary(self) -> Path:
        """run_summary.json: steps, tokens, wall time, goodput, best eval, last checkpoint (rank 0, end of attempt)."""
        return self.root / "run_summary.json"

    @property
    def report(self) -> Path:
        """report.html: `hpcdist report`'s self-contained page (images embedded)."""
        return self.root / "report.html"

    @property
    def report_images(self) -> Path:
        """The report's PNGs, one per figure (`hpcdist report`)."""
        return self.root / "report"

    @property
    def trackers(self) -> Path:
        """trackers.json: the W&B / MLflow run ids, so a resumed attempt continues the same tracker run."""
        return self.root / "trackers.json"

    @property
    def wandb(self) -> Path:
        """W&B's own files (offline runs wait here for `wandb sync`)."""
        return self.root / "wandb"

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
    def code(self) -> Path:
        """Code snapshots of submitted jobs, one <time>-<pid>/ per submission (launch/snapshot.py)."""
        return self.root / "code"

    def code_snapshot(self, name: str) -> Path:
        """One submission's frozen copy of the code (first on the job's PYTHONPATH), with snapshot.json."""
        return self.code / name

    @property
    def jobs(self) -> Path:
        """One JSON line per job submitted for this run (id, executor, log folder, host): status/logs/cancel read it
        for local-executor jobs and when SLURM has forgotten a job (launch/records.py)."""
        return self.root / "jobs.jsonl"

    @property
    def sweep(self) -> Path:
        """A sweep's record in its base run.dir: array job id, each task's overrides and run dir (launch/sweep.py);
        the tasks' runs are <run.dir>/<their overrides>/."""
        return self.root / "sweep.json"

    def append_only(self) -> tuple[Path, ...]:
        """The files several writers append lines to (never replaced): opened only through
        hpcdist.base.atomic.open_append, and checked before a run starts (hpcdist.config.dirs)."""
        return (self.metrics, self.failures, self.jobs)

    @property
    def slurm_logs(self) -> Path:
        """Batch jobs' stdout/stderr unless the cluster profile sets log_dir."""
        return self.root / "slurm"

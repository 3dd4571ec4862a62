"""What a scheduler module provides (:class:`Scheduler`), and what it fills: :class:`JobFacts`, the job's facts in a
form no caller needs to know the scheduler for. Standard library only: the batch script's ``after-step`` and the
per-rank start-up read it before torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

__all__ = ["EnvReader", "JobFacts", "Scheduler"]


@dataclass(frozen=True)
class JobFacts:
    """The batch job this process belongs to, as its scheduler describes it; ``JobFacts()`` outside any scheduler.

    Filled once per read by the scheduler table (:func:`hpcdist.schedulers.job_facts`); a rank receives it as
    ``DistEnv.job``. Requeueing is the scheduler's launch code's (``hpcdist.launch``), named by ``scheduler`` and
    aimed at ``job_id``.
    """

    job_id: str | None = None
    """The id the scheduler requeues, and that restart ledgers, failure records, heartbeats and the run-dir lock
    name: an array task's is its array id (SLURM: ``<array job>_<task>``), which ``scontrol requeue`` needs."""
    restart_count: int = 0
    """The attempt number of this job: how often it was restarted before this attempt, by the scheduler (a
    requeue) or inside its allocation (an in-job restart, hpcdist.launch.attempts)."""
    _: KW_ONLY
    scheduler: str | None = None
    """Which scheduler's table entry read these facts ("slurm"); None outside any scheduler."""
    instance_id: str | None = None
    """This job's own id, different for every job that may share a node (SLURM: the job id with the array task
    appended, ``<job>_<task>``): DistEnv.job_id, which seeds the rendezvous port. Not ``job_id``'s rule: changing
    it would move every array task's port."""
    array_job_id: str | None = None
    array_task_id: str | None = None
    partition: str | None = None
    """Where the job runs: node exclusion checks that the partition keeps enough usable nodes."""
    num_nodes: int | None = None
    node_list: str | None = None
    """The job's nodes in the scheduler's own compressed form (SLURM: ``gpu[001-004]``); its module expands it."""


class EnvReader:
    """Reads a launcher's or scheduler's variables and collects every problem, so one error lists them all."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.problems: list[str] = []

    def get(self, name: str) -> str | None:
        # Shell scripts often export empty variables (`export MASTER_PORT=${MASTER_PORT:-}`): empty = unset.
        value = self.environ.get(name)
        return value.strip() if value is not None and value.strip() else None

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def first(self, *names: str) -> str | None:
        """Name of the first of `names` that is set."""
        return next((name for name in names if self.has(name)), None)

    def integer(self, name: str | None, *, default: int | None = None, minimum: int = 0, needed: str = "") -> int:
        raw = self.get(name) if name else None
        if raw is None:
            if default is None:
                self.problems.append(f"{needed or name} is not set")
                return minimum
            return default
        try:
            value = int(raw)
        except ValueError:
            self.problems.append(f"{name}={raw!r} is not an integer")
            return minimum
        if value < minimum:
            self.problems.append(f"{name}={raw!r} must be >= {minimum}")
            return minimum
        return value

    def check(self, what: str) -> None:
        if self.problems:
            raise ValueError(f"cannot read the {what} environment: " + "; ".join(self.problems))


@dataclass(frozen=True)
class Scheduler:
    """One row of the scheduler table (:data:`hpcdist.schedulers.SCHEDULERS`): all a rank needs from a scheduler.

    ``job_facts(environ)``: this job's facts, or None when the process does not run under this scheduler.
    ``step_layout(reader)``: when the scheduler's own launcher (srun) started this process as one rank of a job step,
    its place: rank, local_rank, world_size, local_world_size, node_rank, num_nodes, master_addr (problems go to the
    reader); else None. ``reads``: the variables that layout reads, echoed in errors.
    """

    name: str
    job_facts: Callable[[Mapping[str, str]], JobFacts | None]
    step_layout: Callable[[EnvReader], dict[str, Any] | None]
    reads: tuple[str, ...]

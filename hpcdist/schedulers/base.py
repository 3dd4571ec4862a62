"""What a scheduler package provides, modelled on submitit's JobEnvironment / Executor / Job: its row of the table
(:class:`Scheduler`: the job's facts, :class:`JobFacts`, in a form no caller needs to know the scheduler for, and a
task's place in a job step) and its :class:`Launcher` (the submitting and batch-script side: tools, job states,
requeue, the allocation and its steps). Standard library only: the batch script's ``after-step`` and the per-rank
start-up read it before torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["ATTEMPT_ENV", "Allocation", "EnvReader", "JobFacts", "Launcher", "Scheduler", "SchedulerError"]

# Set by hpcdist.launch.attempts in each step it starts: the attempt number (JobFacts.restart_count).
ATTEMPT_ENV = "HPCDIST_ATTEMPT"


class SchedulerError(RuntimeError):
    """A scheduler's tool is missing, timed out, or refused the request (its own message, one line)."""


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
    variable_prefix: str | None = None
    """The prefix of every variable the scheduler sets in a job (``SLURM_``): a job started outside it drops them."""
    launcher: Launcher | None = None
    """The submitting and batch-script side (hpcdist.launch uses it); None for a scheduler hpcdist only runs under."""


@dataclass(frozen=True)
class Allocation:
    """The nodes a batch job holds, in the scheduler's order, and what it asked for on each."""

    nodes: list[str]
    tasks_per_node: int
    gpus_per_node: int | None = None
    """None: the job asked for no GPU (e.g. a CPU partition), or the count could not be read."""


class Launcher(Protocol):
    """A scheduler's tools, as hpcdist.launch (scheduler-neutral) drives them: submitit's Executor and Job side.

    Every call that asks the scheduler has a timeout and raises :class:`SchedulerError` with the tool's own
    message."""

    name: str
    """The scheduler's name, as in its :class:`Scheduler` row and ``JobFacts.scheduler``."""
    title: str
    """The scheduler's name as users write it, in messages ("SLURM does not know it now")."""
    submit_command: str
    """The word users know for submitting a batch script (messages only: "plain sbatch jobs")."""
    step_tool: str
    """The program that starts a job step's tasks (messages, usage lines: "srun exited with status 1")."""
    terminal_states: frozenset[str]
    """Job states after which a job never runs again."""
    timeout_env: str
    """The variable that raises the controller check's timeout (named in the hint for a slow controller)."""

    def installed(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the scheduler's client is installed here (its submit tool on PATH)."""
        ...

    def reachable(self, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
        """(True, how) when its controller answers and jobs can start steps here; else (False, why)."""
        ...

    def check_job_id(self, job_id: str) -> str: ...

    def job_info(self, job_id: str) -> dict[str, str]: ...

    def job_state(self, job_id: str) -> str | None: ...

    def state_and_restarts(self, job_id: str) -> tuple[str, str] | None:
        """(state, how often it was requeued) as the controller tells them ("?" where it says nothing); None when
        the controller no longer knows the job."""
        ...

    def job_log_dir(self, job_id: str) -> Path | None:
        """Where the job writes its stdout (while the scheduler remembers it); None when unknown."""
        ...

    def cancel(self, job_id: str) -> str: ...

    def status_text(self, job_id: str | None = None) -> str: ...

    def log_path(
        self, job_id: str, *, rank: int = 0, err: bool = False, run_dir: str | os.PathLike[str] | None = None
    ) -> Path: ...

    def requeue(self, job_id: str, *, exclude: Iterable[str] = ()) -> int:
        """Requeue the job, off ``exclude`` at its next start: 0, else 4 (said why)."""
        ...

    def usable_nodes(self, partition: str | None) -> list[str] | None: ...

    def expand_nodes(self, nodelist: str) -> list[str]:
        """The scheduler's compressed node list (``JobFacts.node_list``, exclusion files) as host names."""
        ...

    def allocation(self, environ: Mapping[str, str]) -> Allocation | str:
        """This batch job's allocation, or why it cannot be read."""
        ...

    def run_gate(self, nodes: Sequence[str], argv: Sequence[str], *, timeout: float) -> tuple[str, int | None] | None:
        """``argv`` once per node of ``nodes``: (stdout, exit status or None on timeout); None without a launcher."""
        ...

    def step_command(
        self,
        cmd: Sequence[str],
        nodes: Sequence[str],
        tasks_per_node: int,
        *,
        keep_survivors: bool = False,
        spares: bool = False,
    ) -> list[str]:
        """The batch script's step command ``cmd`` restricted to ``nodes``; ``keep_survivors``: a task's death
        leaves the other tasks running (in-process recovery); ``spares``: the warm spares' step, whose per-task
        output files must not be the training step's."""
        ...

    def batch_host(self, environ: Mapping[str, str]) -> str | None:
        """The name the job's other nodes reach the batch shell's node by (None: unknown)."""
        ...

    def job_parameters(
        self,
        cluster: Any,
        *,
        job_name: str,
        signal: str,
        setup: list[str],
        loop_python: str,
        run_dir: str | Sequence[str] | None = None,
        fault: Any | None = None,
    ) -> dict[str, Any]:
        """The submitit executor's parameters for a job of cluster profile ``cluster`` (a ClusterConfig):
        ``setup`` lines before the step, which runs under the attempt loop (started by ``loop_python``) when
        ``run_dir`` is given."""
        ...

    def render_script(
        self,
        params: dict[str, Any],
        *,
        command: str,
        folder: Path,
        dependency: str | None = None,
        array: int | None = None,
        max_parallel: int | None = None,
    ) -> str:
        """The batch script the executor would submit for ``params`` (deterministic, for dry runs and goldens)."""
        ...

    def flag_overrides(self, args: Any, profile: Callable[[], Any]) -> dict[str, Any]:
        """Cluster-profile overrides from ``hpcdist submit``'s scheduler flags (``args``, the parsed command line):
        added to the profile's own (``profile()`` loads it, only when needed), not instead of them; {} when none."""
        ...

    def executor(self, folder: Path, *, python: str, params: dict[str, Any]) -> Any:
        """The submitit executor that submits jobs of ``params``, each task started by ``python``."""
        ...

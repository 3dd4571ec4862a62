"""The schedulers hpcdist runs under, as a table: each row (:class:`~hpcdist.schedulers.base.Scheduler`) reads one
scheduler's variables into the scheduler-neutral :class:`JobFacts`, where the scheduler's own step launcher starts
the ranks, a task's place in the job step, and carries the scheduler's :class:`Launcher` (its tools: submit side,
batch-script side). Standard library only.

Everything receives these facts (``DistEnv.job``, or :func:`job_facts` where no DistEnv is at hand) and knows no
scheduler; ``hpcdist.launch`` drives a scheduler through :func:`launcher`. Adding one (PBS, Kubernetes): a package
beside ``slurm/`` and its row in :data:`SCHEDULERS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hpcdist.schedulers import slurm
from hpcdist.schedulers.base import ATTEMPT_ENV, Allocation, EnvReader, JobFacts, Launcher, Scheduler, SchedulerError

__all__ = [
    "ATTEMPT_ENV",
    "DEFAULT",
    "SCHEDULERS",
    "Allocation",
    "EnvReader",
    "JobFacts",
    "Launcher",
    "Scheduler",
    "SchedulerError",
    "job_facts",
    "launcher",
    "scheduler_variables",
    "step_layout",
]

# Asked in this order; the first that recognises the environment wins.
SCHEDULERS: tuple[Scheduler, ...] = (slurm.SCHEDULER,)
# The scheduler a login node submits to: cluster profiles name no scheduler of their own yet.
DEFAULT = slurm.SCHEDULER.name


def job_facts(environ: Mapping[str, str] | None = None) -> JobFacts:
    """The facts of the job this process runs in (``environ`` defaults to ``os.environ``); ``JobFacts()`` outside
    every scheduler of the table."""
    environ = os.environ if environ is None else environ
    for scheduler in SCHEDULERS:
        facts = scheduler.job_facts(environ)
        if facts is not None:
            return facts
    return JobFacts()


def step_layout(reader: EnvReader) -> tuple[Scheduler, dict[str, Any]] | None:
    """(the scheduler, this task's place) when a scheduler's own launcher started this process; else None."""
    for scheduler in SCHEDULERS:
        fields = scheduler.step_layout(reader)
        if fields is not None:
            return scheduler, fields
    return None


def launcher(name: str | None = None) -> Launcher:
    """The :class:`Launcher` of scheduler ``name`` (default: the job's own scheduler, else :data:`DEFAULT`)."""
    if name is None:
        try:
            name = job_facts().scheduler or DEFAULT
        except ValueError:  # a garbled count: the job is still its scheduler's, whose reader said so
            name = DEFAULT
    for scheduler in SCHEDULERS:
        if scheduler.name == name and scheduler.launcher is not None:
            return scheduler.launcher
    known = [s.name for s in SCHEDULERS if s.launcher is not None]
    raise ValueError(f"no launcher for scheduler {name!r}; known: {', '.join(known)}")


def scheduler_variables(environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` that a scheduler of the table set (a job started outside it drops them)."""
    prefixes = tuple(s.variable_prefix for s in SCHEDULERS if s.variable_prefix)
    return [name for name in environ if prefixes and name.startswith(prefixes)]

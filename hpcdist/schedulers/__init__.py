"""The schedulers hpcdist runs under, as a table: each row (:class:`~hpcdist.schedulers.base.Scheduler`) reads one
scheduler's variables into the scheduler-neutral :class:`JobFacts` and, where the scheduler's launcher starts the
ranks itself (srun), a task's place in the job step. Standard library only.

Everything below ``hpcdist.launch`` receives these facts (``DistEnv.job``, or :func:`job_facts` where no DistEnv is at
hand) and knows no scheduler. Adding one (PBS, Kubernetes): a module beside ``slurm.py`` and its row in
:data:`SCHEDULERS`; submitting and requeueing are ``hpcdist.launch``'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hpcdist.schedulers import slurm
from hpcdist.schedulers.base import EnvReader, JobFacts, Scheduler

__all__ = ["SCHEDULERS", "EnvReader", "JobFacts", "Scheduler", "job_facts", "step_layout"]

# Asked in this order; the first that recognises the environment wins.
SCHEDULERS: tuple[Scheduler, ...] = (slurm.SCHEDULER,)


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

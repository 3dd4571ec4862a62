"""The scheduler's side of one rank: :class:`SlurmEnvironment`, hpcdist.run's JobEnvironment for ``hpcdist train``
(under the scheduler's step launcher, torchrun or alone) and for every task of ``hpcdist submit``.

Before the process group: the job's NCCL profile and this attempt in the restart ledger; after a stop: the requeue
decision (hpcdist.launch.restarts.after_stop). Outside SLURM both find no job and do nothing.
"""

from __future__ import annotations

import os

from hpcdist.base.logging_utils import log0
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.fault.stop import StopReason
from hpcdist.launch import restarts
from hpcdist.launch.nccl import PROFILE_ENV, apply_to_environ

__all__ = ["SlurmEnvironment"]


class SlurmEnvironment:
    """See the module docstring."""

    def before_start(self, cfg: JobConfig, env: DistEnv) -> str | None:
        """Every rank, before the process group: the job's NCCL profile (interface names differ between hosts; a
        no-op unless the job names one: hpcdist submit exports HPCDIST_NCCL_PROFILE) and this attempt in the restart
        ledger. Returns a reason not to train (fault.max_preemptions spent), else None."""
        for line in apply_to_environ(os.environ.get(PROFILE_ENV), master_addr=env.master_addr):
            log0("%s", line)
        policy = restarts.RestartPolicy.from_fault(cfg.fault)
        return restarts.begin_attempt(cfg.run.dir, policy, env.job, write=env.is_main)

    def after_stop(self, cfg: JobConfig, env: DistEnv, reason: StopReason) -> int:
        """Every rank, once the stop checkpoint is complete: rank 0 requeues after the time-limit signal (within
        fault.max_restarts), or every rank exits. Returns the exit code."""
        f = cfg.fault
        return restarts.after_stop(
            reason,
            rank=env.rank,
            requeue_signal=f.requeue_signal,
            requeue_enabled=f.requeue,
            max_restarts=f.max_restarts,
            run_dir=cfg.run.dir,
            job=env.job,
        )

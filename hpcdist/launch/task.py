"""What submitit pickles and runs in every task of a submitted job: :class:`TrainTask`."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrainTask", "local_rank_environ"]

# submitit's LocalExecutor exits a task with this code to have its controller restart all tasks (its
# stand-in for a SLURM requeue; submitit.local.local.LOCAL_REQUEUE_RETURN_CODE).
LOCAL_REQUEUE_EXIT_CODE = 144


def local_rank_environ(environ: MutableMapping[str, str]) -> None:
    """In a task of submitit's LocalExecutor, set torchrun-style rank variables; elsewhere do nothing.

    Local tasks carry only SUBMITIT_LOCAL_* variables, so without this every task would see itself as a
    single process (rank 0 of 1). SLURM_* variables inherited from an enclosing allocation are removed: the
    local job is no part of it, and the trainer would otherwise requeue that allocation on preemption.
    """
    if environ.get("SUBMITIT_EXECUTOR") != "local":
        return
    from hpcdist.env import port_from_job_id  # imports torch: only in a local task, never on the submitting side

    for name in [n for n in environ if n.startswith("SLURM_")]:
        del environ[name]
    ntasks = environ.get("SUBMITIT_LOCAL_NTASKS", "1")
    environ.update(
        RANK=environ.get("SUBMITIT_LOCAL_GLOBALID", "0"),
        LOCAL_RANK=environ.get("SUBMITIT_LOCAL_LOCALID", "0"),
        WORLD_SIZE=ntasks,
        LOCAL_WORLD_SIZE=ntasks,
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        # the controller's pid is the job id: tasks agree on it, and concurrent local jobs differ
        MASTER_PORT=str(port_from_job_id(environ.get("SUBMITIT_LOCAL_JOB_ID"))),
    )


@dataclass(frozen=True)
class TrainTask:
    """Runs exactly what ``hpcdist train CONFIG OVERRIDES`` runs, in one task (rank) of a submitted job.

    submitit pickles this object (by reference to this module: the nodes import the installed hpcdist) and
    calls it in every task; each task's return value becomes that rank's result pickle.

    There is deliberately no ``checkpoint()`` method. submitit would call it from its own SIGUSR2 handler, on
    rank 0 only, and requeue by itself: a sharded checkpoint needs every rank to save collectively. Instead the
    trainer installs its own SIGUSR2/SIGTERM handlers at startup (replacing submitit's), agrees on the
    preemption flag across ranks (hpcdist.fault.stop), saves on all ranks, and returns; rank 0 then requeues the
    job (SlurmEnvironment.after_stop, hpcdist.launch.restarts). After
    a requeue the task must not return normally (submitit would record a result and ``JobHandle.wait`` would
    stop): ``__call__`` raises SystemExit instead, which submitit does not catch.

    The trainer takes the signal from the training config (``fault.requeue_signal``); ``submit`` checks that it
    matches the cluster's ``signal``.
    """

    config_path: str
    """Absolute path of the YAML config; read when the job starts (keep it unchanged until then)."""
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # absolute: the job may start in another working directory than the one it was submitted from
        object.__setattr__(self, "config_path", str(Path(self.config_path).expanduser().absolute()))
        object.__setattr__(self, "overrides", tuple(self.overrides))

    def __call__(self) -> dict[str, Any]:
        local_rank_environ(os.environ)
        # imported here, in the task: submitting needs neither the training stack nor the restart policy (and
        # hpcdist.launch, which imports this module, stays free of them)
        from hpcdist.fault.stop import StopReason
        from hpcdist.launch.job import SlurmEnvironment
        from hpcdist.run import main

        result = main(self.config_path, self.overrides, job=SlurmEnvironment())
        if result.stop_reason != StopReason.NONE:
            # Stopped by a signal after a complete checkpoint. Leave without a result: on SLURM the requeued job
            # (or a resubmission) continues it; on the LocalExecutor this exit code makes the controller
            # restart the tasks, the local stand-in for a requeue.
            local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
            # outside SLURM after_stop ends a time-limit stop with 128 + the signal (never 0: nothing continues a
            # plain run); a refusal or failure has another code and is not restarted
            requeue = local and result.stop_reason == StopReason.TIME_LIMIT and result.exit_code > 128
            raise SystemExit(LOCAL_REQUEUE_EXIT_CODE if requeue else result.exit_code)
        if result.exit_code:
            raise SystemExit(result.exit_code)
        last = max(result.losses) if result.losses else None
        return {
            "step": result.step,
            "loss": result.losses[last] if last is not None else None,
            "loss_step": last,
            "resumed_from": result.resumed_from,
        }

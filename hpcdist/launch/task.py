"""What submitit pickles and runs in every task of a submitted job: :class:`TrainTask`, and each task's result
record, ``<folder>/<job>_<rank>_result.json``.

submitit also leaves each task's outcome as a pickle (``<job>_<rank>_result.pkl``), but hpcdist never loads it:
a log folder may be shared (cluster ``log_dir``), and a record in jobs.jsonl names any folder, so a pickle there
may be another user's, and unpickling it runs their code as whoever typed ``hpcdist status``. The
task writes its outcome as JSON too; :func:`read_result` reads that, and only when nobody else could have written it.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrainTask", "local_rank_environ", "read_result", "result_path", "write_result"]

_RESULT_MAX_BYTES = 1 << 20  # a step count, a loss and a traceback tail fit many times over
_TRACEBACK_CHARS = 8000

# submitit's LocalExecutor exits a task with this code to have its controller restart all tasks (its
# stand-in for a SLURM requeue; submitit.local.local.LOCAL_REQUEUE_RETURN_CODE).
LOCAL_REQUEUE_EXIT_CODE = 144


def local_rank_environ(environ: MutableMapping[str, str]) -> None:
    """In a task of submitit's LocalExecutor, set torchrun-style rank variables; elsewhere do nothing.

    Local tasks carry only SUBMITIT_LOCAL_* variables, so without this every task would see itself as a
    single process (rank 0 of 1). A scheduler's variables inherited from an enclosing allocation are removed: the
    local job is no part of it, and the trainer would otherwise requeue that allocation on preemption.
    """
    if environ.get("SUBMITIT_EXECUTOR") != "local":
        return
    from hpcdist.env import port_from_job_id  # only in a local task: the submitting side needs no rank facts
    from hpcdist.schedulers import scheduler_variables

    for name in scheduler_variables(environ):
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


# ------------------------------------------------------------------------------------------------ result records


def result_path(folder: str | os.PathLike[str], job_id: str, rank: int) -> Path:
    """Where task ``rank`` of job ``job_id`` records its outcome: beside submitit's result pickle, named alike."""
    from submitit.core.utils import JobPaths  # the job id formatting submitit uses (array jobs: 123_4)

    return JobPaths(Path(folder), job_id=str(job_id), task_id=rank).result_pickle.with_suffix(".json")


def write_result(folder: str | os.PathLike[str], job_id: str, rank: int, outcome: tuple[str, Any]) -> None:
    """Record ``("success", value)`` or ``("error", traceback text)`` for task ``rank`` (atomically)."""
    from hpcdist.base.atomic import atomic_write

    kind, value = outcome
    atomic_write(result_path(folder, job_id, rank), json.dumps({"outcome": kind, "value": value}, default=str))


def read_result(folder: str | os.PathLike[str], job_id: str, rank: int) -> tuple[str, Any] | None:
    """``("success", value)`` / ``("error", traceback)`` from task ``rank``'s record; None when it wrote none, or
    when the file is not one the task wrote (another user's, a link, unreadable, not such a record)."""
    from hpcdist.base.atomic import read_trusted

    path = result_path(folder, job_id, rank)
    try:
        data = read_trusted(path, _RESULT_MAX_BYTES)
        record = json.loads(data) if data is not None else None
    except (OSError, ValueError) as e:  # not ours, or garbled: no result (the job's state says the rest)
        import logging

        logging.getLogger(__name__).warning("ignoring %s: %s", path, e)
        return None
    if not (isinstance(record, dict) and record.get("outcome") in ("success", "error")):
        return None
    return record["outcome"], record.get("value")


def _is_spare(environ: MutableMapping[str, str]) -> bool:
    from hpcdist.fault.inprocess import SPARE_ENV  # in the task only, like the training stack

    return environ.get(SPARE_ENV, "").strip() == "1"


def _record_outcome(outcome: tuple[str, Any], rank: int | None = None) -> None:
    """In a submitit task: write the result record of ``rank`` (default: this task's number); nothing when called
    outside submitit."""
    folder = os.environ.get("SUBMITIT_FOLDER")
    if not folder:
        return
    import submitit

    env = submitit.JobEnvironment()
    try:
        write_result(folder, env.job_id, env.global_rank if rank is None else rank, outcome)
    except OSError as e:  # the job's own result is not lost with it: its log and state still say what happened
        print(f"hpcdist: could not write the result record: {e}", flush=True)


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
        # absolute: the job may start in another working directory than the one it was submitted from; a shipped
        # example's name (``demo``) is its file inside the package
        from hpcdist.config.loader import config_file

        object.__setattr__(self, "config_path", str(config_file(self.config_path).absolute()))
        object.__setattr__(self, "overrides", tuple(self.overrides))

    def __call__(self) -> dict[str, Any]:
        # the outcome as submitit records it (success or an exception), in a record hpcdist can read without
        # unpickling; a SystemExit (stop, requeue, exit code) leaves none, as it leaves submitit's none
        spare = _is_spare(os.environ)
        try:
            value = self._run()
        except Exception:
            if not spare:  # a spare's task number is no rank's: its log keeps the error
                _record_outcome(("error", traceback.format_exc()[-_TRACEBACK_CHARS:]))
            raise
        if spare:
            # A warm spare runs in a step of its own, whose task numbers repeat the training step's: submitit's
            # result (and its pickle) would be that task number's, not the rank's. A spare that took a rank
            # records the outcome as that rank's; then, like a spare that took none, it leaves without a result.
            if value.get("rank") is not None:
                _record_outcome(("success", value), rank=int(value["rank"]))
            raise SystemExit(0)
        _record_outcome(("success", value))
        return value

    def _run(self) -> dict[str, Any]:
        from hpcdist.base import signals  # standard library only

        # as in `hpcdist train`: a stop signal during the seconds of torch imports below is
        # remembered, and the stop flag acts on it once installed, instead of submitit's handler (rank 0 only) or
        # the default action (every other rank: killed, and blamed on the node)
        signals.hold()
        try:
            return self._train()
        finally:
            signals.release()  # a no-op once the stop flag took the signals over

    def _train(self) -> dict[str, Any]:
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
            "rank": result.rank,
            "step": result.step,
            "loss": result.losses[last] if last is not None else None,
            "loss_step": last,
            "resumed_from": result.resumed_from,
        }

"""Preemption and time-limit handling: a signal sets a flag, all ranks agree at a step boundary, the trainer
saves one collective checkpoint, and rank 0 requeues the SLURM job.

Signals (both configurable through ``fault``):
- the requeue signal (USR2 by default; ``--signal=USR2@<lead>`` in every generated job, also what submitit
  uses): the time limit is near or a scheduled preemption is coming -> checkpoint, requeue, exit 0;
- SIGTERM: SLURM is ending the job now (scancel, preemption with GraceTime, or the time limit itself) ->
  checkpoint and exit without requeueing (a preempting SLURM requeues the job itself when configured to).

A handler only sets a flag: doing work inside a signal handler could interrupt a collective half-way on one
rank. Agreement uses one MAX all-reduce of a single integer per step, so every rank leaves the loop after the
same step even if the signal reached only some ranks (or reached them during different steps).
"""

from __future__ import annotations

import enum
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from hpcdist.logging_utils import get_logger

log = get_logger(__name__)


class StopReason(enum.IntEnum):
    NONE = 0
    TIME_LIMIT = 1  # the requeue signal: save, requeue, come back
    TERMINATE = 2  # SIGTERM: save and leave


@dataclass(frozen=True)
class SlurmJob:
    """What the requeue logic needs to know about the SLURM job (read here: launch may know SLURM)."""

    job_id: str | None
    restart_count: int
    partition: str | None = None
    """Where the job runs: node exclusion checks that the partition keeps enough usable nodes."""
    num_nodes: int | None = None

    @classmethod
    def from_environ(cls, environ: os._Environ[str] | dict[str, str] | None = None) -> SlurmJob:
        environ = os.environ if environ is None else environ
        job_id = environ.get("SLURM_JOB_ID") or None
        # array jobs are requeued by their own id (<array job>_<task>)
        if job_id and environ.get("SLURM_ARRAY_TASK_ID"):
            job_id = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
        nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
        return cls(
            job_id=job_id, restart_count=int(environ.get("SLURM_RESTART_COUNT") or 0),
            partition=environ.get("SLURM_JOB_PARTITION") or None, num_nodes=int(nodes) if nodes else None,
        )  # fmt: skip


def signal_number(name: str) -> signal.Signals:
    name = name.upper()
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


class PreemptionHandler:
    def __init__(
        self,
        *,
        rank: int,
        device: torch.device,
        requeue_signal: str = "USR2",
        requeue: bool = True,
        max_restarts: int = 10,
        job: SlurmJob | None = None,
        run_dir: str | os.PathLike[str] | None = None,
    ):
        self.rank, self.device = rank, device
        self.requeue_signal = signal_number(requeue_signal)
        self.requeue_enabled, self.max_restarts = requeue, max_restarts
        # where the restart ledger lives (time-limit requeues are counted there, apart from preemptions and failures)
        self.run_dir = run_dir
        self.job = job if job is not None else SlurmJob.from_environ()
        self._local = StopReason.NONE
        self._previous: dict[int, object] = {}
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def install(self, extra: Iterable[signal.Signals] = ()) -> PreemptionHandler:
        """Take over the signals (replacing submitit's own rank-0 checkpoint handler: ours saves on all ranks)."""
        for sig in (self.requeue_signal, signal.SIGTERM, *extra):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.job.job_id:
            log.info("SLURM job %s, restart %d; %s -> checkpoint + requeue, SIGTERM -> checkpoint + exit",
                     self.job.job_id, self.job.restart_count, self.requeue_signal.name)  # fmt: skip
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        reason = StopReason.TIME_LIMIT if signum == self.requeue_signal else StopReason.TERMINATE
        self._local = max(self._local, reason)  # TERMINATE wins over TIME_LIMIT: never requeue a cancelled job

    def request(self, reason: StopReason) -> None:
        """Ask to stop as if a signal had arrived (tests, watchdogs)."""
        self._local = max(self._local, reason)

    def agreed(self) -> StopReason:
        """Collective: the strongest stop reason any rank had seen one step ago. Every rank calls it every step.

        The MAX all-reduce runs asynchronously on a CPU (gloo) group and is read one step later, so it never
        stalls the step or forces a GPU sync; the stop comes one step after the signal, on every rank alike.
        """
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self._local
        result = StopReason.NONE
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            result = StopReason(int(flag.item()))
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([int(self._local)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return result

    def close(self) -> None:
        """Finish the agreement in flight and restore the previous signal handlers (every rank, at the end)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self.uninstall()

    def after_checkpoint(self, reason: StopReason) -> int:
        """Called on every rank once the stop checkpoint is complete. Rank 0 requeues. Returns the exit code."""
        if reason != StopReason.TIME_LIMIT:
            log.info("stopping on SIGTERM after a complete checkpoint; not requeueing")
            return 0
        if not self.job.job_id:
            log.info("stopped by %s outside SLURM; rerun with checkpoint.resume=auto to continue",
                     self.requeue_signal.name)  # fmt: skip
            return 0
        if not self.requeue_enabled:
            log.info("fault.requeue is off: job %s ends here; resubmit to continue", self.job.job_id)
            return 0
        from hpcdist.launch import failures  # failures imports this module

        refused = failures.time_limit_decision(self.run_dir, self.max_restarts, self.job)
        if refused:
            log.error("%s", refused)
        exclude: list[str] = []
        if self.rank == 0 and self.run_dir is not None:
            # recorded before the requeue: SLURM ends this process right after it
            exclude = failures.mark_time_limit(self.run_dir, self.job, reason=refused)
        if refused:
            return 3
        if self.rank == 0:
            return requeue(self.job.job_id, exclude=exclude)
        return 0


def requeue(job_id: str, *, exclude: Iterable[str] = ()) -> int:
    scontrol = shutil.which("scontrol")
    fallback = (
        f"resubmit a follow-up that starts when this one ends: sbatch --dependency=afterany:{job_id} <same script>; "
        "it resumes from the checkpoint just written"
    )
    if scontrol is None:
        log.error("cannot requeue job %s: scontrol is not on PATH; %s", job_id, fallback)
        return 4
    try:
        p = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        log.error("scontrol requeue %s timed out; %s", job_id, fallback)
        return 4
    if p.returncode != 0:
        log.error("scontrol requeue %s failed (%s); %s", job_id, (p.stderr or p.stdout).strip(), fallback)
        return 4
    log.info("requeued job %s; the next run resumes from the checkpoint just written", job_id)
    exclude = sorted(set(exclude))
    if exclude:
        # ExcNodeList can only change while the job is pending, i.e. now; SLURM holds a requeued job for a while
        # (BeginTime) before it may start again, so the update lands before the next start
        arg = f"ExcNodeList={','.join(exclude)}"
        try:
            p = subprocess.run([scontrol, "update", f"jobid={job_id}", arg], capture_output=True, text=True,
                               timeout=60, check=False)  # fmt: skip
            ok, why = p.returncode == 0, (p.stderr or p.stdout).strip()
        except subprocess.TimeoutExpired:
            ok, why = False, "timed out"
        if ok:
            log.info("job %s will avoid %s", job_id, ",".join(exclude))
        else:
            log.warning(
                "scontrol update jobid=%s %s failed (%s); the job may run on those nodes again", job_id, arg, why
            )
    return 0

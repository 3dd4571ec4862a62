"""Stop flag + agreement: a signal asks every rank to stop after the same step, with one collective checkpoint.

Signals (both configurable through ``fault``):
- the requeue signal (USR2 by default; ``--signal=USR2@<lead>`` in every generated job, also what submitit
  uses): the time limit is near or a scheduled preemption is coming -> StopReason.TIME_LIMIT (checkpoint, then the
  job environment requeues: hpcdist.run's after-stop decision, hpcdist.launch.requeue);
- SIGTERM: SLURM is ending the job now (scancel, preemption with GraceTime, or the time limit itself) ->
  StopReason.TERMINATE (checkpoint and exit without requeueing; a preempting SLURM requeues the job itself when
  configured to);
- SIGINT (Ctrl-C): StopReason.INTERRUPT, like SIGTERM; a second Ctrl-C aborts at once: one line, exit 130, no
  checkpoint (hpcdist.base.signals.abort; a save it cuts short has no COMPLETE marker, so nothing resumes from it).

The handlers are installed by hpcdist.run before the long start-up (data, model, resume), and take over the
signals that the entry point held from its first line (hpcdist.base.signals.hold: imports, config, data checks), so a
signal that arrives at any time is remembered and acted on after the first step instead of killing the rank (USR2's
default action).

A handler only sets a flag: doing work inside a signal handler could interrupt a collective half-way on one
rank. Agreement uses one MAX all-reduce of two integers per step (the stop reason, and a save request for
``checkpoint.every_minutes``: rank 0's clock asks, CheckpointManager.timed_save_due, and the agreed request is one
input of the checkpoint's one cadence decision, CheckpointManager.should_save), so every rank
leaves the loop after the same step even if the signal reached only some ranks (or reached them during different
steps). What happens after
the checkpoint (requeue or exit) is not decided here: the trainer returns the agreed reason.
"""

from __future__ import annotations

import enum
import os
import signal
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.signals import abort, parse_signal, previous_handler, release, stop_exit_code
from hpcdist.schedulers import JobFacts, job_facts

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = get_logger(__name__)


class StopReason(enum.IntEnum):
    """Ordered: the strongest reason any rank saw wins the agreement (never requeue a cancelled job)."""

    NONE = 0
    TIME_LIMIT = 1  # the requeue signal: save, requeue, come back
    INTERRUPT = 2  # SIGINT (Ctrl-C): save and leave
    TERMINATE = 3  # SIGTERM: save and leave

    @property
    def signal_name(self) -> str:
        return {StopReason.INTERRUPT: "SIGINT", StopReason.TERMINATE: "SIGTERM"}.get(self, "the requeue signal")

    def exit_code(self, requeue_signal: str = "USR2") -> int:
        """Exit code of a run this stopped early with no scheduler to continue it (outside SLURM, or no requeue by
        design): 128 + the signal (130 / 143 / 140 for USR2), as the shell reports a process that signal ended;
        never 0, which a wrapper would take for a finished run. 0 for NONE."""
        if self == StopReason.NONE:
            return 0
        sig = {StopReason.INTERRUPT: signal.SIGINT, StopReason.TERMINATE: signal.SIGTERM}.get(self)
        return stop_exit_code(sig if sig is not None else signal_number(requeue_signal))


def signal_number(name: str) -> signal.Signals:
    """A validated signal name (config rules checked it) -> the signal; KeyError if it names none."""
    sig = parse_signal(name)
    if sig is None:
        raise KeyError(name)
    return sig


class StopFlag:
    """See the module docstring. ``install()`` when the loop starts, ``agreed()`` every step, ``close()`` at the end."""

    def __init__(
        self,
        *,
        rank: int,
        device: torch.device,
        requeue_signal: str = "USR2",
        job: JobFacts | None = None,
    ):
        self.rank, self.device = rank, device
        self.requeue_signal = signal_number(requeue_signal)
        self.job = job if job is not None else job_facts()  # only named in the start-up line
        self._local = StopReason.NONE
        self._interrupted = False  # a Ctrl-C arrived: the next one aborts
        self._previous: dict[int, object] = {}
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self.save_requested = False  # the last agreement carried a save request (CheckpointManager.should_save)
        self.local_save_requested = False  # ... a node-local save request (CheckpointManager.local_save_due)

    def install(self, extra: Iterable[signal.Signals] = ()) -> StopFlag:
        """Take over the signals (replacing submitit's own rank-0 checkpoint handler: ours saves on all ranks)."""
        if self._previous:  # installed already (hpcdist.run does it before the start-up; the loop again)
            return self
        ours = (self.requeue_signal, signal.SIGTERM, signal.SIGINT, *extra)
        for sig in ours:
            self._previous[sig] = previous_handler(sig, signal.signal(sig, self._on_signal))
        for sig in release(ours):  # arrived during the imports and checks (hpcdist.base.signals.hold): act on them now
            self._on_signal(sig, None)
        if self.job.job_id:
            log.info(
                "%s job %s, restart %d; %s -> checkpoint + requeue, SIGTERM -> checkpoint + exit",
                (self.job.scheduler or "batch").upper(),
                self.job.job_id,
                self.job.restart_count,
                self.requeue_signal.name,
            )
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self._interrupted:
                # the user's way out (a save or a step that takes too long): one line and exit 130 now. Not
                # KeyboardInterrupt: raised inside a save it became "unexpected error: CheckpointSaveError",
                # inside a step a raw traceback
                abort(self.rank)
            self._interrupted = True
            reason = StopReason.INTERRUPT
            if self.rank == 0:  # os.write: logging is not safe inside a signal handler
                os.write(2, b"\nhpcdist: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: abort)\n")
        else:
            reason = StopReason.TIME_LIMIT if signum == self.requeue_signal else StopReason.TERMINATE
        self._local = max(self._local, reason)  # TERMINATE wins over TIME_LIMIT: never requeue a cancelled job

    def request(self, reason: StopReason) -> None:
        """Ask to stop as if a signal had arrived (tests, watchdogs)."""
        self._local = max(self._local, reason)

    def agreed(self, *, request_save: bool = False, request_local_save: bool = False) -> StopReason:
        """Collective: the strongest stop reason any rank had seen one step ago, and (``save_requested``) whether
        any rank had asked for a save (``request_save``: sent in this agreement, read by every rank in the next).
        Every rank calls it every step.

        The MAX all-reduce runs asynchronously on a CPU (gloo) group and is read one step later, so it never
        stalls the step or forces a GPU sync; the stop comes one step after the signal, on every rank alike.
        """
        # torch here, not at the top: the batch script's attempt loop (hpcdist.launch.restarts) imports StopReason
        # from this module, and importing torch there cost every job (and every requeue) 2+ s of CPU for nothing
        import torch
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.save_requested, self.local_save_requested = request_save, request_local_save
            return self._local
        result, self.save_requested, self.local_save_requested = StopReason.NONE, False, False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            result, self.save_requested = StopReason(int(flag[0])), bool(flag[1])
            self.local_save_requested = bool(flag[2])
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([int(self._local), int(request_save), int(request_local_save)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return result

    def rejoin(self) -> None:
        """The process group was rebuilt in-process (hpcdist.fault.inprocess): the agreement in flight belonged to
        the dead group and is dropped, its group with it; a stop this rank saw stays and is agreed anew."""
        self._group, self._pending = None, None
        self.save_requested = self.local_save_requested = False

    def close(self) -> None:
        """Finish the agreement in flight and restore the previous signal handlers (every rank, at the end)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self.uninstall()

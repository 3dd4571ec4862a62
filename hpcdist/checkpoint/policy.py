"""When to save, both tiers: the one cadence rule the training loop asks once per step (torchtitan's
``CheckpointManager._should_save``). The shared tier saves every N steps, every M minutes (rank 0's clock; the
request goes through the per-step stop agreement so every rank saves after the same step), at the run's end and at
a stop; the node-local tier at its own steps and minutes, never at a step either tier has saved. Every answer is
computed from agreed inputs: a save is collective.

``checkpoint.every_minutes: auto``: the shared tier's interval is the goodput model's optimum
(:mod:`hpcdist.checkpoint.cadence`) for the job's failure rate (:meth:`SavePolicy.expect_failures`) and the step
time and save stall rank 0 measures (:class:`AutoInterval`); until a save has been measured it is
:data:`~hpcdist.checkpoint.cadence.AUTO_DEFAULT_MINUTES`."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from hpcdist.base.logging_utils import get_logger
from hpcdist.checkpoint import cadence

log = get_logger(__name__)

AUTO = "auto"
_STEP_SAMPLES = 64  # plain steps the step time is the median of (evaluation and slow first steps fall out)
_SAVE_SAMPLES = 4  # shared saves the stall is the mean of (the newest ones: the file system's load changes)


class AutoInterval:
    """checkpoint.every_minutes=auto on rank 0: the step time and shared-save stall of this run, measured between
    consecutive steps' cadence checks (:meth:`SavePolicy.timed_save_due`, once per step), and the interval the goodput
    model recommends from them. A check-to-check interval holds one step, and the save after the previous step when
    there was one: plain intervals give the step time (their median), a shared save's interval less the step time
    gives the save's stall as training feels it (an async save's copy and fence included). Intervals holding a
    node-local save are left out of both."""

    def __init__(self) -> None:
        self.mtbf_s = math.inf  # the shared tier's share of the failures (expect_failures); inf: not known
        self.known = False
        self._last: tuple[int, float] | None = None
        self._steps: deque[float] = deque(maxlen=_STEP_SAMPLES)
        self._saves: deque[float] = deque(maxlen=_SAVE_SAMPLES)

    @property
    def step_s(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    @property
    def save_s(self) -> float | None:
        return statistics.fmean(self._saves) if self._saves else None

    def observe(self, step: int, now: float, *, shared_saved: int, local_saved: int) -> float | None:
        """The cadence check of ``step`` at ``now``; the steps the tiers saved last. The new interval in minutes
        once a shared save (after the previous step) has been measured, else None."""
        last, self._last = self._last, (step, now)
        if last is None or step != last[0] + 1:
            return None  # the first check of the loop, or a gap (a resumed loop): no interval to read
        seconds = now - last[1]
        if local_saved == last[0] and shared_saved != last[0]:
            return None
        if shared_saved != last[0]:
            self._steps.append(seconds)
            return None
        if not self._steps:
            return None
        self._saves.append(max(0.0, seconds - statistics.median(self._steps)))
        return self.minutes()

    def minutes(self) -> float:
        """The recommended checkpoint.every_minutes (save start to save start) from what is measured so far; the
        stated default before any save was measured or without a failure rate."""
        step, save = self.step_s, self.save_s
        if step is None or save is None or not self.known:
            return cadence.AUTO_DEFAULT_MINUTES
        tau = max(cadence.optimal_interval(save, self.mtbf_s), step)
        return cadence.every_minutes(tau, save)


class SavePolicy:
    """The cadence of both tiers and the steps they saved last."""

    def __init__(
        self,
        *,
        rank: int,
        every_steps: int = 0,
        every_minutes: float | str = 0.0,
        save_final: bool = True,
        total_steps: int | None = None,
        local_every_steps: int = 0,
        local_every_minutes: float = 0.0,
    ):
        self.rank = rank
        # every_minutes=auto: the goodput model's interval, from this run's measurements (rank 0's clock decides)
        self.auto = AutoInterval() if every_minutes == AUTO else None
        self.every_steps = every_steps
        self.every_minutes = cadence.AUTO_DEFAULT_MINUTES if self.auto else float(every_minutes)
        self.save_final, self.total_steps = save_final, total_steps
        # the node-local tier's cadence (checkpoint.local, hpcdist.checkpoint.local): decided here too, one owner
        self.local_every_steps, self.local_every_minutes = local_every_steps, local_every_minutes
        self.local_saved_step = -1
        self._local_clock = time.perf_counter()
        self.saved_step = -1  # the step of the last save (or failed save) or of the resumed checkpoint
        self._clock = time.perf_counter()  # every_minutes counts from the last save (or restart_clock())

    def expect_failures(self, *, node_mtbf_hours: float | None, nodes: int, local_coverage: float = 0.0) -> None:
        """checkpoint.every_minutes=auto: the job's failure rate (a node's MTBF, the job's nodes) and the share of
        failures the node-local tier recovers; the shared tier's interval is optimal for the rest. Without an MTBF
        the interval stays at the default (a warning says so)."""
        if self.auto is None:
            return
        if node_mtbf_hours is None:
            if self.rank == 0:
                log.warning(
                    "checkpoint.every_minutes=auto: the cluster profile gives no hardware.node_mtbf_hours; saving "
                    "every %g minutes",
                    cadence.AUTO_DEFAULT_MINUTES,
                )
            return
        share = 1.0 - min(max(local_coverage, 0.0), 1.0)
        system = cadence.system_mtbf_s(node_mtbf_hours, nodes)
        self.auto.mtbf_s = system / share if share > 0 else math.inf
        self.auto.known = True

    def saving(self, step: int) -> None:
        """A shared save of ``step`` starts: the clock restarts, and the step is not saved again (not even when
        this save fails)."""
        self._clock = time.perf_counter()
        self.saved_step = step

    # the one cadence rule (torchtitan's CheckpointManager._should_save): the loop asks once per step
    def should_save(self, step: int, *, last_step: bool, stop_requested: bool = False, timed: bool = False) -> bool:
        """Save after ``step``? ``last_step``: the loop ends after it (train.steps or train(until=...));
        ``stop_requested``: a stop every rank agreed on (a signal); ``timed``: the every-M-minutes request every rank
        agreed on (rank 0 asks, ``timed_save_due``). The loop's last step saves when it is a resume point (stopped
        or interrupted before train.steps) or checkpoint.save_final; a step is never saved twice. Every rank
        answers alike from agreed inputs: a save is collective."""
        if step == self.saved_step:
            return False
        if (last_step or stop_requested) and self.final_save_due(step):
            return True
        # a stop decides its step's save alone (at train.steps: checkpoint.save_final); every_steps always saves
        return (self.every_steps > 0 and step % self.every_steps == 0) or (timed and not stop_requested)

    def final_save_due(self, step: int) -> bool:
        """The loop's last step is saved: a stop or interruption before train.steps (the resume point), or
        checkpoint.save_final. A failure of this save is the run's failure (the trainer reports ``save_failed``)."""
        return self.save_final or (self.total_steps is not None and step < self.total_steps)

    def timed_save_due(self, step: int) -> bool:
        """Rank 0's clock: checkpoint.every_minutes has passed since the last save (or ``restart_clock``). True once
        per interval; the caller sends it through the per-step stop agreement, so every rank saves after the same
        step (``should_save(timed=...)`` one step later). A step that saves by every_steps restarts the clock."""
        if not (self.every_minutes and self.rank == 0):
            return False
        if self.auto is not None:
            self._auto_interval(step)
        if self.every_steps > 0 and step % self.every_steps == 0:
            self._clock = time.perf_counter()
            return False
        if time.perf_counter() - self._clock < self.every_minutes * 60:
            return False
        self._clock = time.perf_counter()  # asked: the save itself restarts it again one step later
        return True

    def _auto_interval(self, step: int) -> None:
        assert self.auto is not None
        minutes = self.auto.observe(
            step, time.perf_counter(), shared_saved=self.saved_step, local_saved=self.local_saved_step
        )
        if minutes is None:
            return
        if abs(minutes - self.every_minutes) > 0.05 * self.every_minutes:  # a new interval, not measurement noise
            log.info(
                "checkpoint.every_minutes=auto: every %.1f min (shared save stall %.1f s, step %.2f s, MTBF %s; "
                "Daly's optimum, hpcdist.checkpoint.cadence)",
                minutes,
                self.auto.save_s or 0.0,
                self.auto.step_s or 0.0,
                f"{self.auto.mtbf_s / 3600:,.1f} h" if math.isfinite(self.auto.mtbf_s) else "unknown",
            )
        self.every_minutes = minutes

    def restart_clock(self) -> None:
        """checkpoint.every_minutes counts from now (the start of the training loop)."""
        self._clock = self._local_clock = time.perf_counter()

    def local_save_due(self, step: int, *, timed: bool = False) -> bool:
        """Save the node-local tier after ``step``? Asked when ``should_save`` said no (a shared save of the step
        makes a local one pointless); ``timed``: checkpoint.local.every_minutes's request every rank agreed on
        (``timed_local_save_due``). Agreed inputs only: the save is collective."""
        if step in (self.saved_step, self.local_saved_step):
            return False
        return (self.local_every_steps > 0 and step % self.local_every_steps == 0) or timed

    def timed_local_save_due(self, step: int) -> bool:
        """Rank 0's clock for checkpoint.local.every_minutes, like ``timed_save_due``."""
        if not (self.local_every_minutes and self.rank == 0):
            return False
        if self.local_every_steps > 0 and step % self.local_every_steps == 0:
            self._local_clock = time.perf_counter()
            return False
        if time.perf_counter() - self._local_clock < self.local_every_minutes * 60:
            return False
        self._local_clock = time.perf_counter()
        return True

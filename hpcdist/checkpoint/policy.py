"""When to save, both tiers: the one cadence rule the training loop asks once per step (torchtitan's
``CheckpointManager._should_save``). The shared tier saves every N steps, every M minutes (rank 0's clock; the
request goes through the per-step stop agreement so every rank saves after the same step), at the run's end and at
a stop; the node-local tier at its own steps and minutes, never at a step either tier has saved. Every answer is
computed from agreed inputs: a save is collective."""

from __future__ import annotations

import time


class SavePolicy:
    """The cadence of both tiers and the steps they saved last."""

    def __init__(
        self,
        *,
        rank: int,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        save_final: bool = True,
        total_steps: int | None = None,
        local_every_steps: int = 0,
        local_every_minutes: float = 0.0,
    ):
        self.rank = rank
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.save_final, self.total_steps = save_final, total_steps
        # the node-local tier's cadence (checkpoint.local, hpcdist.checkpoint.local): decided here too, one owner
        self.local_every_steps, self.local_every_minutes = local_every_steps, local_every_minutes
        self.local_saved_step = -1
        self._local_clock = time.perf_counter()
        self.saved_step = -1  # the step of the last save (or failed save) or of the resumed checkpoint
        self._clock = time.perf_counter()  # every_minutes counts from the last save (or restart_clock())

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
        if self.every_steps > 0 and step % self.every_steps == 0:
            self._clock = time.perf_counter()
            return False
        if time.perf_counter() - self._clock < self.every_minutes * 60:
            return False
        self._clock = time.perf_counter()  # asked: the save itself restarts it again one step later
        return True

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

"""Goodput: where the wall time of a run went, across every attempt (restart) of it, in <run.dir>/goodput.json.

Rank 0 of each attempt appends one entry and keeps it current (at most once a second while training, and at every
checkpoint, stop and watchdog exit); the batch script stamps the end of a failed attempt (after-step). From the
entries:

    train            optimizer steps whose result was kept
    checkpoint_save  blocking time of checkpoint saves
    restore          loading the checkpoint at the start of an attempt
    startup          process start to the first step, minus restore (imports, rendezvous, model build, data)
    lost             steps computed again after a restart (the work since the checkpoint the next attempt resumed
                     from), plus the unaccounted end of an attempt that did not stop cleanly (the hang until the
                     watchdog fired, the teardown)
    queue_wait       between the end of one attempt and the start of the next (requeue hold, queue)
    other            the rest (evaluation, logging, clean shutdown)

Recovery: an attempt after a failure or a requeue carries ``recovery`` once its first step is done:
from the failure (its record in failures.jsonl; a time-limit stop's end; the stop signal of a requeue by someone
else, `scontrol requeue` or a preemption) to that first completed step, split into
detection (failure -> the failed step ended), wait (the in-job backoff; for a requeue the requeue hold and the
queue), gate (the health gate), step_start (srun -> rank 0 up), checkpoint_load, init (the rest of start-up:
imports, rendezvous, model, data) and first_step; ``path`` says in-job or requeue. The attempt loop
(hpcdist.launch.attempts) stamps its side in restarts.json; :func:`recovery` joins the two.

In-process recovery (hpcdist.fault.inprocess) trains each new generation in the same process: its entry is an
attempt of its own (``generation`` 1, 2, ... beside the job's ``restart``), starting when this rank saw the peer's
death, not when the process started. Its recovery is path ``in-process``: regroup (the new process group formed),
checkpoint_load, init (the Trainer built again) and first_step; the previous generation ends at that moment.

goodput = train / (last end - first start). The first attempt's wait in the queue before it started is not in the
total (the job does not know its submit time); everything after the first start is.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import DamagedRecord, one_line, read_json

__all__ = [
    "CATEGORIES",
    "RECOVERY_PARTS",
    "Goodput",
    "InProcessRecovery",
    "mark_attempt_end",
    "process_start_time",
    "read_goodput",
    "recovery",
    "summarize",
]

log = get_logger(__name__)

CATEGORIES = ("train", "checkpoint_save", "restore", "startup", "lost", "queue_wait", "other")
_FLUSH_EVERY_S = 1.0
RECOVERY_PARTS = ("detection", "regroup", "wait", "gate", "step_start", "checkpoint_load", "init", "first_step")


@dataclass(frozen=True)
class InProcessRecovery:
    """A generation after an in-process recovery: its number (1 for the first recovery), the wall time this rank
    saw the peer's death, and the seconds the new process group took to form."""

    generation: int
    failed_at: float
    regroup_s: float


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def recovery(entry: dict[str, Any], ledger: dict[str, Any]) -> dict[str, Any] | None:
    """The recovery of the attempt ``entry`` (goodput.json, with ``restart`` and ``first_step_at``) from the attempt
    before it, joined with the restart ledger (restarts.json); None for a first attempt or where the facts are
    missing. Seconds per part of :data:`RECOVERY_PARTS`, ``total`` and ``path`` (in-job / requeue)."""
    attempts = ledger.get("attempts") if isinstance(ledger, dict) else None
    restart = entry.get("restart")
    if not isinstance(attempts, dict) or not isinstance(restart, int) or restart < 1:
        return None
    this, prev = attempts.get(str(restart)), attempts.get(str(restart - 1))
    this, prev = this if isinstance(this, dict) else {}, prev if isinstance(prev, dict) else {}
    first = _num(entry.get("first_step_at"))
    # a failure's record, a time-limit stop's end, else the stop signal of a requeue by someone else (`scontrol
    # requeue`, a preemption: the attempt loop stamps it) or, without one, the step's end
    failed = next(
        (t for t in map(_num, (prev.get(k) for k in ("failed_at", "end", "stopped_at", "step_end"))) if t), None
    )
    if first is None or failed is None:
        return None
    step_end, decided = _num(prev.get("step_end")), _num(prev.get("decided"))
    gate_start, gate, launched = _num(this.get("gate_start")), _num(this.get("gate_s")), _num(this.get("launched"))
    start, loop_start = _num(entry.get("start")), _num(entry.get("loop_start"))
    restore = _num(entry.get("restore_s")) or 0.0
    parts: dict[str, float | None] = {
        "detection": step_end - failed if step_end is not None else None,
        "wait": gate_start - (decided or step_end or failed) if gate_start is not None else None,
        "gate": gate,
        "step_start": start - launched if start is not None and launched is not None else None,
        "checkpoint_load": restore,
        "init": loop_start - start - restore if loop_start is not None and start is not None else None,
        "first_step": first - loop_start if loop_start is not None else None,
    }
    out: dict[str, Any] = {k: round(max(0.0, v), 3) for k, v in parts.items() if v is not None}
    out["total"] = round(first - failed, 3)
    path = this.get("path")
    out["path"] = (
        path
        if path in ("first", "in-job", "requeue")
        else ("in-job" if prev.get("restarted") == "in-job" else "requeue")
    )
    return out


def process_start_time() -> float:
    """Wall-clock time this process started (from /proc; now where /proc is missing)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22: starttime, clock ticks after boot
        btime = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


_MAX_BYTES = 16 << 20  # one entry per attempt, a few hundred bytes each


def _load(path: Path) -> dict[str, Any]:
    """goodput.json as its entries' arithmetic needs it; empty when missing or damaged. An accounting file never
    stops training: it is read as a record anyone could have written (hpcdist.base.untrusted), an entry without a
    numeric start is dropped, and every field of the wrong type is (:func:`_goodput_entry`)."""
    try:
        data = read_json(path, _MAX_BYTES)
    except DamagedRecord as e:
        log.warning("%s: goodput starts a new account", one_line(e, 300))
        return {"attempts": []}
    entries = data.get("attempts") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return {"attempts": []}
    return {**data, "attempts": [e for e in map(_goodput_entry, entries) if e is not None]}


_INT_FIELDS = (
    "last_step",
    "first_step",
    "resumed_step",
    "restart",
    "generation",
    "lost_steps",
    "saves_shared",
    "saves_local",
)


def _goodput_entry(e: Any) -> dict[str, Any] | None:
    """An attempt's entry with numbers where numbers belong (times, ``*_s`` seconds, steps), ``clean`` a bool and
    ``recovery`` an object; None without a numeric ``start``."""
    if not isinstance(e, dict) or _num(e.get("start")) is None:
        return None
    out: dict[str, Any] = {}
    for key, value in e.items():
        if key in _INT_FIELDS:
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif key == "clean":
            ok = isinstance(value, bool)
        elif key == "recovery":
            ok = isinstance(value, dict)
        else:  # start, end, last, loop_start, first_step_at, <category>_s: seconds or wall times
            ok = _num(value) is not None
        if ok:
            out[key] = value
    return out


def read_goodput(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The attempts' entries of the run's goodput.json, each checked as :func:`_goodput_entry` does ([] when missing or
    damaged): what `hpcdist report` shows, as the trainer reads it."""
    return _load(RunDir(run_dir).goodput)["attempts"]


def _save(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=1))


def summarize(attempts: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per category over all attempts, ``total_s`` and ``goodput`` (train / total)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    prev_end = None
    for a in attempts:
        start = float(a["start"])
        end = float(a.get("end") or a.get("last") or start)
        if prev_end is not None:
            out["queue_wait"] += max(0.0, start - prev_end)
        known = 0.0
        for key in ("train", "checkpoint_save", "restore", "startup", "lost", "other"):
            value = float(a.get(f"{key}_s", 0.0))
            out[key] += value
            known += value
        rest = max(0.0, (end - start) - known)
        # an attempt that did not stop cleanly spent its unaccounted end hanging or being torn down
        out["other" if a.get("clean") else "lost"] += rest
        prev_end = end
    first = float(attempts[0]["start"]) if attempts else 0.0
    out["total_s"] = (prev_end - first) if attempts and prev_end is not None else 0.0
    out["goodput"] = out["train"] / out["total_s"] if out["total_s"] > 0 else 0.0
    out["attempts"] = float(len(attempts))
    return out


def mark_attempt_end(run_dir: str | os.PathLike[str], when: float | None = None) -> None:
    """The batch script, after a failed step: the last attempt ended now (if it did not say so itself)."""
    path = RunDir(run_dir).goodput
    data = _load(path)
    if data["attempts"] and not data["attempts"][-1].get("end"):
        data["attempts"][-1]["end"] = time.time() if when is None else when
        _save(path, data)


class Goodput:
    """One attempt's accounting; a no-op unless ``enabled`` (rank 0). Thread-safe (the watchdog flushes it)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        enabled: bool,
        start: float | None = None,
        restart: int | None = None,
        in_process: InProcessRecovery | None = None,
    ) -> None:
        """``in_process``: this attempt is a generation after an in-process recovery: it starts at the failure."""
        self.enabled = enabled
        self.path = RunDir(run_dir).goodput
        self._ledger_path = RunDir(run_dir).restarts
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {"attempts": []}
        self._entry: dict[str, Any] = {"start": process_start_time() if start is None else start, "last_step": None}
        if restart is not None:
            self._entry["restart"] = restart  # the job's attempt number: the restart ledger's key
        self._in_process = in_process
        if in_process is not None:
            self._entry.update(start=in_process.failed_at, generation=in_process.generation)
        self._pending = 0.0  # seconds of save/eval inside the current step, not train time
        self._flushed = 0.0

    def add(self, category: str, seconds: float, *, tier: str | None = None) -> None:
        """Time spent on ``category`` (restore, checkpoint_save, eval -> other). ``tier``: the time is one save of
        that checkpoint tier (shared, local): counted in ``saves_<tier>`` and ``save_<tier>_s``, so the goodput
        model can be fed the stall per save (an async save's later waits stay checkpoint_save time only)."""
        if not self.enabled:
            return
        key = "other" if category == "eval" else category
        with self._lock:
            self._entry[f"{key}_s"] = self._entry.get(f"{key}_s", 0.0) + seconds
            self._pending += seconds
            if tier is not None:
                self._entry[f"saves_{tier}"] = self._entry.get(f"saves_{tier}", 0) + 1
                self._entry[f"save_{tier}_s"] = self._entry.get(f"save_{tier}_s", 0.0) + seconds

    def begin(self, resumed_step: int | None) -> None:
        """The loop is about to start. A resume from ``resumed_step`` turns the previous attempt's steps after it
        into lost time (they are computed again)."""
        if not self.enabled or "loop_start" in self._entry:
            return  # one attempt per process: a second train() call continues it
        with self._lock:
            self._data = _load(self.path)
            now = time.time()
            e = self._entry
            e.update(loop_start=now, resumed_step=resumed_step, last=now)
            e["startup_s"] = max(0.0, now - e["start"] - e.get("restore_s", 0.0))
            self._pending = 0.0
            prev = self._data["attempts"][-1] if self._data["attempts"] else None
            if prev is not None and self._in_process is not None and not prev.get("end"):
                prev["end"] = e["start"]  # the generation before ended when this rank saw the peer's death
            if prev is not None and prev.get("last_step") is not None:
                # the previous attempt's steps after the checkpoint we resume from are computed again: lost
                steps = max(1, int(prev["last_step"]) - int(prev.get("first_step") or 0))
                redo = max(0, min(int(prev["last_step"]) - (resumed_step or 0), steps))
                train = float(prev.get("train_s", 0.0))
                moved = min(train, redo * train / steps)
                prev["train_s"] = train - moved
                prev["lost_s"] = float(prev.get("lost_s", 0.0)) + moved
                prev["lost_steps"] = redo
            e["first_step"] = resumed_step or 0
            self._data["attempts"].append(e)
            self._flush_locked(force=True)

    def step(self, step: int, seconds: float) -> None:
        """One optimizer step done, ``seconds`` of wall time for the whole iteration (save/eval inside it excluded)."""
        if not self.enabled:
            return
        with self._lock:
            train = max(0.0, seconds - self._pending)
            self._pending = 0.0
            self._entry["train_s"] = self._entry.get("train_s", 0.0) + train
            self._entry["last_step"] = step
            if "first_step_at" not in self._entry:
                self._entry["first_step_at"] = time.time()
                self._recovery_locked()
                self._flush_locked(force=True)
            self._flush_locked()

    def flush(self, *, clean: bool = False, saved: int | None = None) -> None:
        """Write now; ``clean`` marks the attempt as ended by the trainer itself (finished or stopped by a signal).
        ``saved``: the step a checkpoint was just taken of. It counts as reached although its iteration has not
        ended yet (``step`` comes after the save), so the record never says an attempt got less far than its own
        checkpoint when the rank dies before the next flush."""
        if not self.enabled:
            return
        with self._lock:
            if saved is not None and saved > (self._entry.get("last_step") or 0):
                self._entry["last_step"] = saved
            if clean:
                self._entry["end"] = time.time()
                self._entry["clean"] = True
            self._flush_locked(force=True)

    def _recovery_locked(self) -> None:
        if self._in_process is not None:
            self._entry["recovery"] = self._in_process_recovery()
            return
        try:
            ledger = read_json(self._ledger_path, _MAX_BYTES)
        except DamagedRecord:
            return  # its ledger is unreadable: no recovery to measure
        rec = recovery(self._entry, ledger) if isinstance(ledger, dict) else None
        if rec is not None:
            self._entry["recovery"] = rec

    def _in_process_recovery(self) -> dict[str, Any]:
        """From the peer's death (as this rank saw it) to this generation's first completed step."""
        assert self._in_process is not None
        e = self._entry
        start, loop_start, first = float(e["start"]), float(e["loop_start"]), float(e["first_step_at"])
        restore, regroup = float(e.get("restore_s", 0.0)), self._in_process.regroup_s
        parts = {
            "regroup": regroup,
            "checkpoint_load": restore,
            "init": loop_start - start - regroup - restore,
            "first_step": first - loop_start,
        }
        out: dict[str, Any] = {k: round(max(0.0, v), 3) for k, v in parts.items()}
        out.update(total=round(first - start, 3), path="in-process")
        return out

    def recoveries(self) -> list[dict[str, Any]]:
        """The recovery of every attempt that came after a failure or a requeue (goodput.json's ``recovery``)."""
        with self._lock:
            return [
                {"restart": a.get("restart"), "generation": a.get("generation"), **a["recovery"]}
                for a in self._data["attempts"]
                if isinstance(a.get("recovery"), dict)
            ]

    def attempt_seconds(self) -> float:
        """Wall time of this attempt so far (process start to now)."""
        return max(0.0, time.time() - float(self._entry["start"]))

    def summary(self) -> dict[str, float]:
        with self._lock:
            return summarize(self._data["attempts"])

    def _flush_locked(self, *, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._flushed < _FLUSH_EVERY_S:
            return
        self._entry["last"] = now
        try:
            _save(self.path, self._data)
            self._flushed = now
        except OSError:
            pass  # accounting must never stop training; the next flush tries again

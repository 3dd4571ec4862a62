"""Hang watchdog: a per-rank thread that ends a rank whose training loop stopped making progress.

A collective that never completes (a peer frozen or dead, a broken link, a deadlock) blocks its caller inside C++
where nothing in Python notices, and NCCL's own timeout, when it fires at all, kills the process without saying
where it was or who was missing. So:

- the loop calls ``beat(step, phase)`` at each stage (a few attribute stores);
- the allowance (:func:`step_allowance`): ``timeout_s`` for the steps, raised to STEP_FACTOR x the measured step
  time, so a model whose steps are long, or a machine that is busy, is never killed for being slow. The measured
  time is the first step's until a later one is measured (the first step is a step too: on a loaded 2-core machine
  the demo's first step took 181 s and the second more than 90, which the old rule, ignoring the first step,
  killed), then the slowest later step (a one-off compile in the first step must not stretch hang detection for
  the whole run). ``slow_phase_s`` is for the phases that are legitimately long once in a while, the first time
  each runs in this process: the first step of an attempt (NCCL communicators, torch.compile, allocator warm-up),
  checkpoint saves and their completion, evaluation (``beat(..., slow=True)``); after that a long phase gets
  STEP_FACTOR x its longest duration so far (at least the step allowance), so a hang in the tenth save is caught as
  fast as one in a step;
- a daemon thread checks once a second; after the allowance without a beat it writes a report to stderr (the job
  log): rank, host, step and phase (the last collective the loop entered), the peers that look responsible (from
  the heartbeat files, below) and every thread's Python stack (faulthandler); the lowest responsive rank records
  the failure in <run.dir>/failures.jsonl; then the process exits with 124 (as timeout(1) does). srun
  --kill-on-bad-exit ends the step, and the failure policy (hpcdist.launch.restarts) requeues or stops the job;
- the same thread writes <run.dir>/heartbeats/rank-NNNNN.json every ``heartbeat_s`` (pid, host, step, phase, time).
  A frozen rank (SIGSTOP, a hang holding the GIL) or a dead one stops writing and a stuck one falls behind: that
  is how a waiting rank names the culprit, which cannot run its own watchdog;
- if this thread itself cannot run (a C extension hangs holding the GIL), faulthandler's C-level timer, re-armed
  by the thread while it runs, dumps the stacks and exits at the allowance + BACKSTOP_GRACE_S;
- under in-process recovery (``supervised``) the rank's supervisor watches this heartbeat too
  (hpcdist.fault.supervise): a rank that wrote none for FROZEN_BEATS heartbeats is frozen, and the supervisor
  kills it, well before its waiting peers' watchdogs fire, so that they see a dead peer and recover in-process
  instead of ending the attempt.

The process-group timeout is ``collective_timeout_s`` (the longest allowance + 60 s): NCCL's watchdog (told by
TORCH_NCCL_ASYNC_ERROR_HANDLING to tear the process down) and gloo's timeout are only the backstop.

Why the default timeout is 90 s (``fault.watchdog_timeout_s``): the recovery target is 5 minutes from the hang to
training again, and recovery = detection + SLURM's requeue hold (cred_expire + 1 s: 121 s by default) + start-up
and resume (about a minute for the 13B flagship: imports, NCCL init, reading the sharded checkpoint). 600 s (the
old default) spent twice the whole budget on detection alone; 90 s leaves ~40 s of margin, while a 13B step on
32 A100s (~15 s, planner) is 6x shorter and longer steps raise the allowance by themselves (STEP_FACTOR).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, TextIO

from hpcdist.base.atomic import atomic_write
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.fault import failures, supervise
from hpcdist.schedulers import job_facts

__all__ = [
    "WATCHDOG_EXIT_CODE",
    "HangWatchdog",
    "collective_timeout_s",
    "configure_collectives",
    "read_heartbeats",
    "step_allowance",
    "suspects_text",
]

log = get_logger(__name__)

WATCHDOG_EXIT_CODE = 124
# heartbeats a supervised rank may miss before its supervisor takes it for frozen: 3 x heartbeat_s is at most 0.6 x
# the watchdog's timeout, so the kill comes before any waiting peer's watchdog fires
FROZEN_BEATS = 3
COLLECTIVE_MARGIN_S = 60.0
BACKSTOP_GRACE_S = 30.0
STEP_FACTOR = 4.0  # a step may take this many times the slowest step seen so far before it counts as a hang
DEFAULT_PG_TIMEOUT_S = 1800.0


def step_allowance(timeout_s: float, first_step_s: float | None, slowest_step_s: float | None) -> tuple[float, str]:
    """(seconds a step may take before it counts as a hang, why): ``timeout_s`` (fault.watchdog_timeout_s) or
    STEP_FACTOR x the measured step time if that is longer. The measured time is the slowest step after the first
    (``slowest_step_s``) once there is one, else the first step's (``first_step_s``, warm-up included), else none."""
    if slowest_step_s:
        measured, which = slowest_step_s, "the slowest step so far"
    else:
        measured, which = first_step_s, "the first step"
    if measured and STEP_FACTOR * measured > timeout_s:
        return STEP_FACTOR * measured, f"{STEP_FACTOR:g}x {which} ({measured:.3g} s)"
    return timeout_s, f"fault.watchdog_timeout_s={timeout_s:g}"


def suspects_text(blamed: list[dict[str, Any]], world_size: int) -> str:
    """The report's "suspects" part: the blamed ranks, or why nobody is. One rank has no peer and no collective to
    wait for: blaming the network there sent users after a network that was never involved."""
    if blamed:
        return "; ".join(f"rank {b['rank']} on {b['host']}: {b['why']}" for b in blamed)
    if world_size <= 1:
        load = ""
        with contextlib.suppress(OSError, AttributeError):
            load = f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count() or '?'} CPUs)"
        return (
            f"none: this is the only rank, with no peer to wait for; its own work is slow or stuck (the stacks "
            f"below say where: data, compute, I/O){load}; if the machine is merely busy, raise "
            "fault.watchdog_timeout_s"
        )
    return "every rank is alive and at the same step: the collective itself is stuck (network, a GPU, NCCL)"


def collective_timeout_s(watchdog_timeout_s: float, slow_phase_s: float = 0.0) -> float:
    """Process-group timeout: a minute after the watchdog's longest allowance, so the watchdog (with stacks and
    attribution) fires first, and a collective inside a long phase (a checkpoint save) is not cut short."""
    longest = max(watchdog_timeout_s, slow_phase_s)
    return longest + COLLECTIVE_MARGIN_S if watchdog_timeout_s > 0 else DEFAULT_PG_TIMEOUT_S


def configure_collectives(environ: MutableMapping[str, str], run_dir: str | os.PathLike[str]) -> list[str]:
    """Before the process group exists: make a failed or timed-out NCCL collective end the process (not hang), and
    keep NCCL's flight recorder so its timeout dumps the last collectives of every rank into <run.dir>/hangs/.
    Values the user exported win; returns warnings."""
    warnings = []
    handling = environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # 3: tear down without cleanup
    if handling.strip() not in ("1", "3"):
        warnings.append(
            f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: a timed-out NCCL collective will not end the process; "
            "unset it (hpcdist uses 3) so a hang ends the step"
        )
    environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # torch >= 2.8 names (TORCH_NCCL_TRACE_* are deprecated)
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(run_dir).absolute() / "hangs" / "nccl_trace_rank_"))
    return warnings


def _heartbeat_dir(run_dir: str | os.PathLike[str]) -> Path:
    return RunDir(run_dir).heartbeats


def read_heartbeats(run_dir: str | os.PathLike[str], world_size: int) -> dict[int, dict[str, Any]]:
    """rank -> its last heartbeat (pid, host, step, phase, time, job_id, restart); ranks without one are absent."""
    out = {}
    for rank in range(world_size):
        try:
            out[rank] = json.loads((_heartbeat_dir(run_dir) / f"rank-{rank:05d}.json").read_text())
        except (OSError, ValueError):
            continue
    return out


def _fd_stream() -> TextIO:
    """Where faulthandler's C timer writes: it needs a real file descriptor. sys.stderr may be a replacement
    without one (pytest's capture, a tool's redirection); the process's original stderr always has one."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__ or sys.stderr


class HangWatchdog:
    """See the module docstring. ``start()`` when the loop starts, ``beat()`` as it goes, ``stop()`` at the end."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        host: str,
        run_dir: str | os.PathLike[str],
        timeout_s: float,
        slow_phase_s: float = 0.0,
        heartbeat_s: float | None = None,
        on_fire: Callable[[], None] | None = None,
        supervised: bool = False,
    ) -> None:
        self.rank, self.world_size, self.host = rank, world_size, host
        self.run_dir = Path(run_dir)
        self.timeout_s = float(timeout_s)
        self.slow_phase_s = max(float(slow_phase_s), self.timeout_s)
        self._slowest_step: float | None = None  # the slowest step after the attempt's first one
        self._first_step_s: float | None = None  # the attempt's first step (warm-up included)
        self._first_step: int | None = None  # the step train() started from: its first step is a slow phase
        self._allow = self.timeout_s
        self._why = f"fault.watchdog_timeout_s={self.timeout_s:g}"  # what set the allowance, for the report
        self._slow_phase: str | None = None  # the long phase the last beat began, if it was one
        self._seen: dict[str, float] = {}  # longest duration of each long phase so far, by phase name
        # often enough that a frozen rank's file is clearly stale when a waiting rank's watchdog fires
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else min(30.0, max(0.5, self.timeout_s / 5))
        self.on_fire = on_fire
        self.step, self.current_phase = 0, "start"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._path = _heartbeat_dir(self.run_dir) / f"rank-{rank:05d}.json"
        self._watch = supervise.watch_file() if supervised else None  # None: no supervisor, or not asked

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def beat(self, step: int, phase: str, *, slow: bool = False) -> None:
        """Progress: the loop is at ``step`` entering ``phase`` (name it after the collective it runs); ``slow``: a
        phase that may take up to ``slow_phase_s`` the first time (checkpoint, evaluation), then up to STEP_FACTOR x
        its longest duration so far."""
        now = time.monotonic()
        if self._slow_phase is not None:  # the previous beat began a long phase: it lasted until now
            self._seen[self._slow_phase] = max(self._seen.get(self._slow_phase, 0.0), now - self._last)
        self._slow_phase = phase if slow else None
        step_allow, step_why = step_allowance(self.timeout_s, self._first_step_s, self._slowest_step)
        if slow and phase in self._seen:  # a save again: as long as the longest one so far allows, not 15 minutes
            longest = STEP_FACTOR * self._seen[phase]
            self._allow = max(step_allow, longest)
            self._why = step_why if step_allow >= longest else f"{STEP_FACTOR:g}x its longest run so far"
        elif slow or step == self._first_step:  # its first time in this process: nothing to go by
            self._allow = self.slow_phase_s
            self._why = f"fault.watchdog_slow_phase_s={self.slow_phase_s:g}"
        else:
            self._allow, self._why = step_allow, step_why
        self.step, self.current_phase, self._last = step, phase, now

    @contextlib.contextmanager
    def phase(self, step: int, name: str, *, slow: bool = False) -> Iterator[None]:
        """``with watchdog.phase(step, "optimizer step (grad-norm all-reduce)"):`` -- ``beat`` on entry; a slow
        phase's duration is taken on exit (not at the next beat), so later runs of it get 4x exactly that."""
        self.beat(step, name, slow=slow)
        yield
        if slow and self._slow_phase == name:
            self._seen[name] = max(self._seen.get(name, 0.0), time.monotonic() - self._last)
            self._slow_phase = None

    def step_time(self, seconds: float) -> None:
        """A completed step's time: the step allowance follows it (:func:`step_allowance`). The attempt's first step,
        with its one-off warm-up, sets it until a later step is measured."""
        if self.step == self._first_step:
            self._first_step_s = max(self._first_step_s or 0.0, seconds)
        else:
            self._slowest_step = max(self._slowest_step or 0.0, seconds)

    def start(self, step: int | None = None) -> HangWatchdog:
        """Start watching; ``step``: where train() starts (its first step gets the slow-phase allowance)."""
        if step is not None:
            self.step = step
        if not self.enabled or self._thread is not None:
            return self
        self._stop.clear()  # train() may run again after a stop()
        self._first_step, self._allow = self.step, self.slow_phase_s
        self._why = f"fault.watchdog_slow_phase_s={self.slow_phase_s:g}"
        self._last = time.monotonic()
        self._write_heartbeat()  # at once: tests and tools find this rank's pid here
        self._thread = threading.Thread(target=self._run, name="hpcdist-watchdog", daemon=True)
        self._thread.start()
        if self._watch is not None:  # only while this thread beats: between trainers nothing is to be watched
            supervise.watch(self._watch, self._path.absolute(), FROZEN_BEATS * self.heartbeat_s)
        return self

    def stop(self) -> None:
        if self._watch is not None:
            supervise.unwatch(self._watch)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(RuntimeError):
            faulthandler.cancel_dump_traceback_later()

    # ------------------------------------------------------------------------------------------ thread
    def _write_heartbeat(self) -> None:
        job = job_facts()
        beat = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.current_phase,
            "time": time.time(),
            "idle_s": round(time.monotonic() - self._last, 3),
            "job_id": job.job_id,
            "restart": job.restart_count,
        }
        try:
            atomic_write(self._path, json.dumps(beat), durable=False)  # rewritten every few seconds
        except OSError as e:
            log.debug("heartbeat %s: %s", self._path, e)

    def _run(self) -> None:
        next_beat = 0.0
        seen = -1.0
        poll = min(1.0, self.heartbeat_s)
        last_poll = time.monotonic()
        while not self._stop.wait(poll):
            now = time.monotonic()
            if now - last_poll > max(3 * self.heartbeat_s, 5 * poll) and now - self._last > self._allow:
                # this thread did not run either: the whole process was frozen (SIGSTOP, then SIGCONT when SLURM
                # ends the step), not waiting for a peer; the other ranks have reported it
                frozen = now - last_poll
                print(
                    f"[hpcdist watchdog] rank {self.rank} on {self.host}: this process was frozen for {frozen:.0f} s "
                    "(SIGSTOP or starved); exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(WATCHDOG_EXIT_CODE)
            last_poll = now
            if now >= next_beat:
                self._write_heartbeat()
                next_beat = now + self.heartbeat_s
            if self._last != seen:
                # progress since the last look: push the C-level backstop out again
                seen = self._last
                faulthandler.dump_traceback_later(self._allow + BACKSTOP_GRACE_S, exit=True, file=_fd_stream())
            idle = now - self._last
            if idle > self._allow:
                self._fire(idle)
                return

    def culprits(self, now: float | None = None) -> tuple[list[dict[str, Any]], int]:
        """(ranks that look responsible, the lowest rank that still responds). Stale or missing heartbeat: frozen or
        dead; else behind the furthest step: stuck earlier; else nobody (the collective itself is stuck)."""
        now = time.time() if now is None else now
        beats = read_heartbeats(self.run_dir, self.world_size)
        stale_after = 3 * self.heartbeat_s
        blamed: list[dict[str, Any]] = []
        fresh = {r: b for r, b in beats.items() if now - float(b.get("time", 0)) <= stale_after}
        fresh.setdefault(self.rank, {"step": self.step, "phase": self.current_phase, "host": self.host})
        for rank in range(self.world_size):
            if rank in fresh:
                continue
            b = beats.get(rank)
            why = f"no heartbeat for {now - float(b['time']):.0f} s (frozen or dead)" if b else "no heartbeat at all"
            blamed.append({"rank": rank, "host": (b or {}).get("host"), "why": why, "step": (b or {}).get("step")})
        if not blamed:
            top = max(int(b.get("step", 0)) for b in fresh.values())
            for rank, b in sorted(fresh.items()):
                if int(b.get("step", 0)) < top:
                    why = f"behind: at step {b.get('step')} in {b.get('phase')} while others reached step {top}"
                    blamed.append({"rank": rank, "host": b.get("host"), "why": why, "step": b.get("step")})
        return blamed, min(fresh)

    def _fire(self, idle: float) -> None:
        err = sys.stderr
        try:
            blamed, reporter = self.culprits()
            who = suspects_text(blamed, self.world_size)
            cause = (
                f"hang watchdog: no progress for {idle:.0f} s (allowed {self._allow:.0f} s, {self._why}) at "
                f"step {self.step} in {self.current_phase}"
            )
            where = "last collective" if self.world_size > 1 else "last phase"
            print(
                f"\n[hpcdist watchdog] rank {self.rank} on {self.host} (pid {os.getpid()}): {cause}; {where}: "
                f"{self.current_phase}; suspects: {who}",
                file=err,
                flush=True,
            )
            print(f"[hpcdist watchdog] Python stacks of rank {self.rank} (all threads):", file=err, flush=True)
            faulthandler.dump_traceback(file=err, all_threads=True)
            self._dump_nccl_trace()
            if reporter == self.rank:
                blame = [{"rank": b["rank"], "host": b["host"]} for b in blamed if b.get("host")]
                failures.record(
                    self.run_dir,
                    kind="watchdog",
                    cause=f"no progress in {self.current_phase}",
                    rank=self.rank,
                    host=self.host,
                    blame=blame,
                    step=self.step,
                    detail=f"{cause}; suspects: {who}",
                    suspects=blamed,
                    idle_s=round(idle, 1),
                )
            if self.on_fire is not None:
                self.on_fire()
        except Exception as e:
            print(f"[hpcdist watchdog] report failed: {e!r}", file=err, flush=True)
        finally:
            err.flush()
            os._exit(WATCHDOG_EXIT_CODE)  # the main thread is stuck in a collective: no clean shutdown is possible

    def _dump_nccl_trace(self) -> None:
        """NCCL's flight recorder (last collectives, their sequence numbers and states) into <run.dir>/hangs/."""
        import torch.distributed as dist

        dump = getattr(getattr(__import__("torch")._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
        if dump is None or not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        try:
            path = self.run_dir / "hangs" / f"nccl_trace_rank_{self.rank}.pkl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(dump())
            print(f"[hpcdist watchdog] NCCL flight recorder: {path}", file=sys.stderr, flush=True)
        except Exception as e:
            print(f"[hpcdist watchdog] NCCL flight recorder dump failed: {e!r}", file=sys.stderr, flush=True)

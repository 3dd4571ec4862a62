"""Run one rank under a supervisor that outlives it: ``python -m hpcdist.fault.supervise -- CMD [ARGS...]``.

A rank killed by a signal (the OOM killer's SIGKILL, a segfault, an abort inside a CUDA library) cannot say so
itself, and as soon as srun sees the dead task it ends the others too (--kill-on-bad-exit): afterwards nobody knows
which rank died first. srun starts this supervisor as the task; it runs the rank as its child and forwards signals
to it. When the child dies from a signal other than a request to stop (TERM, INT, HUP), the supervisor appends a
``killed`` record (rank, host, signal) to the run's failures.jsonl *before* exiting, so before srun can know, and
then dies from the same signal, so srun and SLURM see what they would have seen without it. Any other exit status
is passed through unchanged (a rank that raised records its own exception; hpcdist.fault.failures).

Where to write and which rank this is, the child says itself: it writes them to the file named by
HPCDIST_TASK_INFO once its config is loaded (hpcdist.fault.failures.announce_task). This module therefore needs no
SLURM variable and imports only the standard library: it starts in milliseconds, once per rank.

Under in-process recovery the child also asks its supervisor, while its watchdog runs, to watch its heartbeat file
(``watch.json`` beside the task info: the file's path and how stale it may get; hpcdist.fault.hang). A process that
wrote no heartbeat for that long is frozen (SIGSTOP, a hang holding the GIL): its own watchdog cannot run, and its
peers would wait in their collective until their watchdogs end the attempt. The supervisor SIGKILLs it instead and
records a ``watchdog`` failure blaming it: the peers see a dead rank and recover in their own processes. Only the
heartbeat's age is looked at (lstat; the run dir's file is never read or followed).

That file lives in a directory of its own that only this user can enter (mkdtemp: a new name, created 0700),
removed with everything in it when the rank ends. A bare name in a shared /tmp (created, deleted, handed on) let
another local user create it first and choose where the record is appended (docs/SECURITY.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from hpcdist.base.atomic import append_line, atomic_write  # standard library only, like this module

TASK_INFO_ENV = "HPCDIST_TASK_INFO"  # imported by hpcdist.fault.failures (one name for both sides)
WATCH_NAME = "watch.json"  # beside the task info: the heartbeat the child asks to be watched, while it beats
_POLL_S = 0.5  # the supervisor's look at a watched heartbeat
_WATCH_MAX = 4096  # bytes of the watch file read: it is the child's, in our private directory
# Signals SLURM (or a user) sends to a step: the rank must see them even when only its supervisor is signalled.
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Deaths by these were asked for (scancel, SLURM ending the step after another rank failed or after a requeue):
# not a failure of this rank, nothing to record.
STOP_REQUESTS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: if the supervisor is killed, the kernel kills the rank too (no orphan that keeps
    a GPU or waits forever in a collective)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _append_record(info_path: Path, pid: int, kind: str, cause: str, signature: str) -> str | None:
    """Append a record of this rank's end to the failures file its task info names; the line (None: no info)."""
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return None  # the child died before loading its config: the batch script's after-step records the exit
    if not isinstance(info, dict) or not isinstance(info.get("failures"), str):
        return None  # not what announce_task writes: say the bare fact rather than crash and lose it
    rec = {
        "time": time.time(),
        "job_id": info.get("job_id"),
        "restart": info.get("restart"),
        "rank": info.get("rank"),
        "host": info.get("host"),
        "pid": pid,
        "kind": kind,
        "cause": cause.format(rank=info.get("rank")),
        "blame": [{"rank": info.get("rank"), "host": info.get("host")}],
        "step": None,
        "signature": signature,
    }
    line = json.dumps(rec) + "\n"
    # never through a link: the record goes to the run's own failures.jsonl or nowhere
    append_line(Path(info["failures"]), line)
    return line


def record_death(info_path: Path, pid: int, signum: int) -> str | None:
    """Append the ``killed`` record the child's task info asks for; returns the line written (None if no info)."""
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
    cause = f"rank {{rank}} (pid {pid}) was killed by {name}"
    return _append_record(info_path, pid, "killed", cause, f"killed: {name}")


def record_frozen(info_path: Path, pid: int, age: float) -> str | None:
    """The ``watchdog`` record of a rank this supervisor killed for writing no heartbeat (the line, or None)."""
    cause = (
        f"rank {{rank}} (pid {pid}) wrote no heartbeat for {age:.0f} s (stopped or hung): killed by its supervisor "
        "so that its peers recover in-process"
    )
    return _append_record(info_path, pid, "watchdog", cause, "watchdog: frozen")


def watch_file() -> Path | None:
    """In the child: where to ask its supervisor to watch a heartbeat (None without a supervisor)."""
    info = os.environ.get(TASK_INFO_ENV)
    return Path(info).with_name(WATCH_NAME) if info else None


def watch(path: Path, heartbeat: Path, stale_s: float) -> None:
    """In the child: ask the supervisor to kill this process once ``heartbeat`` is older than ``stale_s``."""
    with contextlib.suppress(OSError):  # no watch is the behaviour without a supervisor: never fatal
        atomic_write(path, json.dumps({"heartbeat": str(heartbeat), "stale_s": float(stale_s)}))


def unwatch(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def frozen_for(watch_path: Path, now: float) -> tuple[float, float] | None:
    """(seconds since the watched heartbeat was written, the limit) when that exceeds the limit; None when nothing
    is watched, the heartbeat is fresh, or the files are not what the child writes."""
    try:
        with open(watch_path, "rb") as fh:
            spec = json.loads(fh.read(_WATCH_MAX))
        heartbeat, stale_s = spec["heartbeat"], float(spec["stale_s"])
        if not isinstance(heartbeat, str):
            return None
        st = os.lstat(heartbeat)  # the run dir's file: its age only, never followed through a link, never read
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not stat.S_ISREG(st.st_mode) or not stale_s > 0:
        return None
    age = now - st.st_mtime
    return (age, stale_s) if age > stale_s else None


def supervise(cmd: Sequence[str]) -> int:
    """Run ``cmd`` as a child; returns its exit status, or ends this process with the signal that ended the child."""
    # a directory only we can write (0700, a name nobody had): the child creates the file in it (atomically) once
    # it knows its run dir, and nobody else can create, replace or read it
    private = Path(tempfile.mkdtemp(prefix="hpcdist-task-"))
    info_path = private / "task.json"
    info_name = str(info_path)
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    # before the child exists: a TERM arriving in between must not end the supervisor with its default action
    for sig in FORWARDED:
        signal.signal(sig, forward)
    child = subprocess.Popen(list(cmd), env={**os.environ, TASK_INFO_ENV: info_name}, preexec_fn=_die_with_parent)
    children.append(child)
    rc, frozen = _wait_or_kill_frozen(child, private / WATCH_NAME)
    try:
        if frozen is not None:
            age = frozen
            _report_end(lambda: record_frozen(info_path, child.pid, age), f"pid {child.pid} frozen, killed")
        elif rc < 0 and -rc not in STOP_REQUESTS:
            _report_end(lambda: record_death(info_path, child.pid, -rc), f"pid {child.pid} killed by signal {-rc}")
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if rc < 0:
        # die the same way, so srun reports "Killed" / "Segmentation fault" for this task as it would have
        with contextlib.suppress(OSError, ValueError):  # SIGKILL / SIGSTOP take no handler: already default
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        return 128 - rc  # a signal whose default action is not to terminate
    return rc


def _report_end(record: Callable[[], str | None], fact: str) -> None:
    """Record the child's end, and say it on stderr (the bare ``fact`` when nothing could be recorded)."""
    try:
        line = record()
    except OSError as e:  # a link or another user's file at failures.jsonl: say so, still die like the rank
        print(f"hpcdist.fault.supervise: not recorded: {e.strerror}", file=sys.stderr, flush=True)
        line = None
    print(f"hpcdist.fault.supervise: {line.strip() if line else fact}", file=sys.stderr, flush=True)


def _wait_or_kill_frozen(child: subprocess.Popen[bytes], watch_path: Path) -> tuple[int, float | None]:
    """The child's exit status, and how long its watched heartbeat was stale if this supervisor killed it for that
    (SIGKILL works on a stopped process too; its peers then see a dead rank, not a silent one)."""
    while True:
        try:
            return child.wait(timeout=_POLL_S), None
        except subprocess.TimeoutExpired:
            stale = frozen_for(watch_path, time.time())
            if stale is not None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                return child.wait(), stale[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m hpcdist.fault.supervise -- CMD [ARGS...]", file=sys.stderr)
        return 2
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())

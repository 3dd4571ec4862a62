"""Failure records: which rank failed, on which host, why. One file, <run.dir>/failures.jsonl (on a cluster a shared
file system, like the checkpoints), one JSON object per event, appended by whoever saw it. ``kind``:
    exception   a rank raised (hpcdist.run's exception path); attributed to that rank and its host. A collective
                that failed because a peer died or timed out is kind ``collective`` instead, attributed to nobody:
                the peer's own record (or its supervisor's) names the culprit.
    watchdog    a rank's loop made no progress for fault.watchdog_timeout_s (hpcdist.fault.hang); attributed
                to the ranks whose heartbeat stopped, or that were behind the others.
    killed      a rank's process died from a signal (the OOM killer's SIGKILL, SIGSEGV, SIGABRT): recorded by its
                supervisor (``python -m hpcdist.fault.supervise``), which outlives it.
    checkpoint  the final checkpoint, or the stop checkpoint before a requeue, failed (disk full) on every rank
                alike (hpcdist.run), or a checkpoint could not be read through the retries (CheckpointUnavailable):
                exit 74; attributed to nobody (storage).
    hardware    a NaN/Inf step that a re-run on the same inputs did not reproduce (hpcdist.fault.triage): attributed
                to the rank whose own loss or gradients were non-finite, so the restart policy excludes its host.
    nonfinite   the run stopped on a NaN/Inf (hpcdist.fault.nonfinite): attributed to nobody (data or numerics; the
                triage's ``hardware`` record is what blames a host).
    exit        the step failed and no rank said why (recorded by after-step, hpcdist.launch.restarts).
    health      a node failed the health gate before an attempt (hpcdist.fault.health.record_unhealthy): no rank
                ran there; attributed to the host (rank None), which the restart policy then excludes.
    straggler   a warning, not a failure (hpcdist.fault.stragglers).
  Fields: time, job_id, restart (SLURM_RESTART_COUNT), rank, host, pid, kind, cause (one line), blame (the
  [{"rank", "host"}] it is attributed to), step, signature (the cause without numbers: "the same failure" means the
  same signature), detail (traceback tail).

What to do about a failure (requeue, exclude a node, stop) is the restart policy's: hpcdist.launch.restarts.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcdist.atomic import append_line, atomic_write, read_tail
from hpcdist.fault.supervise import TASK_INFO_ENV  # the supervisor names a file there; the rank says who it is in it
from hpcdist.logging_utils import get_logger
from hpcdist.rundir import RunDir
from hpcdist.schedulers import JobFacts, job_facts

__all__ = [
    "TASK_INFO_ENV",
    "announce_task",
    "classify_exception",
    "primary_failure",
    "read_failures",
    "record",
    "record_exception",
    "signature",
    "unhealthy_hosts",
]

log = get_logger(__name__)

_DETAIL_CHARS = 4000

# A collective that failed because of another rank: gloo's "Connection closed by peer" / "Timed out waiting",
# NCCL's remote errors and aborted communicators, c10d store timeouts.
_PEER_ERRORS = re.compile(
    r"connection (closed|reset) by peer|broken pipe|remote worker crash|timed out waiting|"
    r"collective operation timeout|communicator was aborted|ncclRemoteError|remote process exited|"
    r"socket timeout|connection refused",
    re.IGNORECASE,
)


# ------------------------------------------------------------------------------------------------ records


def _failures_path(run_dir: str | os.PathLike[str]) -> Path:
    return RunDir(run_dir).failures


def signature(kind: str, cause: str) -> str:
    """What "the same failure" compares: kind + cause with numbers, addresses and paths blanked out."""
    text = re.sub(r"0x[0-9a-fA-F]+", "<hex>", cause.splitlines()[0] if cause else "")
    text = re.sub(r"(/[\w.\-]+)+", "<path>", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return f"{kind}: {text.strip()}"[:300]


def record(
    run_dir: str | os.PathLike[str],
    *,
    kind: str,
    cause: str,
    rank: int | None = None,
    host: str | None = None,
    blame: Iterable[Mapping[str, Any]] = (),
    step: int | None = None,
    detail: str = "",
    job: JobFacts | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Append one event to <run_dir>/failures.jsonl and return it.

    One ``os.write`` of one line on an O_APPEND descriptor (hpcdist.atomic.append_line): ranks appending at the
    same moment do not interleave their lines on a local or Lustre/GPFS file system.
    """
    job = job if job is not None else job_facts()
    rec: dict[str, Any] = {
        "time": time.time(),
        "job_id": job.job_id,
        "restart": job.restart_count,
        "rank": rank,
        "host": host if host is not None else socket.gethostname(),
        "pid": os.getpid(),
        "kind": kind,
        "cause": cause.splitlines()[0][:500] if cause else "",
        "blame": [dict(b) for b in blame],
        "step": step,
        "signature": signature(kind, cause),
        **extra,
    }
    if detail:
        rec["detail"] = detail[-_DETAIL_CHARS:]
    append_line(_failures_path(run_dir), json.dumps(rec, default=str) + "\n")  # never through a link
    return rec


def read_failures(
    run_dir: str | os.PathLike[str], *, job_id: str | None = None, restart: int | None = None
) -> list[dict[str, Any]]:
    """Records of failures.jsonl (optionally of one job / one restart); unreadable lines are skipped."""
    path = _failures_path(run_dir)
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash mid-write
        if job_id is not None and rec.get("job_id") != job_id:
            continue
        if restart is not None and rec.get("restart") != restart:
            continue
        out.append(rec)
    return out


_HEALTH_TAIL_BYTES = 4 << 20  # the newest records: a gate verdict is one short line per node and attempt


def unhealthy_hosts(run_dir: str | os.PathLike[str], *, job_id: str | None = None) -> dict[str, str]:
    """host -> the cause of its newest ``health`` record (of job ``job_id`` when given), from the last
    _HEALTH_TAIL_BYTES of failures.jsonl (never through a link, never more however large the file grew)."""
    try:
        text = read_tail(_failures_path(run_dir), _HEALTH_TAIL_BYTES).decode("utf-8", "replace")
    except OSError:  # none yet, a link, not a regular file: nothing to show
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash mid-write, or the tail's first, partial line
        if not isinstance(rec, dict) or rec.get("kind") != "health" or not isinstance(rec.get("host"), str):
            continue
        if job_id is not None and str(rec.get("job_id")) != str(job_id):
            continue
        out[rec["host"][:200]] = str(rec.get("cause", ""))[:500]
    return out


def classify_exception(exc: BaseException) -> str:
    """``collective`` when the error says another rank is gone or stuck, else ``exception`` (this rank's own)."""
    text = f"{type(exc).__name__}: {exc}"
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"DistNetworkError", "DistStoreError"} or _PEER_ERRORS.search(text):
        return "collective"
    return "exception"


def record_exception(
    run_dir: str | os.PathLike[str], exc: BaseException, *, rank: int, host: str, step: int | None
) -> dict[str, Any] | None:
    """The trainer's exception path: record what this rank raised. Never raises itself (it runs while failing)."""
    try:
        kind = getattr(exc, "failure_kind", None) or classify_exception(exc)  # e.g. storage: "checkpoint"
        problems = getattr(exc, "problems", None)  # a ConfigError's first line is only its headline
        text = "; ".join(problems) if problems else str(exc).strip() or "(no message)"
        cause = f"{type(exc).__name__}: {text}"
        blame = [{"rank": rank, "host": host}] if kind == "exception" else []
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return record(run_dir, kind=kind, cause=cause, rank=rank, host=host, blame=blame, step=step, detail=detail)
    except Exception as e:
        print(f"hpcdist: could not record the failure in {run_dir}: {e}", file=sys.stderr)
        return None


def primary_failure(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The failure that started it: the earliest record that blames someone, else the earliest failure record.

    Ranks that lose a peer record ``collective`` errors within milliseconds, sometimes before the culprit's own
    record; ranks killed when srun ends the step may be recorded as ``killed`` later. Blame decides first, then time.
    A ``health`` record is the gate's verdict on a node, written before the attempt's step started (that node then
    ran no rank): it is the failure only when the step left none of its own (the gate left too few nodes), else a
    rank frozen after the gate would be blamed on the node the gate already took out.
    """
    failures = [r for r in records if r.get("kind") != "straggler"]
    failures = [r for r in failures if r.get("kind") != "health"] or failures
    blamed = [r for r in failures if r.get("blame")]
    pool = blamed or failures
    return min(pool, key=lambda r: r.get("time") or 0.0) if pool else None


# ------------------------------------------------------------------------------------------------ supervisor


def announce_task(run_dir: str | os.PathLike[str], *, rank: int, host: str, job: JobFacts | None = None) -> None:
    """Tell this rank's supervisor (if it has one) where to record a death by signal, and as whom."""
    path = os.environ.get(TASK_INFO_ENV)
    if not path:
        return
    job = job if job is not None else job_facts()
    info = {
        "failures": str(_failures_path(Path(run_dir).absolute())),
        "job_id": job.job_id,
        "restart": job.restart_count,
        "rank": rank,
        "host": host,
    }
    try:
        atomic_write(Path(path), json.dumps(info))
    except OSError as e:
        log.warning("could not write the supervisor's task info %s: %s", path, e)

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

from hpcdist.base.atomic import append_line, atomic_write
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import DamagedRecord, read_jsonl
from hpcdist.fault.supervise import TASK_INFO_ENV  # the supervisor names a file there; the rank says who it is in it
from hpcdist.schedulers import JobFacts, job_facts

__all__ = [
    "TASK_INFO_ENV",
    "announce_task",
    "classify_exception",
    "failure_record",
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


def failure_record(
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
    """One event as failures.jsonl holds it (see the module docstring), not written anywhere."""
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
    return rec


def record(run_dir: str | os.PathLike[str], **fields: Any) -> dict[str, Any]:
    """Append one event (:func:`failure_record`'s keywords) to <run_dir>/failures.jsonl and return it.

    One ``os.write`` of one line on an O_APPEND descriptor (hpcdist.base.atomic.append_line): ranks appending at the
    same moment do not interleave their lines on a local or Lustre/GPFS file system.
    """
    rec = failure_record(**fields)
    append_line(_failures_path(run_dir), json.dumps(rec, default=str) + "\n")  # never through a link
    return rec


_FAILURES_MAX_BYTES = 64 << 20  # the newest records: tens of thousands of events, each a few KiB at most


def read_failures(
    run_dir: str | os.PathLike[str], *, job_id: str | None = None, restart: int | None = None
) -> list[dict[str, Any]]:
    """Records of failures.jsonl (optionally of one job / one restart), from its last _FAILURES_MAX_BYTES.

    Read as records anyone could have written (hpcdist.base.untrusted): a line that does not parse, or is no failure
    record (no ``kind``), is skipped; the fields the restart policy reads are made their types (:func:`_valid`).
    DamagedRecord when the file is a link, a FIFO or no regular file."""
    out = []
    for rec in read_jsonl(_failures_path(run_dir), _FAILURES_MAX_BYTES):
        valid = _valid(rec)
        if valid is None:
            continue
        if job_id is not None and valid["job_id"] != job_id:
            continue
        if restart is not None and valid["restart"] != restart:
            continue
        out.append(valid)
    return out


def _valid(rec: dict[str, Any]) -> dict[str, Any] | None:
    """``rec`` with the fields the policy and the report read of their types: ``kind`` and ``cause`` strings (no
    kind: no failure record), ``signature`` computed when missing, ``blame`` only the entries naming a host,
    ``time`` a number (else None), ``job_id`` a string or None, ``restart`` and ``rank`` integers or None."""
    kind = rec.get("kind")
    if not isinstance(kind, str):
        return None
    out = dict(rec)
    cause = rec.get("cause") if isinstance(rec.get("cause"), str) else ""
    out["cause"] = cause
    if not isinstance(rec.get("signature"), str):
        out["signature"] = signature(kind, cause)
    blame = rec.get("blame") if isinstance(rec.get("blame"), list) else []
    out["blame"] = [
        {"rank": _int_or_none(b.get("rank")), "host": b["host"]}
        for b in blame
        if isinstance(b, dict) and isinstance(b.get("host"), str)
    ]
    t = rec.get("time")
    out["time"] = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
    out["job_id"] = rec.get("job_id") if isinstance(rec.get("job_id"), str) else None
    out["restart"] = _int_or_none(rec.get("restart"))
    out["rank"] = _int_or_none(rec.get("rank"))
    if "host" in out and not isinstance(out["host"], str):
        out["host"] = None
    return out


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_HEALTH_TAIL_BYTES = 4 << 20  # the newest records: a gate verdict is one short line per node and attempt


def unhealthy_hosts(run_dir: str | os.PathLike[str], *, job_id: str | None = None) -> dict[str, str]:
    """host -> the cause of its newest ``health`` record (of job ``job_id`` when given), from the last
    _HEALTH_TAIL_BYTES of failures.jsonl (never through a link, never more however large the file grew). Both as
    written: print them through hpcdist.base.untrusted.one_line."""
    try:
        recs = read_jsonl(_failures_path(run_dir), _HEALTH_TAIL_BYTES)
    except DamagedRecord:  # a link, not a regular file: nothing to show
        return {}
    out: dict[str, str] = {}
    for rec in recs:
        if rec.get("kind") != "health" or not isinstance(rec.get("host"), str):
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
